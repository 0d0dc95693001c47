"""One format, any framework (docs/cross-framework.md): a run saved by one framework resumes in another
with resharding, and Megatron-core <-> Hugging Face Llama, with the real frameworks on CPU (gloo).

- DeepSpeed ZeRO-2 (fp32, the JSON block) on 2 ranks, 20 steps -> plain FSDP2 on 3 ranks
  (``unickpt.load(..., mapping="auto")``): weights (the fp32 master copies), Adam's ``exp_avg`` /
  ``exp_avg_sq`` and step bitwise equal to DeepSpeed's own full state at the save
  (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), the LambdaLR schedule and step counter
  moved, each rank reading exactly its shards' bytes; the next 10 losses equal the uninterrupted DeepSpeed
  run's within ``LOSS_RTOL``; targets that cannot take the checkpoint are refused by name on every rank
  and left untouched; a DeepSpeed engine refuses another framework's checkpoint.
- Lightning ``ModelParallelStrategy`` (FSDP2) on 2 devices -> Accelerate (DDP) on 3 processes
  (``accelerator.load_state(<Lightning pointer file>)``), and Accelerate on 2 -> Lightning on 3
  (``trainer.fit(ckpt_path=<Accelerate folder>)``): the same checks, the loop resuming at step 20.
- Megatron-core GPT (SwiGLU, grouped-query attention, RMSNorm, RoPE) at TP 2 -> ``unickpt export --to
  hf-llama`` -> ``transformers`` ``from_pretrained``: logits equal within ``LOGIT_ATOL`` (fp32), and the same
  checkpoint resharded to TP 1 x PP 2 exports bitwise the same tensors; a
  ``LlamaForCausalLM`` built from a config -> ``save_pretrained`` -> ``unickpt import --to megatron`` -> the
  megatron model at TP 2 (``dist_checkpointing.load``): logits equal within ``LOGIT_ATOL``.

Measured on this machine: loss differences up to 1.6e-7 (relative up to 1.3e-7), logit differences up to 1.8e-7.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
from cross_common import MEGATRON_CONFIG as CONFIG, TOKENS, compare  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # several framework runs on a busy 2-core machine

LOSS_RTOL = 1e-5  # the frameworks sum gradients and losses in other orders: equal up to float32 rounding
LOGIT_ATOL = 1e-5


def run(cmd: list[str], timeout: int = 900, **env: str) -> str:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for var in ("UNICKPT_DEEPSPEED", "UNICKPT_ACCELERATE", "UNICKPT_LIGHTNING"):
        full_env.pop(var, None)
    res = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    return res.stdout


def torchrun(nproc: int, *args: str, **env: str) -> str:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args], **env)


def losses_close(reference: dict | list, resumed: dict | list) -> float:
    """The largest relative difference; asserts it is within LOSS_RTOL."""
    pairs = list(zip(reference, resumed)) if isinstance(reference, list) else [(reference[k], resumed[k]) for k in resumed]
    worst = max(abs(a - b) / abs(a) for a, b in pairs)
    assert worst <= LOSS_RTOL, pairs
    return worst


# -- DeepSpeed ZeRO-2 -> FSDP2 -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepspeed_to_fsdp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_fsdp2")
    worker = os.path.join(HERE, "ds_fsdp2.py")
    torchrun(2, worker, "ds", str(out), DS_ACCELERATOR="cpu")
    torchrun(3, worker, "fsdp2", str(out))
    return out


def test_deepspeed_zero2_resumes_in_fsdp2_on_another_world_size(deepspeed_to_fsdp2):
    out = deepspeed_to_fsdp2
    saved, loaded = torch.load(out / "saved.pt"), torch.load(out / "loaded.pt")
    assert compare(saved["tensors"], loaded["tensors"]) == []  # weights, exp_avg, exp_avg_sq: bitwise
    assert len(saved["tensors"]) == 19
    assert loaded["meta"]["steps"] == saved["meta"]["steps"] == [20.0]  # Adam's step, every parameter
    assert loaded["meta"]["lr"] == saved["meta"]["lr"] and loaded["meta"]["sched"] == saved["meta"]["sched"]
    assert loaded["meta"]["step"] == saved["meta"]["global_steps"] == 20
    assert loaded["meta"]["conversion"]["from"] == "deepspeed"
    assert loaded["meta"]["conversion"]["left_behind"] == ["client_state"]
    reference = json.load(open(out / "ds.json"))["losses"][20:]
    resumed = json.load(open(out / "fsdp2.json"))["losses"]
    assert len(resumed) == 10
    losses_close(reference, resumed)


def test_each_fsdp2_rank_reads_only_its_shards_bytes(deepspeed_to_fsdp2):
    doc = json.load(open(deepspeed_to_fsdp2 / "fsdp2.json"))
    assert sum(local for _, local in doc["read"]) == doc["total_numel"] == 1477
    for bytes_read, local in doc["read"]:  # master weights, exp_avg, exp_avg_sq of its shards + the buffer
        assert bytes_read == 3 * 4 * local + 4 * 4


def test_what_cannot_move_is_refused_by_name_before_anything_changes(deepspeed_to_fsdp2):
    doc = json.load(open(deepspeed_to_fsdp2 / "fsdp2.json"))
    errors = doc["errors"]
    assert doc["errors_every_rank"]
    assert all(errors[f"{k}.untouched"] for k in ("sgd", "no_scheduler", "bf16", "other_scheduler"))
    assert "the checkpoint's optimizer keeps ['exp_avg', 'exp_avg_sq'] per parameter, the optimizer to load into " \
           "keeps ['momentum_buffer']" in errors["sgd"]
    assert "'scheduler': the checkpoint holds an LR scheduler" in errors["no_scheduler"]
    assert "has none; it cannot move" in errors["no_scheduler"]
    assert "19 tensor(s) differ in dtype or shape (never cast or reshaped; stored -> state: float32 -> bfloat16)" \
           in errors["bf16"]
    assert "'model.body.0.weight' <- 'module.body.0.weight' (float32 [33, 16] -> bfloat16 [33, 16])" in errors["bf16"]
    assert "'scheduler': the checkpoint's scheduler state has keys" in errors["other_scheduler"]
    assert "'gamma', 'last_epoch', 'step_size']" in errors["other_scheduler"]
    # a layer of another size: refused by name; the fresh AdamW holds no state afterwards (it held zero-filled
    # state for every parameter), the parameters are bitwise as they were
    assert "'model.body.2.weight' <- 'optimizer.fp32.body.2.weight' (float32 [24, 33] -> float32 [20, 33])" \
        in errors["layer_size"], errors["layer_size"]
    assert errors["layer_size.optim_empty"] and errors["layer_size.untouched"]
    assert doc["weights_only_equal"]  # a model alone (evaluation) takes the weights, the optimizer state stays behind
    refused = json.load(open(deepspeed_to_fsdp2 / "ds.json"))["refused"]
    assert refused.endswith("other/plain' was written by unickpt.save; a DeepSpeed engine loads DeepSpeed checkpoints "
                            "only (load it into FSDP / Accelerate / Lightning, which read other frameworks' "
                            "checkpoints: docs/cross-framework.md)")


# -- Lightning <-> Accelerate --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_accelerate(tmp_path_factory):
    out = tmp_path_factory.mktemp("pl_acc")
    worker = os.path.join(HERE, "lightning_accelerate.py")
    common = ["--max-steps", "30"]
    run([sys.executable, worker, "lightning", str(out), "pl", "--devices", "2", "--save-at", "20", *common])
    torchrun(2, worker, "accelerate", str(out), "acc", "--save-at", "20", *common, ACCELERATE_USE_CPU="1")
    torchrun(3, worker, "accelerate", str(out), "pl2acc", "--resume", str(out / "pl_ckpt" / "step=20.ckpt"), *common,
             ACCELERATE_USE_CPU="1")
    run([sys.executable, worker, "lightning", str(out), "acc2pl", "--devices", "3", "--resume", str(out / "acc_ckpt"),
         *common])
    return out


@pytest.mark.parametrize("source,resumed", [("pl", "pl2acc"), ("acc", "acc2pl")])
def test_lightning_and_accelerate_resume_each_other(lightning_accelerate, source, resumed):
    out = lightning_accelerate
    saved, loaded = torch.load(out / f"{source}_saved.pt"), torch.load(out / f"{resumed}_loaded.pt")
    assert compare(saved["tensors"], loaded["tensors"]) == []  # weights, buffer, exp_avg, exp_avg_sq, step: bitwise
    assert {k.split(".")[0] for k in saved["tensors"]} == {"param", "exp_avg", "exp_avg_sq", "step"}
    assert loaded["lr"] == saved["lr"] and loaded["sched"] == saved["sched"] and loaded["sched"]["last_epoch"] == 20
    assert loaded["step"] == saved["step"] == 20
    assert loaded["epoch"] == 2  # two epochs of 10 steps done: Lightning's loops / Accelerate's dataloader counter
    reference = json.load(open(out / f"{source}.json"))["losses"]
    after = json.load(open(out / f"{resumed}.json"))
    assert sorted(after["losses"], key=int) == [str(s) for s in range(21, 31)]
    if resumed == "acc2pl":
        assert after["global_step"] == 30
    losses_close(reference, after["losses"])


# -- Megatron-core <-> Hugging Face Llama ---------------------------------------------------------------
def _hf_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


def test_megatron_tp2_exports_to_a_transformers_llama_with_equal_logits(tmp_path):
    worker = os.path.join(HERE, "megatron_hf.py")
    torchrun(2, worker, "save", str(tmp_path / "mcore"), str(tmp_path / "mcore.pt"))
    refused = subprocess.run([sys.executable, "-m", "unickpt", "export", str(tmp_path / "mcore"), str(tmp_path / "x"),
                              "--to", "hf-llama"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().endswith(
        "unickpt export: --model-config needs 'num_attention_heads' (the stored shapes do not tell the head count)")
    assert not os.path.exists(tmp_path / "x")
    cfg = json.dumps({"num_attention_heads": 4, "layernorm_epsilon": 1e-5, "rotary_base": 10000})
    run([sys.executable, "-m", "unickpt", "export", str(tmp_path / "mcore"), str(tmp_path / "hf"), "--to", "hf-llama",
         "--model-config", cfg])
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["intermediate_size"], config["tie_word_embeddings"]) == (4, 2, 8, 48, False)
    ref = torch.load(tmp_path / "mcore.pt")
    diff = (_hf_logits(str(tmp_path / "hf"), ref["tokens"]) - ref["logits"]).abs().max().item()
    assert diff <= LOGIT_ATOL, diff
    # online, without the export: the megatron checkpoint loaded straight into a transformers model
    import unickpt
    from transformers import AutoConfig, LlamaForCausalLM
    from unickpt.megatron.hf import llama_rules

    model = LlamaForCausalLM(AutoConfig.from_pretrained(tmp_path / "hf")).eval()
    stats = unickpt.load(tmp_path / "mcore", {"model": model}, mapping=unickpt.Mapping(llama_rules(4, 2, 8, to="hf")))
    assert stats.conversion["from"] == "megatron" and stats.conversion["tensors"] == 21
    with torch.no_grad():
        online = model(ref["tokens"]).logits
    assert (online - ref["logits"]).abs().max().item() <= LOGIT_ATOL
    # pipeline-parallel shards: the checkpoint resharded to TP 1 x PP 2 (a layer per stage) exports the same bytes
    torchrun(2, worker, "pp2", str(tmp_path / "mcore"), str(tmp_path / "mcore_pp2"))
    run([sys.executable, "-m", "unickpt", "export", str(tmp_path / "mcore_pp2"), str(tmp_path / "hf_pp2"), "--to",
         "hf-llama", "--model-config", cfg])
    from safetensors.torch import load_file

    tp2, pp2 = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf_pp2" / "model.safetensors")
    assert sorted(pp2) == sorted(tp2) and len(tp2) == 21
    assert all(torch.equal(pp2[k], tp2[k]) for k in tp2)
    assert json.load(open(tmp_path / "hf_pp2" / "config.json")) == config


def test_a_transformers_llama_imports_into_megatron_tp2_with_equal_logits(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=CONFIG["vocab_size"], hidden_size=CONFIG["hidden_size"],
                      intermediate_size=CONFIG["ffn_hidden_size"], num_hidden_layers=CONFIG["num_layers"],
                      num_attention_heads=CONFIG["num_attention_heads"], num_key_value_heads=CONFIG["num_query_groups"],
                      rms_norm_eps=CONFIG["layernorm_epsilon"], rope_theta=float(CONFIG["rotary_base"]),
                      tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # not the init's ones and zeros (norms): every tensor matters
            p.normal_(0, 0.2)
        expected = model(TOKENS).logits
    model.save_pretrained(tmp_path / "hf")
    out = run([sys.executable, "-m", "unickpt", "import", str(tmp_path / "hf"), str(tmp_path / "mcore"), "--to",
               "megatron", "--json"])
    report = json.loads(out)
    assert report["source"] == "hf->megatron"
    assert sorted(os.listdir(tmp_path / "mcore")) == ["common.pt", "metadata.json", "unickpt"]
    torchrun(2, os.path.join(HERE, "megatron_hf.py"), "load", str(tmp_path / "mcore"), str(tmp_path / "mcore.pt"))
    got = torch.load(tmp_path / "mcore.pt")["logits"]
    diff = (got - expected).abs().max().item()
    assert diff <= LOGIT_ATOL, diff
    # and back: the import recorded the source's config.json, so the export needs no --model-config and
    # writes the same settings (break test: eps, positions and token ids fell back to defaults)
    run([sys.executable, "-m", "unickpt", "export", str(tmp_path / "mcore"), str(tmp_path / "hf_again"), "--to",
         "hf-llama"])
    again, source = json.load(open(tmp_path / "hf_again" / "config.json")), cfg.to_dict()
    rope = lambda d: d.get("rope_theta") or d["rope_parameters"]["rope_theta"]  # noqa: E731 (transformers 5)
    assert rope(again) == rope(source) == CONFIG["rotary_base"]
    for key in ("rms_norm_eps", "max_position_embeddings", "num_attention_heads", "num_key_value_heads",
                "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "bos_token_id",
                "eos_token_id", "tie_word_embeddings"):
        assert again[key] == source[key], (key, again[key], source[key])
    from safetensors.torch import load_file

    back, original = load_file(tmp_path / "hf_again" / "model.safetensors"), model.state_dict()
    assert sorted(back) == sorted(k for k in original if not k.endswith("rotary_emb.inv_freq"))
    assert all(torch.equal(back[k], original[k]) for k in back)
    bad = subprocess.run([sys.executable, "-m", "unickpt", "export", str(tmp_path / "mcore"), str(tmp_path / "bad"),
                          "--to", "hf-llama", "--model-config", '{"num_attention_heads": 0}'],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "'num_attention_heads' must be a positive integer, got 0" in bad.stderr, bad.stderr
    assert not os.path.exists(tmp_path / "bad")
