"""Worker functions for test_load_errors.py (run on every rank of a DistPool)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import unickpt


def _fsdp2_net(hidden: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp2_refused_load(path: str) -> dict:
    """Save an FSDP2 model + AdamW (hidden 16, stepped), then load it into one whose first layer has
    another size (hidden 6) and a fresh AdamW: what the refusal says and what it left behind."""
    model = _fsdp2_net(16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optim.step()
    unickpt.save(path, {"model": model, "optim": optim})
    target = _fsdp2_net(6)
    fresh = torch.optim.AdamW(target.parameters(), lr=0.1)
    state_obj = fresh.state
    before = {n: p.to_local().clone() for n, p in target.named_parameters()}
    try:
        unickpt.load(path, {"model": target, "optim": fresh})
        error = None
    except unickpt.StateMismatchError as e:
        error = str(e)
    return {"error": error, "optim_state_len": len(fresh.state), "same_state_object": fresh.state is state_obj,
            "params_equal": all(torch.equal(before[n].view(torch.uint8) if before[n].numel() else before[n],
                                            p.to_local().view(torch.uint8) if p.to_local().numel() else p.to_local())
                                for n, p in target.named_parameters())}


def die_in_load(path: str, report: str) -> None:
    """Rank 1 dies (``os._exit``) while rank 0 loads (its first collective waits for rank 1); rank 0
    writes what its load raised."""
    unickpt.save(path, {"w": torch.ones(4)})
    if dist.get_rank() == 1:
        os._exit(3)
    try:
        unickpt.load(path, {"w": torch.zeros(4)})
        msg = "no error"
    except BaseException as e:  # noqa: BLE001 - the type and message are what is tested
        msg = f"{type(e).__name__}: {e}"
    with open(report, "w") as f:
        f.write(msg)


def save_per_rank(path: str) -> None:
    unickpt.save(path, {"rng": unickpt.RNGState(), "pos": unickpt.PerRank({"rank": dist.get_rank()})})
