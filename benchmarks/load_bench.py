"""Load benchmark: resharding and replicated loads, unickpt vs torch.distributed.checkpoint (DCP).

Saves one state at world size ``--save-ws`` (default 4) with each system, then loads it at each world
size in ``--load-ws`` (default 4,2,1) into the layout of that world size, and also saves at 2 and loads
at 4. Scenarios:

- ``sharded``: every tensor is a DTensor sharded on dim 0 (FSDP-style); a load needs only its rows.
- ``replicated``: plain tensors every rank needs whole (data-parallel resume).
- ``replicated-remote``: the same through a simulated remote store (``throttled://``: the local disk
  behind fsspec with reads limited to ``--remote-mbps`` MB/s per process, as one connection to an
  object store), DCP through its fsspec reader.

Systems: ``unickpt`` (default policy: redistribution on for remote storage, off for local storage on
one host, where the page cache already dedups device reads), ``unickpt-zr`` (redistribution forced on:
each stored byte read once job-wide, for the local scenarios), ``dcp``.

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
REMOTE_MBPS = float(os.environ.get("UNICKPT_BENCH_REMOTE_MBPS", "500"))


def _register_throttled_fs() -> None:
    """``throttled://`` = the local filesystem with reads limited to REMOTE_MBPS per process."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    def pause(nbytes: int) -> None:
        time.sleep(nbytes / (REMOTE_MBPS * 1e6))

    class _ThrottledFile:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            data = self._f.read(n)
            pause(len(data))
            return data

        def readinto(self, b):
            n = self._f.readinto(b)
            pause(n or 0)
            return n

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    class ThrottledFileSystem(LocalFileSystem):
        protocol = ("throttled",)

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            return super()._strip_protocol(path[len("throttled://"):] if path.startswith("throttled://") else path)

        def cat_file(self, path, start=None, end=None, **kwargs):
            data = super().cat_file(path, start=start, end=end, **kwargs)
            pause(len(data))
            return data

        def _open(self, path, mode="rb", block_size=None, **kwargs):
            f = super()._open(path, mode, block_size=block_size, **kwargs)
            return _ThrottledFile(f) if "r" in mode else f

    fsspec.register_implementation("throttled", ThrottledFileSystem, clobber=True)


_register_throttled_fs()
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

    _register_throttled_fs()
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


def _dcp_io(path: str, write: bool):
    if not path.startswith("throttled://"):
        return {"checkpoint_id": path}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # benchmark only

    return {"storage_writer": FsspecWriter(path)} if write else {"storage_reader": FsspecReader(path)}


def worker_save(system: str, scenario: str, rows: int, path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import unickpt

    state = _state(scenario, rows, zeros=False)
    if system.startswith("unickpt"):
        unickpt.save(path, state)
    else:
        dcp.save(state, **_dcp_io(path, write=True))
    dist.barrier()


def worker_load(system: str, scenario: str, rows: int, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import unickpt

    stats = None
    state = _state(scenario, rows, zeros=True)
    target_bytes = sum(_local(t).numel() * 4 for t in state.values())
    dist.barrier()
    with _Meter() as m:
        if system.startswith("unickpt"):
            stats = unickpt.load(path, state, redistribute=True if system == "unickpt-zr" else None)
        else:
            dcp.load(state, **_dcp_io(path, write=False))
    dist.barrier()
    ok = True
    rank, ws = dist.get_rank(), dist.get_world_size()
    for i in range(N_TENSORS):
        want = _value(i, rows)
        if scenario == "sharded":
            want = torch.chunk(want, ws, dim=0)[rank] if rank < len(torch.chunk(want, ws, dim=0)) else want[:0]
        ok = ok and torch.equal(_local(state[f"t{i}"]), want)
    return {"seconds": m.seconds, "read_bytes": m.read_bytes, "peak_extra_bytes": m.peak_extra,
            "target_bytes": target_bytes, "ok": ok,
            "unickpt": stats.as_dict() if system.startswith("unickpt") else None}


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
    remote_cases = [(save_ws, save_ws), (save_ws, 2)]
    plan = [("sharded", ("unickpt", "unickpt-zr", "dcp"), cases),
            ("replicated", ("unickpt", "unickpt-zr", "dcp"), cases),
            ("replicated-remote", ("unickpt", "dcp"), remote_cases)]
    records = []
    try:
        for scenario, systems, scenario_cases in plan:
            for system in systems:
                base = "throttled://" + root if scenario.endswith("remote") else root
                kind = scenario.replace("-remote", "")
                for s_ws in sorted({s for s, _ in scenario_cases}):
                    path = os.path.join(base, f"{system}_{scenario}_ws{s_ws}")
                    pool(s_ws).run(load_bench.worker_save, system, kind, rows, path)
                for s_ws, l_ws in scenario_cases:
                    path = os.path.join(base, f"{system}_{scenario}_ws{s_ws}")
                    samples = [pool(l_ws).run(load_bench.worker_load, system, kind, rows, path)
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
                        "redistributed": bool(last[0]["unickpt"] and last[0]["unickpt"]["redistributed"]),
                        "bytes_received_per_rank": [r["unickpt"]["bytes_received"] if r["unickpt"] else None for r in last],
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
    print(f"\n{'scenario':<18}{'ws':>6}  {'system':<11}{'ms':>9}{'vs dcp':>8}  {'read MB':>9}  {'peak/target':>11}")
    dcp = {(r["scenario"], r["save_world_size"], r["world_size"]): r for r in records if r["system"] == "dcp"}
    for r in sorted(records, key=lambda r: (r["scenario"], -r["save_world_size"], -r["world_size"], r["system"])):
        d = dcp[(r["scenario"], r["save_world_size"], r["world_size"])]
        ratio = max(p / max(t, 1) for p, t in zip(r["peak_extra_bytes_per_rank"], r["target_bytes_per_rank"]))
        case = f"{r['save_world_size']}->{r['world_size']}"
        print(f"{r['scenario']:<18}{case:>6}  {r['system']:<11}{r['seconds'] * 1e3:>9.1f}"
              f"{d['seconds'] / r['seconds']:>7.2f}x  {r['read_bytes_total'] / 1e6:>9.1f}  {ratio:>11.2f}")
    print(f"(state {records[0]['bytes'] / 1e6:.1f} MB; 'vs dcp' = dcp seconds / these seconds; read MB = bytes "
          f"requested from storage by all ranks; peak/target = max over ranks of extra RSS / target bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "load.json"))
    ap.add_argument("--dir", default=None, help="parent directory for the checkpoints")
    ap.add_argument("--remote-mbps", type=float, default=REMOTE_MBPS,
                    help="read bandwidth per process of the simulated remote store (MB/s)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["UNICKPT_BENCH_REMOTE_MBPS"] = str(args.remote_mbps)  # inherited by the spawned ranks
    t0 = time.time()
    records = run(args.size_mb, args.repeats, workdir=args.dir)
    print_table(records)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    doc = {"machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__}, "size_mb": args.size_mb,
           "remote_mbps_per_process": args.remote_mbps,
           "repeats": args.repeats, "wall_s": time.time() - t0, "records": records,
           "notes": "seconds: median over repeats of the slowest rank; read bytes: /proc/self/io rchar delta "
                    "(requested bytes, page cache included); peak: RSS above the pre-load baseline"}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
