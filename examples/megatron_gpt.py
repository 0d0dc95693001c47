"""A small megatron-core GPT checkpointed by unickpt through megatron's own dist_checkpointing API.

    torchrun --nproc_per_node 2 examples/megatron_gpt.py --tp 2 save /tmp/mcore_ckpt     # TP=2, async save
    torchrun --nproc_per_node 1 examples/megatron_gpt.py --tp 1 load /tmp/mcore_ckpt     # resharded to TP=1
    torchrun --nproc_per_node 4 examples/megatron_gpt.py --tp 2 --pp 2 load /tmp/mcore_ckpt
    unickpt inspect /tmp/mcore_ckpt/unickpt          # the unickpt part of megatron's checkpoint directory

Runs on CPU with gloo (megatron-core >= 0.16). ``save`` fills the model with values that depend only
on each parameter's key and global position, saves asynchronously, and prints a digest of the full
(gathered) parameters; ``load`` loads into any TP x PP (x DP) layout and prints the same digest.
The only unickpt-specific line is ``import unickpt.megatron`` and the backend name ``("unickpt", 1)``;
Megatron-LM training scripts need not even that: see docs/megatron.md (``--ckpt-format unickpt``).
"""
import argparse
import hashlib
import os
import time
import warnings


def build(tp: int, pp: int):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    cfg = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, pipeline_dtype=torch.float32,
                            params_dtype=torch.float32)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                    max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage())


def shards(model):
    """The model's ShardedTensors (megatron's factories applied: SwiGLU fc1 halves are views)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    return [sh for sh in nested_values(sd) if isinstance(sh, ShardedTensor)]


def fill(model, seed: float):
    """Every element becomes sin(global index * 0.1 + seed + len(key)): the same values on any layout."""
    import torch

    with torch.no_grad():
        for sh in shards(model):
            lengths = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            idx = torch.zeros(lengths, dtype=torch.float64)
            stride = 1
            for d in reversed(range(len(lengths))):
                shape = [1] * len(lengths)
                shape[d] = lengths[d]
                start = sh.global_offset[d]
                idx = idx + (torch.arange(start, start + lengths[d], dtype=torch.float64) * stride).view(shape)
                stride *= sh.global_shape[d]
            sh.data.copy_(torch.sin(idx * 0.1 + seed + len(sh.key)).reshape(sh.data.shape))


def digest(model) -> str:
    """sha256 over every key's full tensor, assembled on rank 0 from all ranks' shards (layout-free)."""
    import torch
    import torch.distributed as dist

    parts = [(sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
              (1,) * sh.prepend_axis_num + tuple(sh.local_shape), sh.data.detach().clone()) for sh in shards(model)]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, parts)
    if dist.get_rank() != 0:
        return ""
    full = {}
    for rank_parts in out:
        for key, gshape, offs, lens, data in rank_parts:
            t = full.setdefault(key, torch.zeros(gshape, dtype=data.dtype))
            t[tuple(slice(o, o + n) for o, n in zip(offs, lens))].copy_(data.reshape(lens))
    h = hashlib.sha256()
    for key in sorted(full):
        h.update(key.encode())
        h.update(full[key].numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("path")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    args = p.parse_args()
    warnings.filterwarnings("ignore")

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import unickpt.megatron  # noqa: F401  (registers the "unickpt" dist_checkpointing backend)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(args.tp, args.pp)
    layout = f"TP={args.tp} PP={args.pp} DP={ps.get_data_parallel_world_size()}"
    if args.mode == "save":
        fill(model, 0.5)
        want = digest(model)
        if rank == 0:
            os.makedirs(args.path, exist_ok=True)  # saving into a used directory overwrites it, as in megatron
        dist.barrier()
        state = model.sharded_state_dict()
        state["iteration"] = 100  # plain values go to megatron's common.pt
        t0 = time.perf_counter()
        request = dist_checkpointing.save(state, args.path, sharded_strategy=("unickpt", 1), async_sharded_save=True)
        stall = time.perf_counter() - t0
        fill(model, 9.0)  # the next training steps: they cannot reach the checkpoint
        if torch.cuda.is_available():  # how Megatron-LM schedules it
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            queue = AsyncCallsQueue()
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
            queue.close()
        else:  # megatron's AsyncCallsQueue needs CUDA; finish the request in this process instead
            request.execute_sync()
        if rank == 0:
            print(f"[save {layout}] stall {stall * 1e3:.1f} ms, committed {time.perf_counter() - t0:.2f} s, "
                  f"digest {want}, files {sorted(os.listdir(args.path))}")
    else:
        fill(model, -1.0)
        state = model.sharded_state_dict()
        state["iteration"] = 0
        loaded = dist_checkpointing.load(state, args.path)  # backend read from metadata.json
        iteration = loaded.pop("iteration")
        model.load_state_dict(loaded)
        got = digest(model)
        if rank == 0:
            print(f"[load {layout}] iteration {iteration}, digest {got}")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
