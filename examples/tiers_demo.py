"""Checkpoint tiers demo (docs/tiers.md): memory every step, storage every 4 steps, two simulated nodes.

    .venv/bin/python examples/tiers_demo.py            # about a minute or two on 2 CPU cores

Two ``torchrun`` launches on this host are two nodes (one rank each, one rendezvous), each with its
own memory directory under /dev/shm. The training script is this file (``--worker``): a model and its
optimizer, plus a row-sharded tensor, with ``Checkpointer(root, memory_every=1, persist_every=4)`` and
``ckpt.save(step, state)`` at every step. Phases:

1. train steps 1-7, then the job crashes (SIGKILL of rank 1, then of everything);
2. restart: both ranks restore step 7 from their node's memory (storage only has step 4);
3. crash again and lose node 1 with its memory: rank 1 restores step 7 from node 0's memory;
4. a SIGTERM to rank 0 during training: both ranks save that step persistently and stop.

Each restart checks the restored state bitwise against what the crashed run had. Prints one line per
phase; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------------------------- #
# The training script (one rank, under torchrun)
# --------------------------------------------------------------------------------------------- #
def worker(a: argparse.Namespace) -> int:
    t_start = time.time()
    import torch
    import torch.distributed as dist

    import unickpt

    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = 1024
    mine = unickpt.Shard(torch.zeros(rows, 256), (rows * ws, 256), offsets=(rows * rank, 0))  # this rank's rows
    state = {"model": model, "optim": optim, "rows": mine, "step": 0}
    ckpt = unickpt.Checkpointer(a.root, memory_every=1, persist_every=4)

    def train(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        mine.tensor.add_(step + rank)
        state["step"] = step

    out = {"rank": rank}
    with open(os.path.join(a.out, f"pid_{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if a.worker == "train":
        step = (ckpt.load(state) or 0) + 1  # the newest step every rank can restore (none: a new run)
        while True:
            train(step)
            ckpt.save(step, state)
            if ckpt.preempted:
                out["preempted_step"] = ckpt.preempted_step
                break
            if not a.until_preempted and step == a.stop:
                ckpt.wait()
                torch.save({"model": model.state_dict(), "rows": mine.tensor}, os.path.join(a.out, f"ref_{rank}.pt"))
                open(os.path.join(a.out, f"ready_{rank}"), "w").close()
                while True:  # the crash comes from outside
                    time.sleep(1)
            if a.until_preempted:
                open(os.path.join(a.out, "progress"), "w").write(str(step))
                time.sleep(0.3)
            step += 1
    else:  # restore
        t0 = time.time()
        step = ckpt.load(state)
        t1 = time.time()
        ref = torch.load(os.path.join(a.out, f"ref_{rank}.pt"))
        same = torch.equal(mine.tensor, ref["rows"]) and all(torch.equal(v, ref["model"][k])
                                                             for k, v in model.state_dict().items())
        stats = ckpt.last_load_stats
        out.update(step=step, tier=stats.tier, load_s=round(t1 - t0, 3), restart_s=round(t1 - t_start, 1),
                   bitwise=same, mb=round(sum(stats.bytes_by_tier.values()) / 1e6, 1))
    with open(os.path.join(a.out, f"{a.worker}_{rank}.json"), "w") as f:
        json.dump(out, f)
    ckpt.close()
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------- #
# The driver
# --------------------------------------------------------------------------------------------- #
class Job:
    """Two launches of one rank each: node 0 and node 1."""

    def __init__(self, root: str, mem: list[str], out: str, args: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.out, self.procs = out, []
        for node in (0, 1):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "UNICKPT_MEMORY_DIR": mem[node]}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), HERE,
                   "--root", root, "--out", out, *args]
            log = open(os.path.join(out, f"node{node}.log"), "a")
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def wait_for(self, predicate, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in self.procs):
                self.crash()
                raise SystemExit(f"the job failed; see {self.out}/node*.log")
            time.sleep(0.2)

    def crash(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher
            except ProcessLookupError:
                pass
            p.wait()
        for rank in (0, 1):  # the workers (torchrun gives each a session of its own)
            pid = _pid(self.out, rank)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def results(self, kind: str) -> list[dict]:
        return [json.load(open(os.path.join(self.out, f"{kind}_{r}.json"))) for r in (0, 1)]


def _pid(out: str, rank: int) -> int | None:
    """The pid of ``rank``'s worker of this demo run, if it still runs (checked in /proc: a pid that was
    reused by another process is not returned)."""
    try:
        pid = int(open(os.path.join(out, f"pid_{rank}")).read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return pid if out.encode() in f.read() else None
    except (OSError, ValueError):
        return None


def _clear(out: str) -> None:
    """Remove the previous phase's markers and results, so that a phase waits for its own."""
    for name in os.listdir(out):
        if name.split("_")[0] in ("ready", "restore", "train", "ref") or name == "progress":
            os.remove(os.path.join(out, name))


def restart(root: str, mem: list[str], out: str) -> list[dict]:
    job = Job(root, mem, out, ["--worker", "restore"])
    job.wait_for(lambda: all(os.path.exists(os.path.join(out, f"restore_{r}.json")) for r in (0, 1)))
    for p in job.procs:
        p.wait()
    return job.results("restore")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=["train", "restore"])
    p.add_argument("--root")
    p.add_argument("--out")
    p.add_argument("--stop", type=int, default=7)
    p.add_argument("--until-preempted", action="store_true")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    work = tempfile.mkdtemp(prefix="unickpt-tiers-demo-")
    mem = [tempfile.mkdtemp(prefix=f"unickpt-tiers-demo-node{n}-", dir="/dev/shm") for n in (0, 1)]
    root, out = os.path.join(work, "root"), os.path.join(work, "out")
    os.makedirs(out)
    ok = True

    def report(phase: str, rows: list[dict], want_step: int, want_tiers: list[str]) -> None:
        nonlocal ok
        good = all(r["bitwise"] and r["step"] == want_step for r in rows) and [r["tier"] for r in rows] == want_tiers
        ok = ok and good
        cells = ", ".join(f"rank {r['rank']}: step {r['step']} from {r['tier']} ({r['mb']} MB in {r['load_s']} s, "
                          f"restart {r['restart_s']} s)" for r in rows)
        print(f"{'OK  ' if good else 'FAIL'} {phase}: {cells}; bitwise {all(r['bitwise'] for r in rows)}", flush=True)

    try:
        job = Job(root, mem, out, ["--worker", "train", "--stop", "7"])
        job.wait_for(lambda: all(os.path.exists(os.path.join(out, f"ready_{r}")) for r in (0, 1)))
        job.crash()
        persisted = sorted(s for s, committed in __import__("unickpt").list_checkpoints(root) if committed)
        print(f"     trained steps 1-7 (memory every step, storage every 4: storage has {persisted}); crash", flush=True)
        report("restart after a crash", restart(root, mem, out), 7, ["memory", "memory"])
        _clear(out)
        job = Job(root, mem, out, ["--worker", "train", "--stop", "9"])  # resumes at step 8
        job.wait_for(lambda: all(os.path.exists(os.path.join(out, f"ready_{r}")) for r in (0, 1)))
        job.crash()
        shutil.rmtree(mem[1])  # node 1 is lost with its memory; a new node takes its place
        os.makedirs(mem[1])
        report("restart after losing node 1", restart(root, mem, out), 9, ["memory", "peer"])
        _clear(out)
        job = Job(root, mem, out, ["--worker", "train", "--until-preempted"])  # resumes at step 10
        progress = os.path.join(out, "progress")
        job.wait_for(lambda: os.path.exists(progress) and int(open(progress).read() or 0) >= 12)
        t = time.time()
        os.kill(_pid(out, 0), signal.SIGTERM)
        job.wait_for(lambda: all(os.path.exists(os.path.join(out, f"train_{r}.json")) for r in (0, 1)))
        for p_ in job.procs:
            p_.wait()
        steps = {r["preempted_step"] for r in job.results("train")}
        import unickpt

        committed = dict(unickpt.list_checkpoints(root))
        good = len(steps) == 1 and committed.get(next(iter(steps))) is True
        ok = ok and good
        print(f"{'OK  ' if good else 'FAIL'} SIGTERM to rank 0: both ranks saved step {sorted(steps)} persistently "
              f"{time.time() - t:.1f} s after the signal (committed: {good})", flush=True)
    finally:
        for d in mem:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
