"""DCP reader benchmark: ``dcp.load`` through DCP's ``FileSystemReader`` vs unickpt's
``unickpt.fsdp.StorageReader`` (each reading the checkpoint its own writer wrote), warm page cache.

Scenarios on ``--world-size`` ranks (default 2, gloo, CPU), ``--size-mb`` of float32 state (default 500)
in 8 tensors:

- ``replicated``: plain tensors, every rank loads all of them whole (data-parallel resume);
- ``sharded``: DTensors ``Shard(0)`` over the ranks, each rank loads its rows.

Each system saves once (DCP: ``FileSystemWriter``; unickpt: ``StorageWriter``), then loads once
untimed (warms the page cache), then ``--repeats`` timed loads (default 5). A sample is the slowest
rank's ``dcp.load`` call (a barrier before it); the record keeps the median and every sample. Every
load is checked bitwise against the saved values (outside the timing). unickpt reads with its
default checksum verification on.

Run: ``python benchmarks/dcp_reader_bench.py [--size-mb 500] [--repeats 5] [--out FILE.json]``
(default ``benchmarks/results/dcp_reader.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
N_TENSORS = 8
COLS = 1024


def _rows(size_mb: float, world_size: int) -> int:
    rows = int(size_mb * 1e6 / (N_TENSORS * COLS * 4))
    return max(world_size, rows - rows % world_size)


def _state(scenario: str, rows: int, fill: bool) -> dict:
    import torch.distributed as dist

    out = {}
    for i in range(N_TENSORS):
        t = (torch.arange(rows * COLS, dtype=torch.float32).reshape(rows, COLS) * (i + 1) if fill
             else torch.zeros(rows, COLS))
        if scenario == "sharded":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            t = distribute_tensor(t, mesh, [Shard(0)])
        out[f"layer{i}.weight"] = t
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def worker_save(system: str, scenario: str, rows: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    import unickpt.fsdp

    state = _state(scenario, rows, fill=True)
    writer = dcp.FileSystemWriter(path) if system == "dcp" else unickpt.fsdp.StorageWriter(path)
    dcp.save(state, storage_writer=writer)


def worker_load(system: str, scenario: str, rows: int, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import unickpt.fsdp

    state = _state(scenario, rows, fill=False)
    reader = dcp.FileSystemReader(path) if system == "dcp" else unickpt.fsdp.StorageReader(path)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=reader)
    seconds = time.perf_counter() - t0
    want = _state(scenario, rows, fill=True)
    ok = all(torch.equal(_local(state[k]).view(torch.uint8), _local(want[k]).view(torch.uint8)) for k in want)
    return {"seconds": seconds, "ok": ok, "target_bytes": sum(_local(v).numel() * 4 for v in state.values())}


def run(size_mb: float = 500, repeats: int = 5, world_size: int = 2, workdir: str | None = None) -> list[dict]:
    """The records (see the module docstring)."""
    sys.path.insert(0, HERE)
    import dcp_reader_bench as me  # workers must be importable by name in the spawned ranks

    from unickpt.testing import DistPool

    rows = _rows(size_mb, world_size)
    root = tempfile.mkdtemp(prefix="unickpt_dcpreader_", dir=workdir)
    records = []
    pool = DistPool(world_size, timeout_s=900)
    try:
        for scenario in ("replicated", "sharded"):
            for system in ("dcp", "unickpt"):
                path = os.path.join(root, f"{system}_{scenario}")
                pool.run(me.worker_save, system, scenario, rows, path)
                pool.run(me.worker_load, system, scenario, rows, path)  # warm the page cache
                samples = [pool.run(me.worker_load, system, scenario, rows, path) for _ in range(repeats)]
                secs = [max(r["seconds"] for r in res) for res in samples]
                rec = {"system": "FileSystemReader" if system == "dcp" else "unickpt.fsdp.StorageReader",
                       "scenario": scenario, "world_size": world_size,
                       "bytes": N_TENSORS * rows * COLS * 4, "target_bytes_per_rank": [r["target_bytes"] for r in samples[-1]],
                       "median_s": statistics.median(secs), "samples_s": secs,
                       "verified": all(r["ok"] for res in samples for r in res)}
                records.append(rec)
                print(f"[dcp-reader] {rec['system']:28s} {scenario:10s}: median {rec['median_s'] * 1e3:7.1f} ms  "
                      f"samples {[round(s * 1e3, 1) for s in secs]}  ok={rec['verified']}", flush=True)
                shutil.rmtree(path, ignore_errors=True)
    finally:
        pool.close()
        shutil.rmtree(root, ignore_errors=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "dcp_reader.json"))
    args = ap.parse_args()
    records = run(args.size_mb, args.repeats, args.world_size)
    doc = {"benchmark": "dcp_reader", "torch": torch.__version__, "python": platform.python_version(),
           "cpus": os.cpu_count(), "load_average": os.getloadavg(), "size_mb": args.size_mb,
           "repeats": args.repeats, "records": records}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
