"""Worker functions for test_tooling.py (run on every rank of a DistPool)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import unickpt


def full_tensors() -> dict[str, torch.Tensor]:
    """The global tensors every rank shards in :func:`save_sharded` (deterministic)."""
    g = torch.Generator().manual_seed(7)
    return {
        "model.rows": torch.randn(6, 5, generator=g),  # split by rows: each chunk one contiguous run
        "model.cols": torch.randn(4, 6, generator=g, dtype=torch.float64),  # split by columns: strided boxes
        "model.flat": torch.randn(3, 7, generator=g).to(torch.bfloat16),  # irregular flat ranges (ZeRO-style)
        "model.bias": torch.arange(5, dtype=torch.int32),  # replicated
        "optim.m": torch.ones(3),
    }


def save_sharded(path: str) -> None:
    """Every rank saves its shard of :func:`full_tensors` (world size 2)."""
    r, n = dist.get_rank(), dist.get_world_size()
    t = full_tensors()
    rows, cols, flat = t["model.rows"], t["model.cols"], t["model.flat"].reshape(-1)
    rr, cc = rows.shape[0] // n, cols.shape[1] // n
    cut = [0, 8, 21]  # uneven flat partition
    state = {
        "model": {
            "rows": unickpt.Shard(rows[r * rr : (r + 1) * rr].clone(), rows.shape, offsets=(r * rr, 0)),
            "cols": unickpt.Shard(cols[:, r * cc : (r + 1) * cc].clone(), cols.shape, offsets=(0, r * cc)),
            "flat": unickpt.Shard(flat[cut[r] : cut[r + 1]].clone(), (3, 7), flat_range=(cut[r], cut[r + 1] - cut[r])),
            "bias": t["model.bias"],
        },
        "optim": {"m": t["optim.m"]},
        "step": 12,
    }
    unickpt.save(path, state, step=12)
