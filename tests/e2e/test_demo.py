"""The demo (``make demo``) in miniature: train on 2 ranks, SIGKILL mid-save, resume on 1 rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(600)
def test_demo_kill_and_resume_on_fewer_ranks(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "examples", "run_demo.py"), "--workdir", str(tmp_path / "demo"),
           "--steps", "6", "--ckpt-every", "2", "--kill-at", "4", "--world", "2", "--resume-world", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=580)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    report = json.load(open(tmp_path / "demo" / "report.json"))
    assert report["saved_world_size"] == 2 and report["resumed_world_size"] == 1
    assert report["killed_at_step"] == 4 and report["killed_during_write"] is True
    assert report["resumed_from_step"] == 2
    assert report["state_bitwise_equal"] is True
    assert abs(report["loss_reference"] - report["loss_resumed"]) <= report["loss_tolerance"]
    assert report["stall_ms_median"] > 0 and report["torch_save_ms_median"] > 0
