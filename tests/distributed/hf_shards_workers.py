"""Workers of test_hf_shards.py: a data-parallel state (replicated weights, replicated optimizer
state) saved with ``SaveOptions.safetensors`` on every rank of a gloo group."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import unickpt
from unickpt import SaveOptions


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    weights = {f"layers.{i}.w": torch.randn(64 + 16 * i, 257, generator=g) for i in range(7)}
    weights["norm.bias"] = torch.randn(300, generator=g).to(torch.bfloat16)
    weights["pos_ids"] = torch.arange(33)
    optim = {f"exp_avg.{i}": torch.randn(64 + 16 * i, 257, generator=g) for i in range(7)}
    return {"model": weights, "optim": optim, "step": 7}


def save_replicated(root: str, async_save: bool, snapshot: str) -> dict:
    state = _state()
    path = os.path.join(root, "ckpt")
    h = unickpt.save(path, state, async_save=async_save, options=SaveOptions(safetensors="model.", snapshot=snapshot))
    if async_save:
        h.wait()
    dist.barrier()
    files = sorted(os.listdir(path))
    index = None
    if "model.safetensors.index.json" in files:
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            index = json.load(f)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
              "optim": {k: torch.zeros_like(v) for k, v in state["optim"].items()}, "step": 0}
    stats = unickpt.load(path, target)
    same = (all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
            and all(torch.equal(target["optim"][k], v) for k, v in state["optim"].items()) and target["step"] == 7)
    return {"files": files, "index": index, "bytes_per_rank": h.stats.bytes_per_rank, "loaded_equal": same,
            "bytes_read": stats.bytes_read}


def save_sharded(root: str) -> str:
    """A weight that each rank holds half of: the save must refuse it by name."""
    rank = dist.get_rank()
    state = {"model": {"w": torch.full((4, 3), float(rank))}}
    from unickpt.geometry import Box  # noqa: F401 - a sharded tensor through a DTensor-free path:
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state["model"]["w"] = DTensor.from_local(torch.full((2, 3), float(rank)), mesh, [Shard(0)])
    try:
        unickpt.save(os.path.join(root, "sharded"), state, options=SaveOptions(safetensors="model."))
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"
