"""Shared fixtures: long-lived gloo process pools (one per world size), reused by every test."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def pool():
    """``pool(n)`` -> a :class:`unickpt.testing.DistPool` of ``n`` ranks, started on first use."""
    from unickpt.testing import DistPool

    pools: dict[int, DistPool] = {}

    def get(n: int) -> DistPool:
        if n not in pools:
            pools[n] = DistPool(n, timeout_s=180)
        return pools[n]

    yield get
    for p in pools.values():
        p.close()
