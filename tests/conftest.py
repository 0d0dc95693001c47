"""Shared fixtures: long-lived gloo process pools (one per world size), reused by every test.

Tests are laid out by layer: ``unit/`` (no process group), ``distributed/`` (real gloo process groups),
``faults/`` (killed and failing saves), ``plugins/<framework>/``, ``e2e/`` (the demo, the GPU check's dry
run). Their worker modules are imported by name, here and in the pool's processes (which inherit
``sys.path``), so every test directory is put on ``sys.path``.
"""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

_HERE = os.path.dirname(os.path.abspath(__file__))
for _dirpath, _dirs, _files in os.walk(_HERE):  # not tests/suites: its lightning.py would shadow lightning
    _dirs[:] = sorted(d for d in _dirs if d not in ("__pycache__", "suites"))
    if _dirpath != _HERE and _dirpath not in sys.path:
        sys.path.insert(0, _dirpath)


@pytest.fixture(scope="session")
def pool():
    """``pool(n)`` -> a :class:`unickpt.testing.DistPool` of ``n`` ranks, started on first use."""
    from unickpt.testing import DistPool

    pools: dict[int, DistPool] = {}

    def get(n: int) -> DistPool:
        if n not in pools:
            pools[n] = DistPool(n, timeout_s=180)
        return pools[n]

    get.pools = pools
    yield get
    for p in pools.values():
        p.close()


@pytest.fixture(autouse=True)
def _reset_engine_options(request):
    """After a test that used the shared ranks, put their save options back to the defaults, so
    that one test's ``Engine.configure`` (an upload target, a small ring) never leaks into the next."""
    yield
    if "pool" not in request.fixturenames:
        return
    import pipeline_workers

    for p in request.getfixturevalue("pool").pools.values():
        try:
            p.run(pipeline_workers.reset_options)
        except Exception:  # a pool a test broke on purpose: its own test reports that
            pass


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1 for the session, with a bucket
    ``unickpt``; yields the fsspec ``storage_options`` that reach it through s3fs."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import logging

    import s3fs

    from unickpt.testing.dist import _free_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}, "use_listings_cache": False}
    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket="unickpt")
    yield options
    server.stop()
