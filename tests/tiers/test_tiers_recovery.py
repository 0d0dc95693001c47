"""The checkpoint tiers with real processes: two ``torchrun`` launches on this host are two nodes (two
ranks each, one rendezvous), each with its own memory directory under /dev/shm.

One training run (memory every step, storage every third) is crashed (SIGKILL of one rank, then of
the job); each scenario restarts the job from a copy of what the crash left:

* crash: every rank restores the last memory step from its node's memory, bitwise, and nothing is
  read under the persistent root;
* node loss (node 1's launch killed and its memory directory removed): node 1's ranks get their
  shards from node 0's memory over the process group, bitwise;
* both memory copies of one rank's shards gone: the job falls back to the persisted step;
* a flipped byte in one rank's memory copy: that rank falls back to its peer copy (a warning), no bad
  tensor.

And a SIGTERM to one rank during training makes every rank save that step persistently.

``torchrun`` runs with the static rendezvous (``--master-addr``/``--master-port``): it is the one that
honours ``--node-rank``, so that node 0's launch holds ranks 0-1 at every restart (the c10d rendezvous
assigns node ranks in joining order; recovery handles that too, by where the copies are, but the
scenarios' expectations name the nodes).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from unickpt.tiers.node_dirs import SPARE_DIR
from unickpt.tiers.manager import MAX_SPARES, MAX_UNSETTLED

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "tier_worker.py")
TRAIN_STEPS = 5  # steps 0..4: memory copies of every step, persisted steps 0 and 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Two torchrun launches (nodes 0 and 1, two ranks each) of the tier worker."""

    def __init__(self, mem_dirs: list[str], args: list[str], out: str):
        self.out = out
        port = _free_port()
        self.procs = []
        self.logs = []
        for node in (0, 1):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "UNICKPT_MEMORY_DIR": mem_dirs[node]}
            env.pop("UNICKPT_NODE_ID", None)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   WORKER, *args, "--out", out]
            log = open(os.path.join(os.path.dirname(out), f"{os.path.basename(out)}-node{node}.log"), "w")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def wait(self, timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"job timed out; logs:\n{self.log_text()}")
        return codes

    def kill(self, node: int | None = None) -> None:
        """SIGKILL the launches (of ``node``, or all) and their workers (torchrun starts each worker
        in a session of its own: killing the launcher's group leaves them running)."""
        for rank in range(4):
            if node is None or rank // 2 == node:
                try:
                    pid = self.pid(rank)
                    with open(f"/proc/{pid}/cmdline", "rb") as f:  # still this job's worker (not a reused pid)
                        mine = self.out.encode() in f.read()
                    if mine:
                        os.kill(pid, signal.SIGKILL)
                except (OSError, ValueError):  # not started, or gone
                    pass
        for i, p in enumerate(self.procs):
            if node is None or i == node:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()

    def log_text(self) -> str:
        for log in self.logs:
            log.flush()
        return "\n".join(open(log.name).read()[-4000:] for log in self.logs)

    def results(self) -> list[dict]:
        return [json.load(open(os.path.join(self.out, f"result_{r}.json"))) for r in range(4)]

    def pid(self, rank: int) -> int:
        return int(open(os.path.join(self.out, f"pid_{rank}")).read())


def _wait_for(predicate, timeout: float, job: Job) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            job.kill()
            raise AssertionError(f"timed out waiting; logs:\n{job.log_text()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A training run crashed after its last step: the persistent root and both nodes' memory
    directories as the crash left them (copied again for each scenario)."""
    base = tmp_path_factory.mktemp("tiers")
    mem = [tempfile.mkdtemp(prefix=f"unickpt-test-node{n}-", dir="/dev/shm") for n in (0, 1)]
    root = str(base / "root")
    job = Job(mem, ["train", "--root", root, "--steps", str(TRAIN_STEPS), "--persist-every", "3", "--hold"],
              str(base / "train"))
    try:
        _wait_for(lambda: len(glob.glob(os.path.join(job.out, "ready_*"))) == 4, 240, job)
        trained = job.results()
        os.kill(job.pid(1), signal.SIGKILL)  # the crash: one rank dies...
        time.sleep(0.5)
        job.kill()  # ...and the job with it
        # the memory directories' run names derive from the root's path: scenarios restore the root
        # at the same path, and the memory directories anywhere
        backup = str(base / "root-as-crashed")
        shutil.copytree(root, backup)
        pristine = {"root": root, "backup": backup, "mem": mem}
        yield {"base": base, "pristine": pristine, "trained": trained}
    finally:
        job.kill()
        for d in mem:
            shutil.rmtree(d, ignore_errors=True)


def _scenario(crashed, name: str):
    """A fresh copy of the crash's leftovers: (root, [node 0 memory dir, node 1 memory dir], out dir)."""
    base = crashed["base"]
    root = crashed["pristine"]["root"]
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(crashed["pristine"]["backup"], root)
    mem = []
    for n, src in enumerate(crashed["pristine"]["mem"]):
        dst = tempfile.mkdtemp(prefix=f"unickpt-test-{name}-node{n}-", dir="/dev/shm")
        shutil.rmtree(dst)
        shutil.copytree(src, dst)
        mem.append(dst)
    return root, mem, str(base / f"{name}-out")


def _recover(root: str, mem: list[str], out: str, inspect=None) -> list[dict]:
    job = Job(mem, ["recover", "--root", root], out)
    try:
        codes = job.wait()
        assert codes == [0, 0], job.log_text()
        if inspect is not None:
            inspect(mem)
        return job.results()
    finally:
        job.kill()
        for d in mem:
            shutil.rmtree(d, ignore_errors=True)


def _copies(rank_dir: str) -> list[str]:
    """The copies (``step_<N>``) in a rank's memory directory, without its dot-directories (``.spare``:
    the data files that in-place staging recycles, ``.sending``: links of a peer copy being sent;
    docs/tiers.md)."""
    return sorted(n for n in os.listdir(rank_dir) if not n.startswith("."))


def _run_dir(mem_dir: str) -> str:
    (run,) = glob.glob(os.path.join(mem_dir, "run-*"))
    return run


def test_training_kept_bounded_memory(crashed):
    """Every rank's memory copies: its own newest steps and one peer's, nothing growing."""
    for r in crashed["trained"]:
        assert r["last_step"] == TRAIN_STEPS - 1
        used = r["memory_bytes"]
        assert 0 < used["own"] and 0 < used["peer"]
    node0 = _run_dir(crashed["pristine"]["mem"][0])
    own = [int(n[len("step_"):]) for n in _copies(os.path.join(node0, "own", "rank_0_of_4"))]
    agreed = crashed["trained"][0]["agreed"]  # what the last retention knew every rank had finished
    assert TRAIN_STEPS - 1 in own, own  # the newest
    assert agreed["finished"] is None or agreed["finished"] in own, (own, agreed)  # the last common step
    assert len(own) <= 2 + MAX_UNSETTLED, own  # and the steps newer than it (a rank may still be finishing one)
    spares = os.listdir(os.path.join(node0, "own", "rank_0_of_4", SPARE_DIR))  # removed copies' data files
    assert len(spares) <= MAX_SPARES, spares
    assert sorted(os.listdir(os.path.join(node0, "peer"))) == ["rank_2_of_4", "rank_3_of_4"]


def test_crash_restores_memory_bitwise_without_storage_reads(crashed):
    root, mem, out = _scenario(crashed, "crash")
    results = _recover(root, mem, out)
    for r in results:
        assert r["step"] == TRAIN_STEPS - 1, r
        assert r["bad"] == [], r
        assert r["tier"] == "memory" and set(r["bytes_by_tier"]) == {"memory"}, r
        assert r["bytes_by_tier"]["memory"] > 0
        assert r["storage_root_bytes"] == 0, r  # not one byte from the persistent checkpoint


def test_node_loss_restores_from_peer_memory(crashed):
    root, mem, out = _scenario(crashed, "nodeloss")
    shutil.rmtree(mem[1])  # node 1 is gone with its shared memory; a fresh node takes its place
    os.makedirs(mem[1])
    restored = {}

    def inspect(mem):  # the copies received from node 0 are node 1's tier 0 copies now
        run1 = _run_dir(mem[1])
        for r in (2, 3):
            restored[r] = _copies(os.path.join(run1, "own", f"rank_{r}_of_4"))

    results = _recover(root, mem, out, inspect)
    assert restored == {2: [f"step_{TRAIN_STEPS - 1}"], 3: [f"step_{TRAIN_STEPS - 1}"]}
    for r in results:
        assert r["step"] == TRAIN_STEPS - 1, r
        assert r["bad"] == [], r
        assert r["storage_root_bytes"] == 0, r
    assert [r["tier"] for r in results] == ["memory", "memory", "peer", "peer"]
    for r in results[2:]:
        assert r["peer_bytes_received"] > 0 and set(r["bytes_by_tier"]) == {"peer"}


def test_both_memory_copies_gone_fall_back_to_storage(crashed):
    root, mem, out = _scenario(crashed, "bothgone")
    shutil.rmtree(os.path.join(_run_dir(mem[1]), "own", "rank_3_of_4"))  # rank 3's own copies
    shutil.rmtree(os.path.join(_run_dir(mem[0]), "peer", "rank_3_of_4"))  # and the ones node 0 held for it
    results = _recover(root, mem, out)
    for r in results:
        assert r["step"] == 3, r  # the newest persisted step
        assert r["bad"] == [], r
        assert r["tier"] == "storage" and r["storage_root_bytes"] > 0, r


def test_flipped_byte_in_memory_falls_back_to_peer(crashed):
    root, mem, out = _scenario(crashed, "flip")
    copy = os.path.join(_run_dir(mem[0]), "own", "rank_1_of_4", f"step_{TRAIN_STEPS - 1}")
    data = sorted(glob.glob(os.path.join(copy, "data", "*.bin")))[0]
    with open(data, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))
    results = _recover(root, mem, out)
    for r in results:
        assert r["step"] == TRAIN_STEPS - 1, r
        assert r["bad"] == [], r  # no bad tensor anywhere
        assert r["storage_root_bytes"] == 0, r
    assert [r["tier"] for r in results] == ["memory", "peer", "memory", "memory"]
    logs = open(os.path.join(os.path.dirname(out), f"{os.path.basename(out)}-node0.log")).read()
    assert "unusable" in logs and "checksum" in logs


def test_sigterm_to_one_rank_saves_that_step_on_every_rank(tmp_path):
    mem = [tempfile.mkdtemp(prefix=f"unickpt-test-term-node{n}-", dir="/dev/shm") for n in (0, 1)]
    root = str(tmp_path / "root")
    job = Job(mem, ["train", "--root", root, "--until-preempted", "--step-sleep", "0.3", "--memory-every", "1"],
              str(tmp_path / "term"))
    try:
        progress = os.path.join(job.out, "progress")
        _wait_for(lambda: os.path.exists(progress) and int(open(progress).read() or 0) >= 3, 240, job)
        t_signal = time.time()
        os.kill(job.pid(2), signal.SIGTERM)  # a preemption notice to one rank of node 1
        codes = job.wait()
        assert codes == [0, 0], job.log_text()
        results = job.results()
    finally:
        job.kill()
        for d in mem:
            shutil.rmtree(d, ignore_errors=True)
    steps = {r["preempted_step"] for r in results}
    assert len(steps) == 1, results  # every rank saved the same step
    (step,) = steps
    assert [r["notice"] for r in results] == [None, None, "SIGTERM", None]
    import unickpt

    listing = dict(unickpt.list_checkpoints(root))
    assert listing.get(step) is True, listing  # committed
    import tier_worker

    target = {"w": torch.zeros(4 * tier_worker.ROWS, tier_worker.COLS), "rep": torch.zeros(257, dtype=torch.float64),
              "step": -1}
    unickpt.load(os.path.join(root, f"step_{step}"), target, strict=False)
    for rank in range(4):
        want = tier_worker.expected(step, rank, 4)
        assert torch.equal(target["w"][rank * tier_worker.ROWS:(rank + 1) * tier_worker.ROWS], want["w"])
    assert target["step"] == step
    grace_s = 30.0  # a typical preemption notice (Kubernetes' default grace period, GCE's spot VMs)
    assert max(r["saved_at"] for r in results) - t_signal < grace_s, results
