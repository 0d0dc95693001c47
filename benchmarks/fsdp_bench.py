"""FSDP1 checkpoint saves: unickpt (flat parameters, no all-gather) against FSDP's own paths.

Methods (each saves the model and its AdamW state, trained one step, on every rank of a gloo
group of CPU processes):

- ``unickpt_sync``: ``unickpt.save(path, unickpt.fsdp.state(model, optim))``: each rank writes its
  flat-parameter slices; the call returns when committed.
- ``unickpt_async``: the same with ``async_save=True``: the call returns once the state is staged in
  host memory; writing and the commit continue in the background.
- ``fsdp_sharded_dcp``: FSDP1 SHARDED_STATE_DICT (``model.state_dict()`` and
  ``FSDP.optim_state_dict`` under ``FSDP.state_dict_type``), written by ``dcp.save`` (FileSystemWriter).
- ``fsdp_full_torch_save``: the FULL state dict (``get_state_dict(full_state_dict=True)``: every rank
  all-gathers every parameter and moment), ``torch.save`` on rank 0, then a barrier.

Reported per method (median over repeats of the slowest rank): ``stall_s``, the time the save call
blocks the training loop; ``total_s``, until the checkpoint is complete; ``peak_extra_mb``, the
largest rise of a rank's resident memory (RSS, sampled every 2 ms by a thread) above its level
before the call, max over ranks and repeats, in steady state (unickpt reuses the staging buffers it
allocated at its first save); ``first_save_peak_extra_mb``: the same for the first (warm-up) save,
which includes those allocations; ``disk_mb``. The machine and its load are recorded in
the JSON, since the numbers depend on both.

    OMP_NUM_THREADS=1 python benchmarks/fsdp_bench.py --world-size 4 --width 1024 --layers 8 --repeats 3
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

METHODS = ("unickpt_sync", "unickpt_async", "fsdp_sharded_dcp", "fsdp_full_torch_save")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """Samples this process's RSS every ``interval_s`` in a thread; ``peak - base`` in bytes."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.base, self.peak = interval_s, _rss(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval_s)

    def __enter__(self) -> "_PeakRSS":
        self.peak = self.base
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _build(width: int, layers: int):
    import torch
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    blocks = [nn.Linear(width, width) for _ in range(layers)]
    model = nn.Sequential(*[FSDP(b, device_id=torch.device("cpu")) for b in blocks])
    model = FSDP(model, device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _save(method: str, path: str, model, optim) -> tuple[float, float]:
    """(stall_s, total_s) of one save on this rank."""
    import torch
    import torch.distributed as dist

    import unickpt
    import unickpt.fsdp

    t0 = time.perf_counter()
    if method in ("unickpt_sync", "unickpt_async"):
        handle = unickpt.save(path, unickpt.fsdp.state(model, optim), async_save=method == "unickpt_async")
        stall = time.perf_counter() - t0
        handle.wait()
        return stall, time.perf_counter() - t0
    if method == "fsdp_sharded_dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sd = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
            dcp.save(sd, checkpoint_id=path)
    elif method == "fsdp_full_torch_save":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            torch.save({"model": msd, "optim": osd}, os.path.join(path, "full.pt"))
        dist.barrier()
    else:
        raise ValueError(method)
    total = time.perf_counter() - t0
    return total, total


def bench_rank(root: str, width: int, layers: int, repeats: int) -> dict:
    """Runs on every rank: each method ``repeats`` times (the first unickpt save also plans)."""
    import torch.distributed as dist

    model, optim = _build(width, layers)
    out: dict[str, list] = {m: [] for m in METHODS}
    first: dict[str, int] = {}
    for r in range(repeats + 1):  # round 0 warms up (planning, staging pools, imports); not reported
        for method in METHODS:
            path = os.path.join(root, f"{method}_{r}")
            dist.barrier()
            with _PeakRSS() as mem:
                stall, total = _save(method, path, model, optim)
            dist.barrier()
            if r:
                out[method].append({"stall_s": stall, "total_s": total, "peak_extra_bytes": mem.extra})
            else:
                first[method] = mem.extra
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"runs": out, "first": first, "param_bytes_local": local_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--root", default=None, help="directory for the checkpoints (default: a temporary one)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fsdp.json"))
    args = ap.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from unickpt.testing import DistPool

    root = args.root or tempfile.mkdtemp(prefix="unickpt_fsdp_bench_")
    load_before = os.getloadavg()
    try:
        with DistPool(args.world_size, timeout_s=1800) as pool:
            ranks = pool.run(bench_rank, root, args.width, args.layers, args.repeats)
        disk = {}
        for m in METHODS:
            d = os.path.join(root, f"{m}_1")
            disk[m] = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(d) for f in fs) / 1e6
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    results = {}
    for m in METHODS:
        per_repeat = list(zip(*[r["runs"][m] for r in ranks]))  # each: one repeat, all ranks
        results[m] = {
            "stall_s": statistics.median(max(x["stall_s"] for x in rep) for rep in per_repeat),
            "total_s": statistics.median(max(x["total_s"] for x in rep) for rep in per_repeat),
            "peak_extra_mb": max(x["peak_extra_bytes"] for rep in per_repeat for x in rep) / 1e6,
            "first_save_peak_extra_mb": max(r["first"][m] for r in ranks) / 1e6,
            "disk_mb": disk[m],
        }
    n_params = args.layers * (args.width * args.width + args.width)
    report = {
        "benchmark": "FSDP1 save: unickpt flat parameters vs FSDP sharded (DCP) and full (torch.save) state dicts",
        "world_size": args.world_size, "params": n_params, "model_mb": n_params * 4 / 1e6,
        "model_plus_adam_mb": n_params * 12 / 1e6, "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'method':24s} {'stall_s':>9s} {'total_s':>9s} {'peak_extra_mb':>14s} {'first_peak_mb':>14s} {'disk_mb':>8s}")
    for m, r in results.items():
        print(f"{m:24s} {r['stall_s']:9.3f} {r['total_s']:9.3f} {r['peak_extra_mb']:14.1f} "
              f"{r['first_save_peak_extra_mb']:14.1f} {r['disk_mb']:8.1f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
