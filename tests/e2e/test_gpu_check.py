"""benchmarks/gpu_check.py (issue #23) keeps working on CPU: its ``--dry-run`` runs every phase at tiny
sizes on CPU tensors; the correctness checks must hold and every phase and system must report.

The script runs in a child process (it initializes the default process group and unickpt's engine).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "benchmarks", "gpu_check.py")


@pytest.mark.timeout(120)
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    res = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--out", str(out), "--dir", str(tmp_path / "ck"),
         "--disk-probe-mb", "4", "--reuse-saves", "3", "--saves", "1", "--total-budget", "90"],
        env=env, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["schema"] == "unickpt-gpu-check/1" and r["status"] == "done" and r["cuda"] is False
    phases = r["phases"]
    assert list(phases) == ["env", "correctness", "reuse", "d2h", "train"]
    assert {k: v["status"] for k, v in phases.items()} == dict.fromkeys(phases, "ok"), {
        k: v.get("error") for k, v in phases.items()}

    env_r = phases["env"]["result"]
    assert env_r["training_all_reduce_ok"] and env_r["unickpt_plan_group_backend"] == "gloo"

    c = phases["correctness"]["result"]
    for mode in ("sync", "overlap"):
        m = c[mode]
        assert m["bitwise_equal"] and m["rng_restored"] and m["on_device"] and m["step_restored"], m
        assert m["source_mutated_after_call"] and m["mismatched"] == [] and m["tensors_compared"] > 30
        assert m["ok"] is True
    assert c["ok"] is True

    reuse = phases["reuse"]["result"]
    assert reuse["saves"] == 3 and reuse["flat"] is True
    assert reuse["allocations_first_save"] == reuse["allocations_last_save"]

    d2h = phases["d2h"]["result"]
    assert d2h["unickpt_staging"]["stage_gbps"] > 0 and "skipped" in d2h["to_cpu_non_blocking"]

    systems = phases["train"]["result"]["systems"]
    for s in ("unickpt-async", "unickpt-async-overlap", "dcp-async-cached", "torch.save"):
        assert systems[s].get("stall_s") is not None, systems[s]
    assert systems["none"]["idle_step_s"] > 0
    tc = systems["torch_checkpointing"]
    assert tc.get("stall_s") is not None or "not installed" in tc.get("skipped", ""), tc

    t = r["targets"]
    assert t["correctness"]["ok"] is True and t["pinned_pool_reuse"]["ok"] is True
    assert "skipped" in t["d2h"] and "skipped" in t["stall"]
