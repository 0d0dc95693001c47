"""Load benchmark: resharding and replicated loads, unickpt vs torch.distributed.checkpoint (DCP).

Saves one state at world size ``--save-ws`` (default 4) with each system, then loads it at each world
size in ``--load-ws`` (default 4,2,1) into the layout of that world size, and also saves at 2 and loads
at 4. Two scenarios:

- ``sharded``: every tensor is a DTensor sharded on dim 0 (FSDP-style); a load needs only its rows.
- ``replicated``: plain tensors every rank needs whole (data-parallel resume).

Per (system, scenario, save ws -> load ws): seconds (slowest rank), bytes read by ``read``/``pread``
calls per rank (``/proc/self/io`` ``rchar`` delta: the same meter for both systems; page-cache hits
count, so it measures requested bytes, not device traffic), peak host memory above the pre-load
baseline per rank (``/proc/self/statm`` sampled every 2 ms), and the rank's target bytes. Values are
checked bitwise after each load. Output: JSON records plus a printed table.

Run: ``python benchmarks/load_bench.py [--size-mb 256] [--repeats 3] [--out FILE.json]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
N_TENSORS = 16
COLS = 1024


def _rows(size_mb: float) -> int:
    return max(8, int(size_mb * 1e6 / (N_TENSORS * COLS * 4)))


def _value(i: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(rows, COLS, generator=g)


def _state(scenario: str, rows: int, zeros: bool) -> dict:
    """This rank's state: ``N_TENSORS`` tensors of ``rows x COLS`` float32."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    state = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),)) if scenario == "sharded" else None
    for i in range(N_TENSORS):
        full = torch.zeros(rows, COLS) if zeros else _value(i, rows)
        state[f"t{i}"] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None) if mesh else full
    return state


def _local(t) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Meter:
    """rchar delta and peak RSS above baseline while active."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base_rss = self._rss()
        self.peak = self.base_rss
        self.rchar0 = self._rchar()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _rchar(self) -> int:
        with open("/proc/self/io") as f:
            return int(next(l for l in f if l.startswith("rchar")).split()[1])

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.read_bytes = self._rchar() - self.rchar0
        self.peak_extra = self.peak - self.base_rss


def worker_save(system: str, scenario: str, rows: int, path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import unickpt

    state = _state(scenario, rows, zeros=False)
    if system == "unickpt":
        unickpt.save(path, state)
    else:
        dcp.save(state, checkpoint_id=path)
    dist.barrier()


def worker_load(system: str, scenario: str, rows: int, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import unickpt

    state = _state(scenario, rows, zeros=True)
    target_bytes = sum(_local(t).numel() * 4 for t in state.values())
    dist.barrier()
    with _Meter() as m:
        if system == "unickpt":
            unickpt.load(path, state)
        else:
            dcp.load(state, checkpoint_id=path)
    dist.barrier()
    ok = True
    rank, ws = dist.get_rank(), dist.get_world_size()
    for i in range(N_TENSORS):
        want = _value(i, rows)
        if scenario == "sharded":
            want = torch.chunk(want, ws, dim=0)[rank] if rank < len(torch.chunk(want, ws, dim=0)) else want[:0]
        ok = ok and torch.equal(_local(state[f"t{i}"]), want)
    return {"seconds": m.seconds, "read_bytes": m.read_bytes, "peak_extra_bytes": m.peak_extra,
            "target_bytes": target_bytes, "ok": ok}


def run(size_mb: float = 256, repeats: int = 3, save_ws: int = 4, load_ws: tuple = (4, 2, 1),
        workdir: str | None = None) -> list[dict]:
    """All load records (see module docstring). Spawns DistPools of the needed world sizes."""
    sys.path.insert(0, HERE)
    import load_bench  # workers must be importable by name in the spawned ranks

    from unickpt.testing import DistPool

    rows = _rows(size_mb)
    state_bytes = N_TENSORS * rows * COLS * 4
    root = tempfile.mkdtemp(prefix="unickpt_loadbench_", dir=workdir)
    pools: dict[int, DistPool] = {}

    def pool(n: int) -> DistPool:
        if n not in pools:
            pools[n] = DistPool(n, timeout_s=900)
        return pools[n]

    cases = [(save_ws, m) for m in load_ws] + [(2, 4)]
    records = []
    try:
        for scenario in ("sharded", "replicated"):
            for system in ("unickpt", "dcp"):
                for s_ws in sorted({s for s, _ in cases}):
                    path = os.path.join(root, f"{system}_{scenario}_ws{s_ws}")
                    pool(s_ws).run(load_bench.worker_save, system, scenario, rows, path)
                for s_ws, l_ws in cases:
                    path = os.path.join(root, f"{system}_{scenario}_ws{s_ws}")
                    samples = [pool(l_ws).run(load_bench.worker_load, system, scenario, rows, path)
                               for _ in range(repeats)]
                    secs = [max(r["seconds"] for r in res) for res in samples]
                    last = samples[-1]
                    rec = {
                        "system": system, "scenario": scenario, "save_world_size": s_ws, "world_size": l_ws,
                        "bytes": state_bytes, "seconds": statistics.median(secs), "seconds_samples": secs,
                        "read_bytes_total": sum(r["read_bytes"] for r in last),
                        "read_bytes_per_rank": [r["read_bytes"] for r in last],
                        "peak_extra_bytes_per_rank": [r["peak_extra_bytes"] for r in last],
                        "target_bytes_per_rank": [r["target_bytes"] for r in last],
                        "verified": all(r["ok"] for res in samples for r in res),
                    }
                    records.append(rec)
                    print(f"[load] {system:8s} {scenario:10s} {s_ws}->{l_ws}: {rec['seconds'] * 1e3:8.1f} ms  "
                          f"read {rec['read_bytes_total'] / 1e6:8.1f} MB  ok={rec['verified']}", flush=True)
    finally:
        for p in pools.values():
            p.close()
        shutil.rmtree(root, ignore_errors=True)
    return records


def print_table(records: list[dict]) -> None:
    print(f"\n{'scenario':<11}{'ws':>6}  {'unickpt ms':>11}{'dcp ms':>9}{'speedup':>9}  "
          f"{'read MB u/d':>15}  {'state MB':>9}  {'peak/target u':>14}{'peak/target d':>14}")
    by = {(r["system"], r["scenario"], r["save_world_size"], r["world_size"]): r for r in records}
    for (system, scenario, s, l), u in by.items():
        if system != "unickpt":
            continue
        d = by[("dcp", scenario, s, l)]
        ratio = lambda r: max(p / max(t, 1) for p, t in zip(r["peak_extra_bytes_per_rank"], r["target_bytes_per_rank"]))
        print(f"{scenario:<11}{f'{s}->{l}':>6}  {u['seconds'] * 1e3:>11.1f}{d['seconds'] * 1e3:>9.1f}"
              f"{d['seconds'] / u['seconds']:>8.2f}x  {u['read_bytes_total'] / 1e6:>7.1f}/{d['read_bytes_total'] / 1e6:<7.1f}"
              f"  {u['bytes'] / 1e6:>9.1f}  {ratio(u):>14.2f}{ratio(d):>14.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "load.json"))
    ap.add_argument("--dir", default=None, help="parent directory for the checkpoints")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    records = run(args.size_mb, args.repeats, workdir=args.dir)
    print_table(records)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    doc = {"machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__}, "size_mb": args.size_mb,
           "repeats": args.repeats, "wall_s": time.time() - t0, "records": records,
           "notes": "seconds: median over repeats of the slowest rank; read bytes: /proc/self/io rchar delta "
                    "(requested bytes, page cache included); peak: RSS above the pre-load baseline"}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
