"""Issue #29: memory tiers never lose the job's last common step.

Two simulated nodes x 2 ranks, ``Checkpointer(root, memory_every=1, persist_every=5)``, ``save(n,
state)`` in a loop with no sleep, and a SIGKILL of every rank at a seeded random moment, when the ranks
are at different steps (``kill_loop_worker.py``, which also restarts the job after each kill). After
every kill:

* each rank's memory (its node's directory) still holds the job's last common step: the newest step
  every rank finished (its tier 0 copy committed), whatever step the ranks ahead had reached;
* the restart loads exactly that step, from memory (no byte read under the persistent root), and
  every tensor is bitwise the one saved at that step.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KILLS = 20


@pytest.fixture
def kill_loop(tmp_path):
    """Runs the worker: ``KILLS`` seeded kills and restarts; yields ``(records, loads)``:
    ``records[k]`` is launch ``k``'s kill record, ``loads[k][rank]`` its restart's load result."""
    mem = [tempfile.mkdtemp(prefix=f"unickpt-test-kills-node{n}-", dir="/dev/shm") for n in (0, 1)]
    out = str(tmp_path / "out")
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, os.path.join(HERE, "kill_loop_worker.py"), "--root", str(tmp_path / "root"),
               "--mem", *mem, "--out", out, "--kills", str(KILLS), "--seed", "29"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        records = [json.load(open(os.path.join(out, f"kill_{k}.json"))) for k in range(KILLS + 1)]
        loads = [[json.load(open(os.path.join(out, f"load_{k}_{r}.json"))) for r in range(4)]
                 for k in range(KILLS + 1)]
        yield records, loads
    finally:
        for d in mem:
            shutil.rmtree(d, ignore_errors=True)


def test_seeded_kills_at_full_speed_restart_from_the_last_common_memory_step(kill_loop):
    records, loads = kill_loop
    assert all(rec["errors"] == {} for rec in records), [rec["errors"] for rec in records if rec["errors"]]
    skewed = 0
    for k, rec in enumerate(records[:-1]):
        own = {int(r): steps for r, steps in rec["own_copies"].items()}
        # each rank finished the newest step whose copy it committed: its side file says so (at most one
        # commit late: a SIGKILL between the commit and the record); its newest copy is never removed
        finished = [max([rec["done"][r]] + own[r]) for r in range(4)]
        assert all(rec["done"][r] <= finished[r] <= rec["begun"][r] for r in range(4)), rec
        common = min(finished)
        skewed += len(set(finished)) > 1
        if common >= 0:
            missing = {r: own[r] for r in range(4) if common not in own[r]}
            assert not missing, f"kill {k}: every rank finished step {common}, but these ranks' memory lost it: " \
                                f"{missing} (finished {finished})"
        persisted = max(rec["persisted"], default=-1)
        want = max(common, persisted)
        restart = loads[k + 1]
        got = [r["step"] if r["step"] is not None else -1 for r in restart]
        assert got == [want] * 4, f"kill {k}: finished {finished}, persisted {persisted}: restart loaded {got}"
        if want < 0:
            continue
        for r in restart:
            assert r["bad"] == [], (k, r)  # bitwise the state saved at that step
            if want == common:  # from its node's memory: not one byte read under the persistent root
                assert r["tier"] == "memory" and r["storage_root_bytes"] == 0, (k, r)
                assert set(r["bytes_by_tier"]) == {"memory"} and r["bytes_by_tier"]["memory"] > 0, (k, r)
    assert skewed >= 1, "no kill found the ranks at different steps"
