"""Checkpoint tiers benchmark (issue #19): memory saves every step, recovery from memory / a peer's
memory / a cold disk, the whole restart, the memory taken, the preemption flag's cost per step.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tiers_bench.py [--size-gb 1.5] [--quick] \\
        --out benchmarks/results/tiers.json

One process tree, one run, 4 CPU ranks on one gloo group (:class:`unickpt.testing.DistPool`) holding
the GPT-like state of ``benchmarks/save_load.py`` (FSDP2-sharded model + AdamW moments). Ranks 0-1
are node 0 and ranks 2-3 node 1 (``TierOptions(node_id=..., memory_dir=<tmp>/node<k>)``, each node its
own memory directory under /dev/shm), so tier 1 copies travel between the two "nodes" over gloo.

Scenarios:

* ``train``: blocks of ``--steps`` training steps (forward, backward, ``optimizer.step()``), round
  robin over the systems, ``--rounds`` rounds (a shared machine's drift spreads over all of them):
  ``none`` (no checkpoint), ``persist-async`` (today's persistent async save, ``Checkpointer.save``
  every step to the local disk, default options), ``memory`` (``Checkpointer(memory_every=1)``: tier
  0 and tier 1 every step), ``memory-local`` (tier 0 only, ``peer=False``), ``memory-overlap`` (tiers 0
  and 1, ``snapshot="overlap"``: the copy runs during the next forward/backward). Per system:
  ``stall_s`` (median over saves of the slowest rank's blocked time: the ``save`` call, with its
  preemption-flag agreement, plus any wait in ``optimizer.step()``), ``step_time_s`` (median step
  time without the stall, slowest rank) and ``interference`` = that / ``none``'s - 1; and, robust to
  other users of a shared machine, ``cpu_per_step_s`` (the CPU seconds of a step, all ranks' processes
  with every unickpt thread, median) and ``cpu_interference`` = that / ``none``'s - 1: on a machine
  whose cores the training saturates, the CPU a checkpoint takes is what it takes from the steps.
* ``memory``: each rank's shared memory after the memory blocks (own copies, peer copies, staging
  ring) against its state bytes.
* ``flag``: the per-step agreement (the preemption flag, with tiers also the memory watermark and
  retention) timed alone, ``--flag-calls`` calls after a barrier with ``--flag-step-ms`` of compute
  between two calls (a training step, behind which the pipelined all-reduce travels): median / p90 per call
  (the slowest rank's median), for a checkpointer with memory tiers and one with ``persist_every`` only.
* ``load``: step ``S`` saved to memory and persistently (local disk) at once, then, ``--repeats``
  times, round robin: the ``Checkpointer.load`` call restoring from tier 0 (every rank's node memory),
  from tier 1 (node 1's memory directory removed first: its ranks' copies come from node 0 over the
  group) and from the disk after ``echo 3 > /proc/sys/vm/drop_caches`` (a Checkpointer without tiers):
  ``load_s`` (slowest rank), verified bitwise each time, bytes per tier.
* ``restart``: the whole restart, process start to state loaded: two ``torchrun`` launches (nodes 0
  and 1, two ranks each) that import torch, join the group, build the model and optimizer and call
  ``Checkpointer.load``: from memory, and from the cold disk (caches dropped first);
  ``restart_s`` = the last rank's "loaded" time - the launch time, with the phases per rank, and
  ``load_after_all_built_s`` = the last "loaded" - the last "built" (the load call without start-up skew).

Output: a JSON list of records (``system``, ``scenario``, values), a ``machine`` record (load average
before and after) and a ``summary``/``targets`` record; and a printed table.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DEFAULT_OUT = os.path.join(HERE, "results", "tiers.json")
TRAIN_SYSTEMS = ["none", "persist-async", "memory", "memory-local", "memory-overlap"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size-gb", type=float, default=None, help="GPT state size, GB (default 0.6; --quick 0.3)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="a smaller state, fewer steps (a few minutes)")
    p.add_argument("--steps", type=int, default=None, help="steps per training block (default 5; --quick 3)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of training blocks (default 2; --quick 1)")
    p.add_argument("--repeats", type=int, default=None, help="load repeats per tier (default 3; --quick 2)")
    p.add_argument("--flag-calls", type=int, default=300)
    p.add_argument("--flag-step-ms", type=float, default=20.0,
                   help="compute between two agreement calls (a training step; the all-reduce is pipelined "
                        "behind it), ms")
    p.add_argument("--systems", default=",".join(TRAIN_SYSTEMS))
    p.add_argument("--scenarios", default="train,memory,flag,load,restart")
    p.add_argument("--dir", default=None, help="where the persistent checkpoints go (default: the temp dir)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--restart-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.size_gb = a.size_gb if a.size_gb is not None else (0.3 if a.quick else 0.6)
    a.steps = a.steps if a.steps is not None else (3 if a.quick else 5)
    a.rounds = a.rounds if a.rounds is not None else (1 if a.quick else 2)
    a.repeats = a.repeats if a.repeats is not None else (2 if a.quick else 3)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    a.scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    return a


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 5) if xs else None


def _p90(xs: list) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 5) if xs else None


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only). Returns whether it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------- #
# Worker side (every rank of the DistPool)
# --------------------------------------------------------------------------------------------- #
_CK: dict[str, Any] = {}
_STEP: dict[str, int] = {}


def _node(rank: int, ws: int) -> int:
    return 0 if ws < 2 else rank // (ws // 2)


def _tier_options(cfg: dict, **changes: Any) -> Any:
    import torch.distributed as dist

    from unickpt.options import TierOptions

    rank, ws = dist.get_rank(), dist.get_world_size()
    k = _node(rank, ws)
    return TierOptions(node_id=f"bench-node{k}", memory_dir=os.path.join(cfg["mem"], f"node{k}"), **changes)


def _ckpt(cfg: dict, system: str) -> Any:
    """This rank's checkpointer of ``system`` (created collectively on first use)."""
    if system in _CK:
        return _CK[system]
    import unickpt
    from unickpt.options import SaveOptions

    root = os.path.join(cfg["root"], system)
    if system == "persist-async":
        ck = unickpt.Checkpointer(root, keep_last=1)
    elif system == "memory":
        ck = unickpt.Checkpointer(root, memory_every=1, tiers=_tier_options(cfg))
    elif system == "memory-local":
        ck = unickpt.Checkpointer(root, memory_every=1, tiers=_tier_options(cfg, peer=False))
    elif system == "memory-overlap":
        ck = unickpt.Checkpointer(root, memory_every=1, tiers=_tier_options(cfg),
                                  save_options=SaveOptions(snapshot="overlap"))
    elif system == "flag-only":
        ck = unickpt.Checkpointer(root, persist_every=10 ** 9, tiers=_tier_options(cfg))
    else:
        raise ValueError(system)
    _CK[system] = ck
    _STEP[system] = 0
    return ck


def w_setup(cfg: dict) -> dict:
    import save_load

    b = save_load._bench(cfg)
    return {"layers": b.layers, "vocab": b.vocab, "state_bytes": b.state_bytes, "local_bytes": b.local_bytes}


def w_train_block(cfg: dict, system: str, steps: int, seed: int) -> Any:
    """``steps`` training steps with ``system``'s checkpoints; rank 0 returns every rank's rows
    ``[(step seconds without stall, stall or None)]``."""
    import save_load

    b = save_load._bench(cfg)
    ck = None if system == "none" else _ckpt(cfg, system)
    if ck is not None and _STEP[system] == 0:  # warm-up save: rings, plan cache, first page faults
        ck.save(0, b.unickpt_state)
        ck.wait()
        _STEP[system] = 1
    b.dist.barrier()
    rows = []
    for i in range(steps):
        t0 = time.perf_counter()
        cpu0 = time.process_time()  # this process's CPU seconds: training, and unickpt's threads
        stall = None
        h = before = None
        if ck is not None:
            step = _STEP[system]
            _STEP[system] += 1
            c0 = time.perf_counter()
            h = ck.save(step, b.unickpt_state)
            stall = time.perf_counter() - c0
            before = getattr(getattr(h, "stats", None), "stall_s", None)
        b.forward_backward(seed + i)
        b.optim.step()  # an overlap snapshot's optimizer hook waits here (added to stats.stall_s)
        b.optim.zero_grad(set_to_none=True)
        if before is not None and system == "memory-overlap":
            stall += max(0.0, h.stats.stall_s - before)
        rows.append((time.perf_counter() - t0 - (stall or 0.0), stall, time.process_time() - cpu0))
    if ck is not None:
        ck.wait()  # the last save's drain and peer copy do not spill into the next block
        _free_between_blocks(b, ck, system)
    per = b.gather(rows)
    return per if b.rank == 0 else None


def _free_between_blocks(b: Any, ck: Any, system: str) -> None:
    """What one system holds must not stay while the others run (a shared machine's memory): a memory
    system's copies are measured (``w_memory``) and removed, persistent saves' staging rings freed."""
    if ck.tiers is not None and ck.tiers.memory:
        _CK[f"_bytes_{system}"] = dict(ck.tiers.memory_bytes())
        b.dist.barrier()  # every peer copy landed before any rank removes its directories
        ck.clear_memory()
    else:
        from unickpt.engine import get_engine

        for pool in get_engine().saver.pipeline.pools:  # reallocated by the next persistent save
            pool.close()


def w_memory(cfg: dict) -> dict:
    import save_load

    b = save_load._bench(cfg)
    out = dict(_CK.get("_bytes_memory") or _ckpt(cfg, "memory").tiers.memory_bytes())  # at the end of its last block
    out["state_bytes"] = b.local_bytes[b.rank]
    out["skipped"] = _ckpt(cfg, "memory").tiers.skipped
    return out


def w_flag(cfg: dict, system: str, calls: int, step_s: float) -> dict:
    import save_load
    import torch

    b = save_load._bench(cfg)
    ck = _ckpt(cfg, system)
    tiers = ck.tiers
    x = torch.randn(256, 256)
    b.dist.barrier()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        tiers.agree()
        times.append(time.perf_counter() - t0)
        end = time.perf_counter() + step_s  # a training step's compute between two calls
        while time.perf_counter() < end:
            x = torch.tanh(x @ x * 1e-3)
    return {"median_s": statistics.median(times), "p90_s": _p90(times), "mean_s": statistics.fmean(times)}


def w_load_prepare(cfg: dict) -> int:
    """Save step S to memory (tiers 0 and 1) and persistently (the local disk) at once."""
    import save_load

    b = save_load._bench(cfg)
    ck = _ckpt(cfg, "memory")
    step = _STEP["memory"]
    _STEP["memory"] += 1
    b.step(data_seed=777)  # a state that no earlier save holds
    ck.save(step, b.unickpt_state, persist=True)
    ck.wait()
    _CK["_ref"] = save_load._snapshot(b)
    b.dist.barrier()
    return step


def w_load(cfg: dict, tier: str) -> dict:
    """One timed ``Checkpointer.load`` from ``tier`` into the zeroed state, verified bitwise."""
    import torch

    import save_load
    import unickpt

    b = save_load._bench(cfg)
    rank, ws = b.rank, b.ws
    ck = _ckpt(cfg, "memory")
    dropped = None
    if tier == "peer":  # node 1 lost its memory: its ranks' copies come from node 0
        if rank == ws // 2:
            for d in glob.glob(os.path.join(cfg["mem"], f"node{_node(rank, ws)}", "run-*", "own")):
                shutil.rmtree(d)
    if tier == "disk":
        ck = unickpt.Checkpointer(os.path.join(cfg["root"], "memory"))  # no tiers: storage only
        if rank == 0:
            dropped = drop_caches()
    save_load._zero(b)
    b.dist.barrier()
    t0 = time.perf_counter()
    step = ck.load(b.unickpt_state)
    dt = time.perf_counter() - t0
    stats = ck.last_load_stats
    ref = _CK["_ref"]
    now = save_load._snapshot(b)
    ok = now.keys() == ref.keys() and all(torch.equal(now[k], ref[k]) for k in ref)
    b.dist.barrier()
    return {"load_s": dt, "step": step, "ok": ok, "tier": stats.tier, "bytes_by_tier": stats.bytes_by_tier,
            "dropped_caches": dropped, "plan_s": stats.plan_s}


def w_close(cfg: dict) -> None:
    for name, ck in list(_CK.items()):
        if not name.startswith("_"):
            ck.close()
    _CK.clear()
    import torch.distributed as dist

    dist.barrier()


# --------------------------------------------------------------------------------------------- #
# The restart worker (under torchrun)
# --------------------------------------------------------------------------------------------- #
def restart_worker(spec: str) -> int:
    t_start = time.time()
    cfg = json.loads(spec)
    import torch
    import torch.distributed as dist

    t_import = time.time()
    dist.init_process_group("gloo")
    t_init = time.time()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import save_load
    import unickpt

    rank, ws = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model, _, _ = save_load._gpt(cfg)
    mesh = init_device_mesh("cpu", (ws,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": optim, "step": 1}
    root = os.path.join(cfg["root"], "memory")
    if cfg["tier"] == "memory":
        ck = unickpt.Checkpointer(root, memory_every=1)
    else:
        ck = unickpt.Checkpointer(root)
    t_built = time.time()
    step = ck.load(state)
    t_loaded = time.time()
    stats = ck.last_load_stats
    out = {"rank": rank, "t_start": t_start, "t_import": t_import, "t_init": t_init, "t_built": t_built,
           "t_loaded": t_loaded, "step": step, "tier": stats.tier if stats else None,
           "bytes_by_tier": stats.bytes_by_tier if stats else None}
    with open(os.path.join(cfg["out"], f"restart_{rank}.json"), "w") as f:
        json.dump(out, f)
    ck.close()
    dist.destroy_process_group()
    return 0


def run_restart(cfg: dict, tier: str, log: Any) -> dict:
    """Two torchrun launches (nodes 0 and 1) restoring from ``tier``; returns the record's fields."""
    out = tempfile.mkdtemp(prefix=f"restart-{tier}-", dir=cfg["root"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dropped = drop_caches() if tier == "disk" else None
    spec = json.dumps({**{k: cfg[k] for k in ("size_gb", "hidden", "root")}, "tier": tier, "out": out})
    t_launch = time.time()
    procs = []
    for node in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "UNICKPT_MEMORY_DIR": os.path.join(cfg["mem"], f"node{node}"),
               "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               os.path.abspath(__file__), "--restart-worker", spec]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"restart ({tier}) failed:\n" + "\n".join(x[-3000:] for x in logs))
    ranks = [json.load(open(os.path.join(out, f"restart_{r}.json"))) for r in range(4)]
    last = max(r["t_loaded"] for r in ranks)
    rec = {"restart_s": round(last - t_launch, 3), "dropped_caches": dropped,
           "load_call_s": round(max(r["t_loaded"] - r["t_built"] for r in ranks), 4),
           # from the moment the last rank has built its model (the load's first collective waits for
           # it) to the last rank loaded: the load call without the ranks' start-up skew
           "load_after_all_built_s": round(max(r["t_loaded"] for r in ranks) - max(r["t_built"] for r in ranks), 4),
           "phases_s": {k: round(max(r[f"t_{k}"] - t_launch for r in ranks), 3)
                        for k in ("start", "import", "init", "built", "loaded")},
           "tiers": [r["tier"] for r in ranks], "step": ranks[0]["step"]}
    log(f"restart from {tier}: {rec['restart_s']:.1f} s (load call {rec['load_call_s']:.2f} s, "
        f"{rec['load_after_all_built_s']:.2f} s after the last rank built its model), phases {rec['phases_s']}")
    return rec


# --------------------------------------------------------------------------------------------- #
# Driver
# --------------------------------------------------------------------------------------------- #
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.restart_worker is not None:
        return restart_worker(args.restart_worker)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from unickpt.testing import DistPool

    base = args.dir or tempfile.gettempdir()
    root = tempfile.mkdtemp(prefix="unickpt-tiers-bench-", dir=base)
    mem = tempfile.mkdtemp(prefix="unickpt-tiers-bench-", dir="/dev/shm")
    cfg = {"size_gb": args.size_gb, "hidden": args.hidden, "root": root, "mem": mem, "quick": args.quick}
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[tiers {time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)

    records: list[dict] = []
    load0 = os.getloadavg()
    ws = 4
    try:
        with DistPool(ws, timeout_s=args.timeout) as pool:
            desc = pool.run(w_setup, cfg)[0]
            log(f"GPT {desc['layers']} x d{args.hidden}, state {desc['state_bytes'] / 1e9:.2f} GB, per rank "
                f"{[round(x / 1e9, 3) for x in desc['local_bytes']]} GB; loadavg {os.getloadavg()}")
            state_bytes = desc["state_bytes"]
            if "train" in args.scenarios:
                records += _train(pool, cfg, args, state_bytes, log)
            if "memory" in args.scenarios:
                per = pool.run(w_memory, cfg)
                rec = {"system": "memory", "scenario": "memory", "world_size": ws, "bytes": state_bytes,
                       "per_rank": per,
                       "max_total_over_state": round(max((p["own"] + p["peer"] + p["staging"]) / p["state_bytes"]
                                                         for p in per), 3),
                       "max_shm_over_state": round(max((p["own"] + p["peer"]) / p["state_bytes"] for p in per), 3)}
                records.append(rec)
                log(f"memory per rank / state per rank: {rec['max_total_over_state']}x (shared memory "
                    f"{rec['max_shm_over_state']}x): {per}")
            if "flag" in args.scenarios:
                for system in ("flag-only", "memory"):
                    per = pool.run(w_flag, cfg, system, args.flag_calls, args.flag_step_ms / 1e3)
                    rec = {"system": system, "scenario": "flag", "world_size": ws, "calls": args.flag_calls,
                           "median_s": round(max(p["median_s"] for p in per), 6),
                           "p90_s": round(max(p["p90_s"] for p in per), 6), "per_rank": per}
                    records.append(rec)
                    log(f"per-step agreement ({system}): median {rec['median_s'] * 1e3:.3f} ms, p90 "
                        f"{rec['p90_s'] * 1e3:.3f} ms")
            if "load" in args.scenarios:
                records += _loads(pool, cfg, args, state_bytes, log)
            pool.run(w_close, cfg)
        if "restart" in args.scenarios:
            for tier in ("memory", "disk"):
                rec = run_restart(cfg, tier, log)
                records.append({"system": tier, "scenario": "restart", "world_size": ws, "bytes": state_bytes, **rec})
        env = {"system": "machine", "scenario": "environment", "cpu_count": os.cpu_count(),
               "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()), "platform": platform.platform(),
               "torch": _torch_version(), "args": vars(args), "wall_s": round(time.perf_counter() - t_start, 1),
               "checkpoint_dir": root, "memory_dir": mem}
        records = [env] + records + [_targets(records)]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        print(json.dumps(records[-1], indent=1))
        print(f"wrote {args.out}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    return 0


def _train(pool: Any, cfg: dict, args: argparse.Namespace, state_bytes: int, log: Any) -> list[dict]:
    systems = [s for s in TRAIN_SYSTEMS if s in args.systems or s == "none"]
    rows: dict[str, list] = {s: [] for s in systems}
    seed = 100
    for rnd in range(args.rounds):
        for s in systems:
            per = pool.run(w_train_block, cfg, s, args.steps, seed)[0]
            seed += args.steps
            # a step's time is the slowest rank's (FSDP's collectives keep the ranks in step)
            for i in range(args.steps):
                step_s = max(p[i][0] for p in per)
                stalls = [p[i][1] for p in per if p[i][1] is not None]
                rows[s].append((step_s, max(stalls) if stalls else None, i == 0, sum(p[i][2] for p in per)))
            log(f"round {rnd} {s}: steps {[round(r[0], 2) for r in rows[s][-args.steps:]]}, stalls "
                f"{[None if r[1] is None else round(r[1], 3) for r in rows[s][-args.steps:]]}; loadavg {os.getloadavg()}")
    base = _med([r[0] for r in rows["none"] if not r[2]])
    base_cpu = _med([r[3] for r in rows["none"] if not r[2]])
    out = []
    for s in systems:
        body = [r for r in rows[s] if not r[2]]  # the first step of a block warms up
        step_s = _med([r[0] for r in body])
        cpu_s = _med([r[3] for r in body])
        stalls = [r[1] for r in rows[s] if r[1] is not None]
        out.append({"system": s, "scenario": "train", "world_size": 4, "bytes": state_bytes,
                    "step_time_s": step_s, "stall_s": _med(stalls), "stall_p90_s": _p90(stalls),
                    "interference": None if s == "none" or not base else round(step_s / base - 1, 4),
                    "cpu_per_step_s": cpu_s,
                    "cpu_interference": None if s == "none" or not base_cpu else round(cpu_s / base_cpu - 1, 4),
                    "step_samples_s": [round(r[0], 4) for r in rows[s]],
                    "cpu_samples_s": [round(r[3], 4) for r in rows[s]],
                    "stall_samples_s": [round(x, 4) for x in stalls]})
        log(f"{s}: step {step_s} s, stall {out[-1]['stall_s']} s, interference {out[-1]['interference']}, "
            f"CPU per step {cpu_s} s (all ranks), CPU interference {out[-1]['cpu_interference']}")
    return out


def _loads(pool: Any, cfg: dict, args: argparse.Namespace, state_bytes: int, log: Any) -> list[dict]:
    step = pool.run(w_load_prepare, cfg)[0]
    samples: dict[str, list] = {"memory": [], "peer": [], "disk": []}
    info: dict[str, Any] = {}
    for it in range(args.repeats):
        for tier in ("memory", "peer", "disk"):
            per = pool.run(w_load, cfg, tier)
            assert all(p["ok"] for p in per), f"{tier}: not bitwise equal: {per}"
            assert all(p["step"] == step for p in per), per
            samples[tier].append(max(p["load_s"] for p in per))
            info[tier] = {"tiers": [p["tier"] for p in per], "bytes_by_tier": [p["bytes_by_tier"] for p in per],
                          "dropped_caches": per[0]["dropped_caches"]}
            log(f"load from {tier}: {samples[tier][-1]:.3f} s, tiers {info[tier]['tiers']}; loadavg {os.getloadavg()}")
    out = []
    for tier in ("memory", "peer", "disk"):
        out.append({"system": tier, "scenario": "load", "world_size": 4, "bytes": state_bytes, "step": step,
                    "load_s": _med(samples[tier]), "load_samples_s": [round(x, 4) for x in samples[tier]],
                    "verified": True, **info[tier]})
    return out


def _targets(records: list[dict]) -> dict:
    by = {(r["system"], r["scenario"]): r for r in records}
    t: dict = {"system": "summary", "scenario": "targets"}
    mem, per, ovl = by.get(("memory", "train")), by.get(("persist-async", "train")), by.get(("memory-overlap", "train"))
    if mem and per:
        t["stall_memory_s"], t["stall_persist_async_s"] = mem["stall_s"], per["stall_s"]
        t["stall_memory_not_above_persist_async"] = mem["stall_s"] <= per["stall_s"]
        if ovl:
            t["stall_memory_overlap_s"] = ovl["stall_s"]
    for s in ("memory", "memory-local", "memory-overlap", "persist-async"):
        r = by.get((s, "train"))
        if r and r.get("interference") is not None:
            t[f"interference[{s}]"] = r["interference"]
            t[f"cpu_interference[{s}]"] = r["cpu_interference"]
    if mem and mem.get("interference") is not None:
        t["interference_memory_below_5pct"] = mem["interference"] < 0.05
    l0, l1, ld = by.get(("memory", "load")), by.get(("peer", "load")), by.get(("disk", "load"))
    if l0 and ld:
        t["load_tier0_s"], t["load_tier1_s"], t["load_disk_cold_s"] = l0["load_s"], l1["load_s"] if l1 else None, ld["load_s"]
        t["disk_over_tier0"] = round(ld["load_s"] / l0["load_s"], 2)
        t["tier0_5x_faster_than_disk"] = ld["load_s"] / l0["load_s"] >= 5
        if l1:
            t["disk_over_tier1"] = round(ld["load_s"] / l1["load_s"], 2)
    r0, rd = by.get(("memory", "restart")), by.get(("disk", "restart"))
    if r0 and rd:
        t["restart_memory_s"], t["restart_disk_cold_s"] = r0["restart_s"], rd["restart_s"]
        t["restart_load_memory_s"] = r0.get("load_after_all_built_s")
        t["restart_load_disk_cold_s"] = rd.get("load_after_all_built_s")
    m = by.get(("memory", "memory"))
    if m:
        t["memory_per_rank_over_state"] = m["max_total_over_state"]
        t["shared_memory_per_rank_over_state"] = m["max_shm_over_state"]
    f = by.get(("flag-only", "flag"))
    if f:
        t["flag_cost_per_step_s"] = f["median_s"]
        t["flag_cost_below_1ms"] = f["median_s"] < 1e-3
    fm = by.get(("memory", "flag"))
    if fm:
        t["agreement_with_memory_tiers_per_step_s"] = fm["median_s"]
    return t


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
