"""Worker functions for test_zero_redundancy.py (run on every rank of a DistPool)."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import unickpt

N = 3 * 1024  # rows of the test matrix: 3 Ki x 64 float32 = 768 KiB


def matrix(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 64, generator=g)


def save_rows(path: str) -> None:
    """Each rank saves its contiguous row block of two matrices (plus a replicated vector)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    rows = N // ws
    state = {name: unickpt.Shard(matrix(seed)[rank * rows:(rank + 1) * rows].clone(), (N, 64), offsets=(rank * rows, 0))
             for seed, name in enumerate(["a", "b"])}
    state["v"] = torch.arange(1000, dtype=torch.float64)
    unickpt.save(path, state)


def load(path: str, layout: str, verify: bool, redistribute: bool | None = True,
         read_buffer_bytes: int | None = None) -> dict:
    """Load into ``layout`` ("replicated", "cols", "empty_rank", "nothing_rank1"); check values bitwise."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    full = {"a": matrix(0), "b": matrix(1)}
    state = {}
    for name in ("a", "b"):
        if layout == "replicated":
            state[name] = torch.zeros(N, 64)
        elif layout == "cols":  # column blocks: every rank needs a strided part of every stored chunk
            cols = 64 // ws
            state[name] = unickpt.Shard(torch.zeros(N, cols), (N, 64), offsets=(0, rank * cols))
        elif layout == "empty_rank":  # the last rank's shard is empty
            rows = N // max(ws - 1, 1) if ws > 1 else N
            start, n = (rank * rows, rows) if rank < ws - 1 or ws == 1 else (N, 0)
            state[name] = unickpt.Shard(torch.zeros(n, 64), (N, 64), offsets=(start, 0))
    state["v"] = torch.zeros(1000, dtype=torch.float64)
    stats = unickpt.load(path, state, strict=False, verify=verify, redistribute=redistribute,
                         options=unickpt.LoadOptions(read_buffer_bytes=read_buffer_bytes))
    meta_bytes = os.path.getsize(os.path.join(path, "metadata.json"))
    # tensor bytes, metadata.json and (format v2: the rows are each rank's part of an even split) the
    # index records of the parts this rank needs, nothing else
    assert stats.storage_bytes_read == stats.bytes_read + meta_bytes + stats.index_bytes_read, stats.as_dict()
    if json.load(open(os.path.join(path, "metadata.json")))["format_version"] == 1:
        assert stats.index_bytes_read == 0
    ok = torch.equal(state["v"], torch.arange(1000, dtype=torch.float64))
    for name, leaf in state.items():
        if name == "v":
            continue
        got = leaf.tensor if isinstance(leaf, unickpt.Shard) else leaf
        want = full[name]
        if isinstance(leaf, unickpt.Shard):
            o, lens = leaf.spec.offsets, leaf.spec.lengths
            want = want[o[0]:o[0] + lens[0], o[1]:o[1] + lens[1]]
        ok = ok and torch.equal(got, want)
    return {"ok": ok, **stats.as_dict()}


def load_nothing_on_rank1(path: str) -> dict:
    """Rank 1 asks for no tensor at all; rank 0 loads everything."""
    state = {"v": torch.zeros(1000, dtype=torch.float64)} if dist.get_rank() == 0 else {}
    stats = unickpt.load(path, state, strict=False, redistribute=True)
    ok = dist.get_rank() == 1 or torch.equal(state["v"], torch.arange(1000, dtype=torch.float64))
    return {"ok": ok, **stats.as_dict()}


def load_expecting_error(path: str, redistribute: bool) -> str:
    try:
        unickpt.load(path, {"a": torch.zeros(N, 64), "b": torch.zeros(N, 64), "v": torch.zeros(1000, dtype=torch.float64)},
                     redistribute=redistribute)
    except unickpt.UnickptError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def data_bytes(path: str) -> int:
    d = os.path.join(path, "data")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
