"""The plan cache: plans of layouts seen before, for saves and loads alike.

A plan is keyed by every rank's signature of what it holds (save) or needs (load), plus the options
that shape it. Every rank fills and evicts its cache with the same keys in the same order (the keys
are the gathered signatures, equal on every rank), so all ranks hit or miss together, and a hit
needs no more than the one signature exchange that found it. ByteCheckpoint caches save plans the
same way (NSDI '25); its open-source release never hits for FSDP2 (a fresh plan object every save).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, TypeVar

__all__ = ["PlanCache"]

P = TypeVar("P")


class PlanCache(Generic[P]):
    """A small LRU map ``key -> plan`` (thread-safe).

    Args:
        size: plans kept (distinct layouts, e.g. model-only and full saves, or several load targets).
    """

    def __init__(self, size: int):
        self.size = size
        self._plans: OrderedDict[Hashable, P] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> P | None:
        """The plan of ``key`` (now the most recently used), or None."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                self.misses += 1
                return None
            self._plans.move_to_end(key)
            self.hits += 1
            return plan

    def put(self, key: Hashable, plan: P) -> None:
        """Remember ``plan`` under ``key``, evicting the least recently used beyond ``size``."""
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)

    def get_or_make(self, key: Hashable, make: Callable[[], P]) -> tuple[P, bool]:
        """``(plan, hit)``: the cached plan of ``key``, or ``make()`` cached under it."""
        plan = self.get(key)
        if plan is not None:
            return plan, True
        plan = make()
        self.put(key, plan)
        return plan, False

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: Any) -> bool:
        return key in self._plans
