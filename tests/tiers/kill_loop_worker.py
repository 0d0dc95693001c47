"""Seeded SIGKILLs of a job training at full speed with memory tiers, and its restarts (issue #29).

Run by ``test_tiers_kill_loop.py``: ``python kill_loop_worker.py --root R --mem D0 D1 --out O
--kills K --seed S``. This process imports torch and unickpt once and then, for each launch, forks a
job of 4 ranks as two simulated nodes (ranks 0-1 on node 0, memory directory D0; ranks 2-3 on node 1,
D1) in one gloo group, so that a launch costs no interpreter start nor ``import torch``.

Each launch ``k`` (0 .. K): every rank builds :func:`tier_worker.make_state` (zeroed), makes
``Checkpointer(R, memory_every=1, persist_every=5)`` and loads (the restart after launch ``k - 1``'s
kill), writes ``O/load_<k>_<rank>.json`` (the step loaded, tiers, bitwise check), then trains at full
speed: ``save(n, state)`` for n = loaded + 1, ... with no sleep. Two side files per rank record its
progress, each a fixed-width number written in place (``pwrite``: still there after a SIGKILL):

* ``begun_<k>_<rank>``: the newest step whose ``save`` this rank called;
* ``done_<k>_<rank>``: the newest step whose memory copy this rank *finished*: its tier 0 copy
  committed (``metadata.json`` written; recorded from the tiers' commit callback, so at most one
  commit late).

Both start at the step loaded. Once every rank has loaded, this process sleeps a seeded random time
and SIGKILLs the 4 ranks (together, wherever each one is), then records in ``O/kill_<k>.json`` the
side files and what each node's memory directory holds (committed own copies per rank, committed
persisted steps). Launch K only loads (the last restart) and exits. ``O/summary.json`` ends the run.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import signal
import sys
import time

# imported once, before the forks (each rank would otherwise import them itself: seconds per launch)
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.profiler  # noqa: F401

import tier_worker
import unickpt
import unickpt.engine  # noqa: F401
import unickpt.geometry  # noqa: F401
import unickpt.lifecycle.root  # noqa: F401
import unickpt.tiers.manager  # noqa: F401
from unickpt.options import TierOptions
from unickpt.testing.dist import _free_port
from unickpt.tiers.node_dirs import MemoryLayout

WORLD, PER_NODE = 4, 2
WIDTH = 20  # bytes of a side file: a right-aligned number


def _side(path: str, value: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.pwrite(fd, b"%*d" % (WIDTH, value), 0)
    return fd


def read_side(path: str) -> int:
    with open(path, "rb") as f:
        return int(f.read())


def _rank_main(a, k: int, rank: int, port: int, final: bool, parent: int) -> None:
    """One rank of launch ``k`` (a forked child); never returns."""
    node = rank // PER_NODE
    t0 = time.time()
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive this process
    if os.getppid() != parent:
        os._exit(1)
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % PER_NODE),
                          LOCAL_WORLD_SIZE=str(PER_NODE))
        from datetime import timedelta

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=120))
        state = tier_worker.make_state(rank, WORLD)
        counter = tier_worker.count_reads_under(a.root)
        ckpt = unickpt.Checkpointer(a.root, memory_every=1, persist_every=5,
                                    tiers=TierOptions(memory_dir=a.mem[node], node_id=f"node{node}"))
        t1 = time.time()
        loaded = ckpt.load(state)
        t2 = time.time()
        stats = ckpt.last_load_stats
        start = -1 if loaded is None else loaded
        fds = {kind: _side(os.path.join(a.out, f"{kind}_{k}_{rank}"), start) for kind in ("begun", "done")}
        tiers = ckpt.tiers
        committed = tiers._committed  # the tiers' commit callback (commit thread, after metadata.json)

        def record_commit(step: int) -> None:  # recorded first: the copy is committed (retention comes next)
            os.pwrite(fds["done"], b"%*d" % (WIDTH, step), 0)
            committed(step)

        tiers._committed = record_commit
        result = {"rank": rank, "step": loaded, "tier": stats.tier if stats else None,
                  "bytes_by_tier": stats.bytes_by_tier if stats else {}, "storage_root_bytes": counter["bytes"],
                  "bad": tier_worker.check(state, loaded, rank, WORLD) if loaded is not None else None,
                  "load_s": t2 - t1, "launch_s": t2 - t0}
        tmp = os.path.join(a.out, f".load_{k}_{rank}.json")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.rename(tmp, os.path.join(a.out, f"load_{k}_{rank}.json"))
        if final:
            ckpt.close()
            dist.destroy_process_group()
            os._exit(0)
        step = start + 1
        while True:  # full speed, until killed
            os.pwrite(fds["begun"], b"%*d" % (WIDTH, step), 0)
            tier_worker.fill(state, step, rank, WORLD)
            ckpt.save(step, state)
            step += 1
    except BaseException:
        import traceback

        with open(os.path.join(a.out, f"error_{k}_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def _memory(a) -> dict:
    """Each rank's committed own copies, from its node's memory directory."""
    return {r: MemoryLayout(a.mem[r // PER_NODE], a.root).committed("own", r, WORLD) for r in range(WORLD)}


def _launch(a, k: int, final: bool, rng: random.Random) -> dict:
    """Launch ``k``: fork the job, wait until every rank has loaded, then (unless ``final``) kill it
    after a seeded random delay; returns (and writes) its record."""
    port, parent = _free_port(), os.getpid()
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            _rank_main(a, k, rank, port, final, parent)
        pids.append(pid)
    record: dict = {"launch": k, "pids": pids}
    paths = lambda name: [os.path.join(a.out, f"{name}_{k}_{r}") for r in range(WORLD)]  # noqa: E731
    deadline = time.monotonic() + 180
    while not all(os.path.exists(p + ".json") for p in paths("load")) and time.monotonic() < deadline:
        if any(os.path.exists(p + ".txt") for p in paths("error")):
            break
        time.sleep(0.01)
    if not final:
        record["delay_s"] = rng.uniform(0.05, 1.0)
        time.sleep(record["delay_s"])
    running = list(pids)
    while final and running and time.monotonic() < deadline:  # the last launch exits by itself
        running = [pid for pid in running if os.waitpid(pid, os.WNOHANG)[0] == 0]
        time.sleep(0.05)
    for pid in running:  # every rank, back to back: they are at different steps
        os.kill(pid, signal.SIGKILL)
    for pid in running:
        os.waitpid(pid, 0)
    record["errors"] = {r: open(p + ".txt").read() for r, p in enumerate(paths("error")) if os.path.exists(p + ".txt")}
    if not all(os.path.exists(p + ".json") for p in paths("load")):
        record["errors"]["launch"] = f"not every rank loaded within 180 s (launch {k})"
    if not final:
        record["begun"] = [read_side(p) for p in paths("begun")]
        record["done"] = [read_side(p) for p in paths("done")]
        record["own_copies"] = _memory(a)
        record["persisted"] = [s for s, ok in unickpt.list_checkpoints(a.root) if ok]
    with open(os.path.join(a.out, f"kill_{k}.json"), "w") as f:
        json.dump(record, f)
    return record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--mem", nargs=2, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)
    t0 = time.time()
    for k in range(a.kills + 1):
        rec = _launch(a, k, final=k == a.kills, rng=rng)
        if rec["errors"]:
            break
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"launches": k + 1, "seconds": time.time() - t0}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
