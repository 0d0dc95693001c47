"""Worker functions for test_s3.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

import unickpt

ROWS, COLS = 512, 256
TOTAL_BYTES = ROWS * COLS * 4 + 64 * 8


def _full() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5))


def _rows(rank: int, ws: int) -> tuple[int, int]:
    step = -(-ROWS // ws)
    start = min(rank * step, ROWS)
    return start, min(step, ROWS - start)


def save_sharded(path: str, options: dict) -> None:
    start, n = _rows(dist.get_rank(), dist.get_world_size())
    state = {"w": unickpt.Shard(_full()[start:start + n].clone(), (ROWS, COLS), offsets=(start, 0)),
             "v": torch.arange(64, dtype=torch.float64)}
    unickpt.save(path, state, storage_options=options)


def load_sharded(path: str, options: dict) -> dict:
    start, n = _rows(dist.get_rank(), dist.get_world_size())
    target = torch.zeros(n, COLS)
    state = {"w": unickpt.Shard(target, (ROWS, COLS), offsets=(start, 0)), "v": torch.zeros(64, dtype=torch.float64)}
    stats = unickpt.load(path, state, storage_options=options, verify=False)
    ok = torch.equal(target, _full()[start:start + n]) and torch.equal(state["v"], torch.arange(64, dtype=torch.float64))
    return {"ok": ok, "bytes_read": stats.bytes_read, "redistributed": stats.redistributed}
