"""Rank-side functions for test_mapping_dist.py: mapping rules (Permute, Split, Fuse) composed with
resharding on a real gloo group. Values are a function of the global index, so every rank knows what
each of its elements must be."""
from __future__ import annotations

import torch
import torch.distributed as dist

import unickpt

HEADS, GROUPS, HEAD_DIM, HIDDEN = 8, 2, 3, 5
ROWS = (HEADS + 2 * GROUPS) * HEAD_DIM  # megatron's fused, head-interleaved linear_qkv: 36 rows


def qkv_full() -> torch.Tensor:
    return torch.arange(ROWS * HIDDEN, dtype=torch.float32).view(ROWS, HIDDEN) * 0.5 + 1


def order() -> tuple[int, ...]:
    per = HEADS // GROUPS
    q = [g * (per + 2) + j for g in range(GROUPS) for j in range(per)]
    k = [g * (per + 2) + per for g in range(GROUPS)]
    v = [g * (per + 2) + per + 1 for g in range(GROUPS)]
    return tuple(q + k + v)


def plain_qkv() -> dict[str, torch.Tensor]:
    """q, k, v as Hugging Face keeps them, from the megatron tensor (the reference)."""
    w = qkv_full().view(GROUPS, HEADS // GROUPS + 2, HEAD_DIM, HIDDEN)
    return {"q": w[:, :-2].reshape(-1, HIDDEN), "k": w[:, -2].reshape(-1, HIDDEN), "v": w[:, -1].reshape(-1, HIDDEN)}


def rows_of(n: int) -> tuple[int, int]:
    """This rank's row range of an ``n``-row tensor cut into contiguous, uneven-at-the-end blocks."""
    r, w = dist.get_rank(), dist.get_world_size()
    per = -(-n // w)
    lo = min(n, r * per)
    return lo, min(n, lo + per) - lo


def shard(full: torch.Tensor) -> unickpt.Shard:
    lo, n = rows_of(full.shape[0])
    return unickpt.Shard(full[lo:lo + n].clone(), tuple(full.shape), offsets=(lo, 0))


def empty_shard(rows: int) -> unickpt.Shard:
    lo, n = rows_of(rows)
    return unickpt.Shard(torch.full((n, HIDDEN), float("nan")), (rows, HIDDEN), offsets=(lo, 0))


def to_hf_rules() -> list:
    sections = (HEADS * HEAD_DIM, GROUPS * HEAD_DIM, GROUPS * HEAD_DIM)
    return [unickpt.Split(name, "~qkv", 0, sections, i) for i, name in enumerate("qkv")] + [
        unickpt.Permute("~qkv", "linear_qkv", 0, HEAD_DIM, order())]


def to_megatron_rules() -> list:
    inverse = [0] * len(order())
    for j, o in enumerate(order()):
        inverse[o] = j
    return [unickpt.Permute("linear_qkv", "~qkv", 0, HEAD_DIM, tuple(inverse)), unickpt.Fuse("~qkv", ("q", "k", "v"), 0)]


def save_megatron(path: str) -> None:
    unickpt.save(path, {"linear_qkv": shard(qkv_full())})


def save_hf(path: str) -> None:
    unickpt.save(path, {name: shard(t) for name, t in plain_qkv().items()})


def load_as_hf(path: str, verify: bool) -> dict:
    """q, k, v row shards of this rank from the stored fused tensor; ``(all equal, bytes read, elements)``."""
    want = plain_qkv()
    state = {name: empty_shard(t.shape[0]) for name, t in want.items()}
    stats = unickpt.load(path, state, mapping=unickpt.Mapping(to_hf_rules()), verify=verify)
    ok = all(torch.equal(state[n].tensor, want[n][state[n].spec.offsets[0]:][:state[n].tensor.shape[0]]) for n in want)
    return {"ok": ok, "bytes_read": stats.bytes_read, "elements": sum(s.tensor.numel() for s in state.values())}


def load_as_megatron(path: str, verify: bool) -> dict:
    want = qkv_full()
    state = {"linear_qkv": empty_shard(ROWS)}
    stats = unickpt.load(path, state, mapping=unickpt.Mapping(to_megatron_rules()), verify=verify)
    got = state["linear_qkv"]
    lo = got.spec.offsets[0]
    return {"ok": torch.equal(got.tensor, want[lo:lo + got.tensor.shape[0]]), "bytes_read": stats.bytes_read,
            "elements": got.tensor.numel()}
