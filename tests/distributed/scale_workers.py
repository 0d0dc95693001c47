"""Worker functions for test_scale.py (run on every rank of a DistPool): count the collectives a
save runs, with the real engine, by wrapping torch.distributed's collective functions."""
from __future__ import annotations

import threading
from collections import Counter

import torch
import torch.distributed as dist

import unickpt

COLLECTIVES = ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "broadcast",
               "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list",
               "reduce_scatter", "all_to_all", "barrier", "reduce")


class CollectiveCounter:
    """Counts calls of torch.distributed collectives (outermost only: ``all_gather_object`` calls
    ``all_gather`` inside and counts once), from any thread, while active."""

    def __init__(self):
        self.counts: Counter = Counter()
        self._orig = {}
        self._depth = threading.local()
        self._lock = threading.Lock()

    def __enter__(self) -> "CollectiveCounter":
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._orig[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                with self._lock:
                    self.counts[name] += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
        return counted

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def save_counting(root: str, saves: int) -> list[dict]:
    """``saves`` saves of one layout (a replicated tensor, a row shard per rank, a plain value);
    per save: the collectives counted and the engine's own counts."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    full = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    rows = 64 // ws
    state = {"replicated": full.clone(), "sharded": unickpt.Shard(full[rank * rows:(rank + 1) * rows].clone(), (64, 16),
                                                                   offsets=(rank * rows, 0)), "step": 7}
    unickpt.save(f"{root}/warmup", {"x": torch.ones(3)})  # creates the engine and its groups (once per job)
    out = []
    for i in range(saves):
        with CollectiveCounter() as counter:
            handle = unickpt.save(f"{root}/step_{i}", state)
        out.append({"counts": dict(counter.counts), "plan_cache_hit": handle.stats.plan_cache_hit,
                    "collectives_plan": handle.stats.collectives_plan,
                    "collectives_commit": handle.stats.collectives_commit})
    restored = {"replicated": torch.zeros(64, 16),
                "sharded": unickpt.Shard(torch.zeros(rows, 16), (64, 16), offsets=(rank * rows, 0)), "step": 0}
    unickpt.load(f"{root}/step_{saves - 1}", restored)
    assert torch.equal(restored["replicated"], full) and restored["step"] == 7
    assert torch.equal(restored["sharded"].tensor, full[rank * rows:(rank + 1) * rows])
    return out
