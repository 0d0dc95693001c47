"""Host memory of saves, from /proc/self/status, each measurement in a fresh process.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_bench.py [--out benchmarks/results/memory.json]

runs the cases below (one subprocess each) and writes their figures; tests/unit/test_memory.py runs
single cases. Cases (what a subprocess runs, printing one JSON line):

``async ROOT SAVES MB [POOL_MB]``: ``SAVES`` asynchronous saves (``Checkpointer``, ``keep_last=2``,
default options, or staging rings of ``POOL_MB``) of a ``MB`` state changed between saves; VmRSS (KiB)
after saves 2, 3, 4, 5, 10, 25, 50 and the last, each once every save so far has committed. A save
stages into one of two rings (default size: a quarter of physical memory, so a small state fits
whole); the second ring's pages become resident the first time two saves overlap, a one-time step of
min(state, ring) that comes at whichever save first overlaps another (timing-dependent); apart from it the curve is flat. DCP grows by about one checkpoint per save
(pytorch/pytorch#170163, #187996).
``sync ROOT MB POOL_MB``: one synchronous save of a ``MB`` state through staging rings of
``POOL_MB``, after a tiny warm-up save (imports, threads); VmRSS before it and VmHWM after (the peak),
so the save's peak is ``hwm_after - rss_before``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import unickpt


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def state(mb: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = mb * (1 << 20) // (4 << 20)  # 4 MiB tensors
    return {"model": {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(n)}, "step": 0}


def run_async(root: str, saves: int, mb: int, pool_mb: int = 0) -> dict:
    st = state(mb)
    opts = unickpt.SaveOptions(pool_bytes=pool_mb << 20) if pool_mb else None
    ck = unickpt.Checkpointer(root, keep_last=2, save_options=opts)
    out = {}
    for step in range(1, saves + 1):
        for t in st["model"].values():  # a training step changes the state between saves
            t.mul_(0.5).add_(1.0)
        st["step"] = step
        ck.save(step, st)
        if step in (2, saves) or step in CHECKPOINTS:
            ck.wait()
            out[f"rss_after_{step}_kib"] = status("VmRSS")
    ck.close()
    return out


def run_sync(root: str, mb: int, pool_mb: int) -> dict:
    opts = unickpt.SaveOptions(pool_bytes=pool_mb << 20)
    unickpt.save(root + "/warmup", {"x": torch.ones(4)}, options=opts)
    st = state(mb)
    before = status("VmRSS")
    hwm_before = status("VmHWM")
    unickpt.save(root + "/big", st, options=opts)
    return {"rss_before_kib": before, "hwm_before_kib": hwm_before, "hwm_after_kib": status("VmHWM"),
            "state_kib": sum(t.numel() * 4 for t in st["model"].values()) >> 10}


CHECKPOINTS = (3, 4, 5, 10, 25, 50)  # further points of the async curve (after 2 and the last)
CASES = [("async", 100, 8, 0), ("async", 100, 64, 0), ("async", 100, 64, 32), ("sync", 256, 32, 0),
         ("sync", 1024, 32, 0), ("sync", 1024, 128, 0)]


def case(mode: str, a: int, b: int, c: int, root: str) -> dict:
    """One case in a fresh process; its figures (MiB) and the load average."""
    load = os.getloadavg()[0]
    t0 = time.time()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), mode, root, str(a), str(b), str(c)], capture_output=True,
                         text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    rec = {"mode": mode, "wall_s": round(time.time() - t0, 1), "load_avg": round(load, 1), **got}
    if mode == "async":
        rec.update(saves=a, state_mib=b, pool_mib=c or None,
                   growth_mib=round((got[f"rss_after_{a}_kib"] - got["rss_after_2_kib"]) / 1024, 2),
                   growth_after_10_mib=round((got[f"rss_after_{a}_kib"] - got["rss_after_10_kib"]) / 1024, 2))
    else:
        rec.update(state_mib=a, pool_mib=b, peak_mib=round((got["hwm_after_kib"] - got["rss_before_kib"]) / 1024, 1))
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description="host memory of saves")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory.json"))
    args = ap.parse_args()
    records = []
    for mode, a, b, c in CASES:
        with tempfile.TemporaryDirectory(prefix="unickpt-mem-") as root:
            rec = case(mode, a, b, c, root)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("async", "sync"):
        mode, root, *rest = sys.argv[1:]
        res = (run_async(root, int(rest[0]), int(rest[1]), int(rest[2]) if len(rest) > 2 else 0) if mode == "async"
               else run_sync(root, int(rest[0]), int(rest[1])))
        print(json.dumps(res))
    else:
        main()
