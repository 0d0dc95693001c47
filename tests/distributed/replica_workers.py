"""Worker functions for the replica-check tests in test_dist_semantics.py (every rank of a DistPool)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import unickpt
from unickpt.engine import get_engine


def save_replicas(root: str, tag: str, differ: str, check: str | None) -> dict:
    """Save ``{"experts.0.w", "shared", "bias"}`` as plain (replicated) tensors; ``differ`` names which
    differ per rank ("none", "experts": 2 MiB, different on every rank, "tail": the last byte of a
    4 MiB tensor on rank 1, "bias" a small tensor on the last rank). Returns the error, if any."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    engine = get_engine()
    old = engine.options
    if check is not None:
        engine.configure(check_replicas=check)
    try:
        g = torch.Generator().manual_seed(3)
        experts = torch.randn(512, 1024, generator=g)
        shared = torch.randn(1 << 20, generator=g)
        bias = torch.arange(6.0)
        if differ == "experts":
            experts = experts + rank  # experts renumbered from 0 on every rank: other weights, one name
        elif differ == "tail" and rank == 1:
            shared[-1] += 1.0
        elif differ == "bias" and rank == ws - 1:
            bias[2] = -1.0
        state = {f"experts.0.w{tag}": experts, f"shared{tag}": shared, f"bias{tag}": bias}
        try:
            h = unickpt.save(os.path.join(root, tag), state)
        except unickpt.ReplicaMismatchError as e:
            return {"error": type(e).__name__, "message": str(e),
                    "committed": os.path.exists(os.path.join(root, tag, "metadata.json"))}
        return {"error": None, "plan": h.stats.collectives_plan, "hit": h.stats.plan_cache_hit}
    finally:
        engine.options = old


def save_twice_then_differ(root: str, tag: str, check: str) -> list:
    """The same layout three times: equal, equal, then different on rank 1 (a layout planned before)."""
    out = []
    for i, differ in enumerate(("none", "none", "tail")):
        out.append(save_replicas(root, f"{tag}_{i}", differ, check) if i == 0 else
                   _same_layout(root, f"{tag}_0", f"{tag}_{i}", differ, check))
    return out


def _same_layout(root: str, names_tag: str, dir_tag: str, differ: str, check: str) -> dict:
    rank = dist.get_rank()
    engine = get_engine()
    old = engine.options
    engine.configure(check_replicas=check)
    try:
        g = torch.Generator().manual_seed(3)
        state = {f"experts.0.w{names_tag}": torch.randn(512, 1024, generator=g),
                 f"shared{names_tag}": torch.randn(1 << 20, generator=g), f"bias{names_tag}": torch.arange(6.0)}
        if differ == "tail" and rank == 1:
            state[f"shared{names_tag}"][-1] += 1.0
        try:
            h = unickpt.save(os.path.join(root, dir_tag), state)
        except unickpt.ReplicaMismatchError as e:
            return {"error": type(e).__name__, "message": str(e)}
        return {"error": None, "plan": h.stats.collectives_plan, "hit": h.stats.plan_cache_hit}
    finally:
        engine.options = old


def mismatch_then_retry(root: str, tag: str) -> list:
    """Save a state whose replicated tensor differs on rank 1 twice into one path (both must fail: the
    failed layout is not cached as checked), then the agreeing state into the same path (the failed
    save's leftovers are this process's own: replaced), then load it back."""
    rank = dist.get_rank()
    path = os.path.join(root, tag)
    out = []
    for differ in (True, True, False):
        state = {f"w{tag}": torch.full((4,), float(rank if differ else 7))}
        try:
            unickpt.save(path, state)
            out.append(None)
        except unickpt.ReplicaMismatchError as e:
            out.append(type(e).__name__)
    back = {f"w{tag}": torch.zeros(4)}
    unickpt.load(path, back)
    out.append(back[f"w{tag}"].tolist())
    return out
