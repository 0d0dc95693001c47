"""The replica check's cost per save against the save's stall (issue #29).

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/replica_check.py [--world 2] [--layers 10] [--saves 12] \\
        [--out benchmarks/results/replica_check.json]

``--world`` CPU ranks on one gloo group (:class:`unickpt.testing.DistPool`) each hold the same
GPT-like state as plain tensors (replicated, as DDP keeps it): ``--layers`` blocks of width 768 (QKV,
output, two MLP matrices, their biases, two layer norms: 12 tensors, 28.3 MB per block), so 120
tensors, 283 MB by default; every byte is a replicated chunk, written once (each rank writes about
1/world of it). For each mode of ``SaveOptions.check_replicas`` (``off``, ``sample``: the default, a
rotating sample every save, ``always``: every byte), round robin over ``--rounds`` rounds (a shared
machine's drift spreads over all modes): a first save of the layout (a plan-cache miss, not counted),
then ``--saves`` saves of it (hits; one element of every tensor changed between saves, as a training
step would), each ``unickpt.save(..., async_save=True)`` in ``sync`` snapshot mode into a directory
of its own on the local disk, waited for before the next one, then removed.

Per save and rank: ``stall_ms`` (what the caller's ``save()`` blocked for: ``SaveStats.stall_s``),
``check_ms`` (``SaveStats.replica_check_s``: the digests and their comparison, part of the stall),
``plan_collectives``. Per mode: the medians over saves of the slowest rank's stall and check and of
the check's share of the stall (each save's check / its own stall, so a shared machine's noise cancels
out), the largest share, the median check over the median stall, and for ``sample`` the target (< 2 %
of the stall, on the median share).

Output: a JSON object (``config``, ``machine``: load averages before and after, ``modes``: the summary
per mode, ``saves``: every save's figures per rank) and a printed table.
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

MODES = ("off", "sample", "always")
WIDTH = 768


def make_state(layers: int) -> dict:
    """A GPT-like block stack of plain float32 tensors (12 per block, 28.3 MB per block)."""
    g = torch.Generator().manual_seed(0)
    d, state = WIDTH, {}
    for i in range(layers):
        for name, shape in (("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
                            ("attn.out.weight", (d, d)), ("attn.out.bias", (d,)),
                            ("mlp.fc1.weight", (4 * d, d)), ("mlp.fc1.bias", (4 * d,)),
                            ("mlp.fc2.weight", (d, 4 * d)), ("mlp.fc2.bias", (d,)),
                            ("ln1.weight", (d,)), ("ln1.bias", (d,)), ("ln2.weight", (d,)), ("ln2.bias", (d,))):
            state[f"layers.{i}.{name}"] = torch.randn(shape, generator=g)
    return state


def bench_rank(root: str, layers: int, saves: int, rounds: int) -> dict:
    """Every rank: the saves of every mode, round robin (see the module docstring)."""
    import torch.distributed as dist

    import unickpt

    rank = dist.get_rank()
    state = make_state(layers)
    out: dict = {m: [] for m in MODES}
    n = 0
    for rnd in range(rounds):
        for mode in MODES:
            opts = unickpt.SaveOptions(check_replicas=mode)
            for i in range(saves + 1):
                for t in state.values():  # a training step changes every tensor (on every rank alike)
                    t.view(-1)[n % t.numel()] += 1.0
                path = os.path.join(root, f"{mode}_{rnd}_{i}")
                h = unickpt.save(path, state, async_save=True, options=opts)
                h.wait()
                s = h.stats
                if i:  # the first save of a layout (a miss) is not counted
                    out[mode].append({"stall_ms": s.stall_s * 1e3, "check_ms": s.replica_check_s * 1e3,
                                      "plan_ms": s.plan_s * 1e3, "plan_collectives": s.collectives_plan,
                                      "hit": s.plan_cache_hit, "bytes_staged": s.bytes_staged})
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path)
                n += 1
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    out["tensors"] = len(state)
    return out


def summarize(ranks: list[dict]) -> dict:
    """Per mode: medians over saves of the slowest rank's stall and check, the check's share."""
    modes = {}
    for m in MODES:
        per_save = list(zip(*[r[m] for r in ranks]))  # each: one save, all ranks
        stall = [max(x["stall_ms"] for x in s) for s in per_save]
        check = [max(x["check_ms"] for x in s) for s in per_save]
        share = [max(x["check_ms"] / x["stall_ms"] for x in s) * 100 for s in per_save]
        modes[m] = {"saves": len(per_save), "stall_ms_median": statistics.median(stall),
                    "check_ms_median": statistics.median(check), "check_pct_of_stall_median": statistics.median(share),
                    "check_pct_of_median_stall": statistics.median(check) / statistics.median(stall) * 100,
                    "check_pct_of_stall_max": max(share),
                    "plan_collectives": sorted({x["plan_collectives"] for s in per_save for x in s}),
                    "all_hits": all(x["hit"] for s in per_save for x in s)}
    modes["sample"]["target_pct"] = 2.0
    modes["sample"]["meets_target"] = modes["sample"]["check_pct_of_stall_median"] < 2.0
    return modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--saves", type=int, default=12, help="saves per mode and round (after the first)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--root", default=None, help="directory for the checkpoints (default: a temporary one)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "replica_check.json"))
    args = ap.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import replica_check as me
    from unickpt.saving.replicas import ROTATION, SLOTS
    from unickpt.testing import DistPool

    root = args.root or tempfile.mkdtemp(prefix="unickpt_replica_bench_")
    load_before = os.getloadavg()
    t0 = time.time()
    try:
        with DistPool(args.world, timeout_s=1800) as pool:
            ranks = pool.run(me.bench_rank, root, args.layers, args.saves, args.rounds)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "config": {"world": args.world, "layers": args.layers, "width": WIDTH, "tensors": ranks[0]["tensors"],
                   "state_mb": ranks[0]["state_bytes"] / 1e6, "saves_per_mode": args.saves * args.rounds,
                   "rounds": args.rounds, "snapshot": "sync", "rotation": ROTATION, "slots": SLOTS,
                   "torch": torch.__version__},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": load_before,
                    "load_after": os.getloadavg(), "wall_s": time.time() - t0},
        "modes": summarize(ranks),
        "saves": {m: [r[m] for r in ranks] for m in MODES},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'mode':8} {'stall ms':>9} {'check ms':>9} {'check/stall %':>14} {'max %':>7} {'plan coll.':>10}")
    for m, s in result["modes"].items():
        print(f"{m:8} {s['stall_ms_median']:9.1f} {s['check_ms_median']:9.3f} {s['check_pct_of_stall_median']:14.3f} "
              f"{s['check_pct_of_stall_max']:7.3f} {str(s['plan_collectives']):>10}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
