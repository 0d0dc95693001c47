"""Balancing bytes over ranks: the least-loaded holder, in O(log n) per pick.

Used by the save plan (each replicated chunk is written by its least-loaded holder, largest chunks
first: ByteCheckpoint's balanced writes of replicas, NSDI '25, against the pile-up on
rank 0 of pytorch/pytorch#125740) and the read plan (each shared segment is read by its least-loaded
needer).
"""
from __future__ import annotations

import heapq

__all__ = ["LeastLoaded"]


class LeastLoaded:
    """``min(ranks, key=lambda r: (load.get(r, 0), r))`` for a fixed set of ranks whose loads (a dict
    shared with the caller) only grow, in O(log n) amortized per call (a heap with lazy updates)
    instead of O(n): the writer and reader balancing of the save and read plans."""

    def __init__(self, ranks: tuple[int, ...], load: dict[int, int]):
        self.load = load
        self.heap = [(load.get(r, 0), r) for r in ranks]
        heapq.heapify(self.heap)

    def pop_min(self) -> int:
        while True:
            stored, r = self.heap[0]
            now = self.load.get(r, 0)
            if stored == now:
                return r
            heapq.heapreplace(self.heap, (now, r))  # stale (the rank was given bytes since): refresh

    def refresh(self, r: int) -> None:
        """Call after ``load[r]`` grew, when ``r`` was the minimum just returned."""
        heapq.heapreplace(self.heap, (self.load.get(r, 0), r))
