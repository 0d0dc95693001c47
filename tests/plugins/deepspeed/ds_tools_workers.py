"""torchrun worker for tests/plugins/deepspeed/test_deepspeed_tools.py: DeepSpeed's own checkpoint tools
(``deepspeed.utils.zero_to_fp32``, ``deepspeed.checkpoint.ds_to_universal``) on unickpt checkpoints.

  DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tests/plugins/deepspeed/ds_tools_workers.py save OUT
  DS_ACCELERATOR=cpu torchrun --nproc_per_node=1 tests/plugins/deepspeed/ds_tools_workers.py universal OUT

``save`` (2 ranks): per config, train 2 steps and save through unickpt (async); right after
``save_checkpoint`` returns, rank 0 runs DeepSpeed's functions on ``OUT/<config>``: the fp32 state dict
must equal the fp32 master weights DeepSpeed's ``safe_get_full_fp32_param`` gathers, bitwise, with the
frozen parameter and the buffer, tied names one tensor object, loadable with ``strict=True``; then
``ds_to_universal`` and, for reference, a DeepSpeed-native save of the same engine to ``OUT/native``.
``universal`` (1 rank): a fresh engine with ``"checkpoint": {"load_universal": true}`` loads each
``global_step2_universal`` and must hold the saved full state bitwise. Prints ``OK <phase> <config>``;
rank 0's tool checks print ``OK fp32 <config>`` or ``FAIL <check> <config>: <error>`` and the run goes on,
so that each test reports its own failure.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

import deepspeed  # noqa: E402  (the unickpt startup hook patches it here)
from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # bound at import, as DeepSpeed's tests do
from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint)

from ds_gather import gather_params  # noqa: E402  (this script's folder is on sys.path under torchrun)

CONFIGS = {  # name -> (ZeRO stage, bf16, tied weights)
    "z2bf16": (2, True, True),
    "z3": (3, False, True),
    "z3untied": (3, False, False),  # safetensors refuses tensors that share memory (DeepSpeed's output too)
}
TAG = "global_step2"


class Net(nn.Module):
    """``l1.weight`` is also ``l2.weight`` (when tied, as in DeepSpeed's test_convert_checkpoint.py), ``frozen``
    does not train, ``scale`` is a persistent buffer and ``tmp`` a non-persistent one. Odd sizes: every DP
    size splits the parameters unevenly."""

    def __init__(self, tie: bool):
        super().__init__()
        self.l0 = nn.Linear(16, 33)
        self.l1 = nn.Linear(33, 33)
        self.l2 = nn.Linear(33, 33)
        if tie:
            self.l2.weight = self.l1.weight
        self.frozen = nn.Linear(33, 33)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(33, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))
        self.register_buffer("tmp", torch.ones(4), persistent=False)

    def forward(self, x):
        h = torch.relu(self.l0(x))
        h = torch.relu(self.l1(h))
        h = torch.relu(self.frozen(self.l2(h)))
        return self.head(h) * self.scale.to(x.dtype)


def make(name: str, seed: int, universal: bool = False, unickpt: bool = True):
    stage, bf16, tie = CONFIGS[name]
    torch.manual_seed(seed)
    model = Net(tie)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
        "bf16": {"enabled": bf16},
    }
    if unickpt:
        cfg["unickpt"] = {"enabled": True, "async_save": True}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    return engine


def train_step(engine, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    loss = (engine(x.to(dtype)).float() - y).pow(2).mean()
    engine.backward(loss)
    engine.step()


def gather(engine) -> dict:
    """The full state, by DeepSpeed's own APIs: :func:`ds_gather.gather_params` (``lp.<name>`` module weights,
    ``fp32.<name>`` / ``exp_avg.<name>`` / ``exp_avg_sq.<name>`` for trainable parameters; collective under
    ZeRO-3) and ``buffer.scale``."""
    out = gather_params(engine)
    out["buffer.scale"] = engine.module.scale.clone()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(bits(got), bits(want)), (what, (got.float() - want.float()).abs().max().item())


def expected_fp32(name: str, full: dict, exclude_frozen: bool = False) -> dict:
    """What DeepSpeed's zero_to_fp32 gives: buffers as float32, frozen parameters in their stored dtype,
    trainable ones as their fp32 master weights; a tied name maps to its first name's tensor."""
    tie = CONFIGS[name][2]
    want = {"scale": full["buffer.scale"].float()}
    if not exclude_frozen:
        want.update({"frozen.weight": full["lp.frozen.weight"], "frozen.bias": full["lp.frozen.bias"]})
    for key, t in full.items():
        if key.startswith("fp32."):
            want[key[len("fp32."):]] = t
    if tie:
        want["l2.weight"] = want["l1.weight"]
    return want


def check_fp32(sd: dict, want: dict, tie: bool, what: str) -> None:
    assert list(sd)[0] == "scale" and sorted(sd) == sorted(want), (what, list(sd), sorted(want))
    for k, w in want.items():
        assert_same(sd[k], w, f"{what} {k}")
    if tie:
        assert id(sd["l2.weight"]) == id(sd["l1.weight"]), what


def check_in_process(name: str, save_dir: str, out: str, full: dict, want: dict, tie: bool) -> None:
    """Rank 0: DeepSpeed's zero_to_fp32 functions on the unickpt checkpoint ``save_dir``."""
    sd = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    check_fp32(sd, want, tie, f"{name} in process")
    Net(tie).load_state_dict(sd, strict=True)
    check_fp32(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=TAG, exclude_frozen_parameters=True),
               expected_fp32(name, full, exclude_frozen=True), tie, f"{name} exclude_frozen")
    bin_dir = os.path.join(out, f"{name}_bin")
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, bin_dir)
    check_fp32(torch.load(os.path.join(bin_dir, "pytorch_model.bin"), weights_only=True),
               {k: v.float() for k, v in want.items()}, tie, f"{name} pytorch_model.bin")
    model = load_state_dict_from_zero_checkpoint(Net(tie), save_dir)
    for k, v in model.state_dict().items():
        assert_same(v, want[k].float(), f"{name} load_state_dict_from_zero_checkpoint {k}")


def phase_save(out: str) -> None:
    rank = dist.get_rank()
    for name, (_, _, tie) in CONFIGS.items():
        save_dir = os.path.join(out, name)
        e = make(name, seed=1)
        for step in range(2):
            train_step(e, step)
        e.save_checkpoint(save_dir, tag=TAG)  # async: returns before the commit and before `latest`
        full = gather(e)
        if rank == 0:
            want = expected_fp32(name, full)
            # DeepSpeed writes every floating tensor as fp32 (a tie stays one tensor: .float() of fp32 is itself)
            torch.save({k: v.float() for k, v in want.items()}, os.path.join(out, f"{name}_fp32_ref.pt"))
            torch.save(full, os.path.join(out, f"{name}_full.pt"))
            try:  # right after the save returned: the tool waits for its commit and `latest`
                check_in_process(name, save_dir, out, full, want, tie)
                print(f"OK fp32 {name}", flush=True)
            except Exception as err:  # noqa: BLE001 - reported to the test; the next checks still run
                print(f"FAIL fp32 {name}: {type(err).__name__}: {err}", flush=True)
            try:
                ds_to_universal(SimpleNamespace(input_folder=os.path.join(save_dir, TAG),
                                                output_folder=os.path.join(save_dir, f"{TAG}_universal"),
                                                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                                strict=True, inject_missing_state=False))
            except Exception as err:  # noqa: BLE001
                print(f"FAIL ds_to_universal {name}: {type(err).__name__}: {err}", flush=True)
        dist.barrier()
        e.destroy()
        if name == "z2bf16":  # DeepSpeed's own files of the same run, without the block
            native = make(name, seed=1, unickpt=False)
            for step in range(2):
                train_step(native, step)
            native.save_checkpoint(os.path.join(out, "native"), tag=TAG)
            native.destroy()
        print(f"OK save {name} rank={rank}", flush=True)


def phase_universal(out: str) -> None:
    ws = dist.get_world_size()
    for name in CONFIGS:
        e = make(name, seed=7, universal=True)
        # z3 without a tag: under load_universal DeepSpeed reads 'latest_universal' (not 'latest', which names TAG)
        path, _ = e.load_checkpoint(os.path.join(out, name), tag=None if name == "z3" else f"{TAG}_universal")
        assert path == os.path.join(out, name, f"{TAG}_universal"), path
        got, want = gather(e), torch.load(os.path.join(out, f"{name}_full.pt"), weights_only=True)
        assert sorted(got) == sorted(want), (name, sorted(set(got) ^ set(want)))
        for k in want:
            assert_same(got[k], want[k], f"{name} universal ws={ws} {k}")
        train_step(e, 5)  # it trains on
        e.destroy()
        print(f"OK universal {name} ws={ws}", flush=True)


if __name__ == "__main__":
    phase, out = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    {"save": phase_save, "universal": phase_universal}[phase](out)
    dist.destroy_process_group()
