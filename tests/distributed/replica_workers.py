"""Worker functions for the replica-check tests in test_dist_semantics.py and test_replica_drift.py
(every rank of a DistPool)."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

import unickpt
from unickpt.engine import get_engine
from unickpt.saving import replicas


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


def _drift_state(tag: str) -> dict:
    """Three replicated (plain) tensors: 4 MiB, 256 KiB and 24 bytes, the same on every rank."""
    g = torch.Generator().manual_seed(11)
    return {f"big{tag}": torch.randn(1 << 20, generator=g), f"mid{tag}": torch.randn(64 << 10, generator=g),
            f"tiny{tag}": torch.arange(6.0)}


def _drift(state: dict, tag: str, where: str) -> None:
    """Change rank 1's copy in place: ``"big_all"`` every element of the 4 MiB tensor (a missed
    all-reduce), ``"big_one"`` one element of it between the windows the first save samples,
    ``"mid_last"`` the last element of the 256 KiB one, ``"tiny"`` the 24-byte one."""
    if where == "big_all":
        state[f"big{tag}"].add_(1e-3)
    elif where == "big_one":
        state[f"big{tag}"][300_000] += 1.0  # bytes 1_200_000..3: between the 5th and 6th "first" windows
    elif where == "mid_last":
        state[f"mid{tag}"][-1] += 1.0
    elif where == "tiny":
        state[f"tiny{tag}"][2] = -1.0


def drift_after_first_save(root: str, tag: str, where: str, saves: int, slots: int | None = None) -> dict:
    """Save the state of :func:`_drift_state` (committed), drift rank 1's copy (:func:`_drift`), then
    save the same layout up to ``saves`` more times (each into its own directory, removed once
    committed) until one raises. Returns the 1-based index of the save that raised (None: none did),
    its error and message, the plan collectives of the saves that passed, and whether the first
    checkpoint is still committed and loads back bitwise equal to the state saved in it. ``slots``:
    holder sets whose digests fit the signature exchange (``replicas.SLOTS``; 0: none, every sample
    is compared by its own collectives)."""
    if slots is not None:
        old, replicas.SLOTS = replicas.SLOTS, slots
        try:
            return drift_after_first_save(root, tag, where, saves)
        finally:
            replicas.SLOTS = old
    rank = dist.get_rank()
    state = _drift_state(tag)
    saved = {k: v.clone() for k, v in state.items()}
    first = os.path.join(root, f"{tag}_0")
    unickpt.save(first, state)
    if rank == 1:
        _drift(state, tag, where)
    out = {"caught_at": None, "error": None, "message": None, "left": None, "plan": []}
    for i in range(1, saves + 1):
        path = os.path.join(root, f"{tag}_{i}")
        try:
            h = unickpt.save(path, state)
        except unickpt.ReplicaMismatchError as e:
            out.update(caught_at=i, error=type(e).__name__, message=str(e),
                       left=os.path.exists(os.path.join(path, "metadata.json")))
            break
        out["plan"].append(h.stats.collectives_plan)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
    back = {k: torch.zeros_like(v) for k, v in saved.items()}
    unickpt.load(first, back)
    out["first_intact"] = all(torch.equal(back[k], saved[k]) for k in saved)
    return out


def drift_in_a_holder_subset(root: str, tag: str) -> dict:
    """Three ranks: a 4 MiB plain tensor (held by all) and a (1024, 1024) tensor whose rows 0-511 ranks
    0 and 1 both hold (a replicated box: holder sets (0, 1, 2) and (0, 1)) and rows 512-1023 rank 2
    alone. After a first save, rank 1's copy of the shared rows drifts; the next save must raise.
    Returns what :func:`drift_after_first_save` returns, for two saves after the drift."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(1024, 1024, generator=g)
    rows = full[:512].clone() if rank < 2 else full[512:].clone()
    state = {f"all{tag}": torch.randn(1 << 20, generator=g),
             f"pair{tag}": unickpt.Shard(rows, (1024, 1024), offsets=(0 if rank < 2 else 512, 0))}
    first = os.path.join(root, f"{tag}_0")
    unickpt.save(first, state)
    out = {"caught_at": None, "error": None, "message": None, "plan": []}
    if rank == 1:
        rows.mul_(1.0001)
    for i in (1, 2):
        try:
            h = unickpt.save(os.path.join(root, f"{tag}_{i}"), state)
        except unickpt.ReplicaMismatchError as e:
            out.update(caught_at=i, error=type(e).__name__, message=str(e))
            break
        out["plan"].append(h.stats.collectives_plan)
    back = {f"pair{tag}": torch.zeros(1024, 1024)}
    unickpt.load(first, back, strict=False)
    out["first_intact"] = torch.equal(back[f"pair{tag}"], full)
    return out
