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


def save_sharded(root: str, async_save: bool, snapshot: str) -> dict:
    """Model weights that each rank holds a shard of (DTensor Shard(0) and Shard(1) on a 1-d mesh, an
    uneven Shard(0), a 2-d (4 ranks) Shard(0) x Shard(1)) next to a replicated one: each is gathered whole
    into one rank's safetensors file. Returns what the files hold and whether a load gives the shards back."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(5)
    full = {"rows": torch.randn(8 * world, 33, generator=g), "cols": torch.randn(17, 4 * world, generator=g),
            "uneven": torch.randn(2 * world + 1, 5, generator=g).to(torch.bfloat16),
            "replicated": torch.randn(70, 9, generator=g), "grid": torch.randn(12, 8, generator=g)}
    mesh = init_device_mesh("cpu", (world,))
    placements = {"rows": [Shard(0)], "cols": [Shard(1)], "uneven": [Shard(0)], "replicated": [Replicate()],
                  "grid": [Shard(0)]}
    model = {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items()}
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2))
        model["grid"] = distribute_tensor(full["grid"], mesh2, [Shard(0), Shard(1)])
    state = {"aux": torch.arange(6.0), "model": model,
             "optim": {k: distribute_tensor(v * 2, mesh, [Shard(0)]) for k, v in full.items() if k == "rows"}}
    path = os.path.join(root, "ckpt")
    h = unickpt.save(path, state, async_save=async_save, options=SaveOptions(safetensors="model.", snapshot=snapshot))
    if async_save:
        h.wait()
    dist.barrier()
    target = {"aux": torch.zeros(6), "model": {k: torch.zeros_like(v) for k, v in model.items()},
              "optim": {k: torch.zeros_like(v) for k, v in state["optim"].items()}}
    unickpt.load(path, target)
    same = all(torch.equal(target["model"][k].to_local(), v.to_local()) for k, v in model.items())
    same = same and torch.equal(target["optim"]["rows"].to_local(), state["optim"]["rows"].to_local())
    index = None
    if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            index = json.load(f)
    return {"files": sorted(os.listdir(path)), "index": index, "rank": rank,
            "loaded_equal": same and torch.equal(target["aux"], torch.arange(6.0)),
            "p2p_sends": h.stats.p2p_sends, "p2p_recvs": h.stats.p2p_recvs}
