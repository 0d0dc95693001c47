"""Fault injection: a process saving checkpoints is SIGKILLed at each stage of a save, and at random
times; after every kill the newest committed checkpoint loads bitwise intact, `latest` never names an
uncommitted checkpoint, and the next run resumes, cleans up leftovers and saves on."""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

import unickpt
from fault_child import value

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_child.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_child(root, stage="none", kill_step=-1, steps=3):
    return subprocess.run([sys.executable, CHILD, str(root), stage, str(kill_step), str(steps)], env=ENV,
                          capture_output=True, text=True, timeout=300)


def check_latest(root) -> int | None:
    """The step that ``latest`` names (None: no file yet)."""
    try:
        return int(open(os.path.join(root, "latest")).read().strip().removeprefix("step_"))
    except (FileNotFoundError, ValueError):
        return None


def check_consistent(root) -> int | None:
    """The newest committed step loads bitwise; `latest` names a committed step. Returns that step."""
    listing = unickpt.list_checkpoints(str(root))
    committed = [s for s, ok in listing if ok]
    latest_file = os.path.join(root, "latest")
    if os.path.exists(latest_file):
        named = open(latest_file).read().strip()
        assert named in {f"step_{s}" for s in committed}, (named, listing)
    ckpt = unickpt.Checkpointer(root)
    state = {"w": torch.zeros(value(0).numel()), "step": -1, "probe": {"ok": None}}
    step = ckpt.load(state)
    assert step == (max(committed) if committed else None)
    if step is not None:
        assert torch.equal(state["w"], value(step)) and state["step"] == step
    return step


@pytest.mark.parametrize("stage", ["snapshot", "mid-write", "before-commit", "after-commit", "retention"])
def test_kill_at_each_stage(tmp_path, stage):
    root = tmp_path / "run"
    first = run_child(root, steps=3)  # steps 0..2 committed, keep_last=2
    assert first.returncode == 0, first.stderr
    killed = run_child(root, stage, kill_step=4, steps=3)  # resumes at 3, dies during step 4's save
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stdout, killed.stderr[-2000:])
    step = check_consistent(root)
    assert step == (4 if stage in ("after-commit", "retention") else 3)
    resumed = run_child(root, steps=2)  # the next start resumes and saves on
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed={step}" in resumed.stdout
    final = check_consistent(root)
    assert final == step + 2
    assert [s for s, ok in unickpt.list_checkpoints(str(root)) if not ok and s < final] == []  # leftovers cleaned


def test_kill_at_random_times(tmp_path):
    rng = random.Random(1234)
    root = tmp_path / "run"
    trials, passed, steps = 8, 0, []
    for trial in range(trials):
        proc = subprocess.Popen([sys.executable, CHILD, str(root), "loop", "-1", "1000"], env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        # start-up and the run's first save take 1-10 s depending on the machine's load: wait until
        # this run committed a step of its own, then kill at a random point of the save loop
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("ready resumed="), f"the child never reached its save loop: {line!r}"
        resumed = line.split("=", 1)[1].strip()
        first = 0 if resumed == "None" else int(resumed) + 1
        deadline = time.monotonic() + 120
        while (latest := check_latest(root)) is None or latest < first:
            assert time.monotonic() < deadline and proc.poll() is None, "the child committed nothing"
            time.sleep(0.02)
        time.sleep(rng.random() * 1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        steps.append(check_consistent(root))
        passed += 1
    assert passed == trials
    assert steps[-1] is not None and steps[-1] >= trials  # every run resumed and committed more steps
    last = run_child(root, steps=1)
    assert last.returncode == 0, last.stderr[-2000:]
    check_consistent(root)


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs (and a read-only one) mounted for the test; skipped where mounting is not allowed."""
    mounts = []

    def mount(name, options):
        target = tmp_path / name
        target.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
        mounts.append(target)
        return target

    yield mount
    for target in mounts:
        subprocess.run(["umount", str(target)], capture_output=True)


def test_disk_full_fails_the_save_and_keeps_the_last_checkpoint(small_fs):
    root = small_fs("full", "size=2m") / "run"
    ckpt = unickpt.Checkpointer(root, keep_last=1)
    ckpt.save(1, {"w": torch.ones(1 << 18)}).wait()  # 1 MiB: fits
    with pytest.raises(unickpt.SaveFailedError, match="No space left on device"):
        ckpt.save(2, {"w": torch.ones(1 << 19)}).wait()  # 2 MiB more: does not
    assert not (root / "step_2" / "metadata.json").exists()
    assert (root / "latest").read_text() == "step_1"
    out = {"w": torch.zeros(1 << 18)}
    assert ckpt.load(out) == 1 and bool((out["w"] == 1).all())


def test_read_only_destination_fails_clearly(small_fs):
    root = small_fs("ro", "size=1m,ro") / "run"
    with pytest.raises(unickpt.SaveFailedError, match="Read-only file system"):
        unickpt.Checkpointer(root).save(1, {"w": torch.ones(4)})


TWO_WRITERS = """
import os, sys, threading, time, torch, unickpt
from unickpt.testing import Fault, install
root, step, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
# a long write: the directory stays incomplete until the test creates root + '.release' (or hold s)
if hold > 0:
    gate = Fault("write", nth=None, action="hold", delay_s=hold)
    install(gate)
    def release():
        while not os.path.exists(root + ".release"):
            time.sleep(0.05)
        gate.release()
    threading.Thread(target=release, daemon=True).start()
ckpt = unickpt.Checkpointer(root)
try:
    ckpt.save(step, {"w": torch.full((1000,), float(step))}).wait()
    print("committed", step)
except unickpt.CheckpointExistsError as e:
    print("refused", step, e)
"""


def test_two_checkpointers_on_one_root(tmp_path):
    """Two processes save into one root: a slow save of step 1 is never deleted by the other's
    retention (its writer is alive), and a second writer of the same step is refused."""
    root = tmp_path / "run"
    slow = subprocess.Popen([sys.executable, "-c", TWO_WRITERS, str(root), "1", "120"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (root / "step_1" / ".unickpt-writer").exists() and time.time() < deadline:
        time.sleep(0.1)
    same = subprocess.run([sys.executable, "-c", TWO_WRITERS, str(root), "1", "0"], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert "refused 1" in same.stdout and "another process is saving" in same.stdout, same.stdout + same.stderr
    other = subprocess.run([sys.executable, "-c", TWO_WRITERS, str(root), "2", "0"], env=ENV, capture_output=True,
                           text=True, timeout=120)
    assert "committed 2" in other.stdout, other.stderr[-2000:]
    open(str(root) + ".release", "w").close()  # the slow save of step 1 may go on
    out, err = slow.communicate(timeout=120)
    assert "committed 1" in out, err[-2000:]
    assert [s for s, ok in unickpt.list_checkpoints(str(root)) if ok] == [1, 2]
