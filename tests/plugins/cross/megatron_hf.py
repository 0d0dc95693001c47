"""torchrun worker: a megatron-core GPT (Llama-like: SwiGLU, RMSNorm, RoPE, grouped-query attention, no
bias, untied output layer) at tensor parallel 2 on CPU (gloo), saving and loading through the unickpt
backend, and its logits on fixed tokens (gathered over the TP ranks) for comparison with
``transformers``' LlamaForCausalLM (tests/plugins/cross/test_cross_framework.py).

    torchrun --nproc_per_node=2 megatron_hf.py save CKPT_DIR LOGITS     random weights, save, logits
    torchrun --nproc_per_node=2 megatron_hf.py load CKPT_DIR LOGITS     load (e.g. an HF import), logits
    torchrun --nproc_per_node=2 megatron_hf.py pp2 CKPT_DIR OUT_DIR     load at TP 1 x PP 2, save to OUT_DIR
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))
import megatron_cuda_shim  # noqa: E402,F401  (test-only: megatron-core's checkpoint path calls torch.cuda)

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cross_common import MEGATRON_CONFIG as CONFIG, TOKENS  # noqa: E402


def build(tp: int, seed: int = 0, pp: int = 1):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=CONFIG["num_layers"], hidden_size=CONFIG["hidden_size"],
        num_attention_heads=CONFIG["num_attention_heads"], num_query_groups=CONFIG["num_query_groups"],
        ffn_hidden_size=CONFIG["ffn_hidden_size"], use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, layernorm_epsilon=CONFIG["layernorm_epsilon"], params_dtype=torch.float32,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=CONFIG["vocab_size"], max_sequence_length=64, position_embedding_type="rope",
                     rotary_base=CONFIG["rotary_base"], share_embeddings_and_output_weights=False,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    # test-only: the CUDA RNG tracker (dropout in tensor-parallel regions) cannot run without CUDA; dropout is 0
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return model.eval()


def logits(model) -> torch.Tensor:
    """Full-vocabulary logits ``[1, seq, vocab]`` (the output layer's TP shards gathered), fp32."""
    from megatron.core import parallel_state as ps

    s = TOKENS.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s), diagonal=1).bool()
    with torch.no_grad():
        local = model(TOKENS, torch.arange(s).view(1, s), attention_mask=mask)
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def main() -> None:
    import unickpt.megatron  # noqa: F401  registers the unickpt backend
    from megatron.core import dist_checkpointing

    mode, ckpt, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    if mode == "pp2":  # the same checkpoint resharded to pipeline stages (one layer each) and saved again
        model = build(tp=1, seed=7, pp=2)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), out, sharded_strategy=("unickpt", 1))
        dist.barrier()
        dist.destroy_process_group()
        return
    model = build(tp=2, seed=0 if mode == "save" else 7)
    if mode == "save":
        if dist.get_rank() == 0:
            os.makedirs(ckpt, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), ckpt, sharded_strategy=("unickpt", 1))
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
    result = logits(model)
    if dist.get_rank() == 0:
        torch.save({"tokens": TOKENS, "logits": result, "config": CONFIG}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
