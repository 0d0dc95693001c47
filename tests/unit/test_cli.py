"""The ``unickpt`` command line: inspect, ls, verify, diff (export, import, rm, prune: test_tooling.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch

import unickpt
from unickpt.tools.cli import main


def test_inspect_and_ls(tmp_path, capsys):
    root = tmp_path / "run"
    ckpt = unickpt.Checkpointer(root, async_save=False)
    ckpt.save(5, {"w": torch.zeros(100, 10), "b": torch.zeros(3, dtype=torch.bfloat16)})
    os.makedirs(root / "step_9" / "data")
    assert main(["inspect", str(root / "step_5")]) == 0
    out = capsys.readouterr().out
    assert "step 5" in out and '"world_size": 1' in out
    assert any(line.split()[:4] == ["w", "float32", "100x10", "1"] and line.endswith("4.0 KB") for line in out.splitlines())
    assert main(["ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["step_5", "5", "committed"] and lines[1].endswith("<- latest")
    assert lines[2].split()[:3] == ["step_9", "9", "INCOMPLETE"]
    assert main(["ls", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["committed"], r["latest"]) for r in rows] == [(5, True, True), (9, False, False)]
    files = [root / "step_5" / "metadata.json", root / "step_5" / ".unickpt-writer", root / "step_5" / "data" / "0_0.bin"]
    assert os.path.getsize(files[2]) == 4006 and rows[0]["bytes"] == sum(os.path.getsize(f) for f in files)


def test_inspect_incomplete_fails_clearly(tmp_path, capsys):
    os.makedirs(tmp_path / "x")
    assert main(["inspect", str(tmp_path / "x")]) == 2
    assert "metadata.json is missing" in capsys.readouterr().err


def test_console_script_installed(tmp_path):
    exe = shutil.which("unickpt", path=os.path.dirname(sys.executable))
    assert exe is not None
    res = subprocess.run([exe, "ls", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0 and "no checkpoints" in res.stdout


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "missing")]) == 2  # 2: an error; 1 is for damage found (verify, diff)
    assert "is not a directory" in capsys.readouterr().err
    root = tmp_path / "run"
    unickpt.Checkpointer(root, async_save=False).save(1, {"w": torch.zeros(2)})
    assert main(["inspect", str(root)]) == 2
    assert "is a checkpoint root" in capsys.readouterr().err
    (root / "step_1" / "metadata.json").write_text('{"format": "unickpt", "format_version": 1}')
    assert main(["inspect", str(root / "step_1")]) == 2
    err = capsys.readouterr().err
    assert "malformed metadata" in err and "Traceback" not in err


def test_verify_reports_each_bad_chunk(tmp_path, capsys):
    path = tmp_path / "c"
    unickpt.save(path, {"a": torch.arange(1000.0), "b": torch.ones(5), "big": torch.zeros(3 << 18)})  # big: 3 blocks
    assert main(["verify", str(path)]) == 0
    assert "OK" in capsys.readouterr().out
    meta = json.load(open(path / "metadata.json"))
    data = path / "data" / "0_0.bin"
    raw = bytearray(data.read_bytes())
    for fqn, offset in (("a", 4), ("big", (1 << 20) + 7)):  # a's chunk; big's second block
        raw[meta["tensors"][fqn]["chunks"][0]["byte_offset"] + offset] ^= 0x40
    data.write_bytes(bytes(raw))
    assert main(["verify", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and sorted(p["key"] for p in report["problems"]) == ["a", "big"]
    assert "checksum" in report["problems"][0]["error"]
    data.write_bytes(bytes(raw[:100]))
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "truncated" in out and "[big]" in out


def test_diff_names_keys_dtypes_shapes_and_value_differences(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    w = torch.randn(4, 5)
    unickpt.save(a, {"model": {"w": w, "b": torch.zeros(3), "gone": torch.ones(1)}, "lr": 0.1, "h": torch.ones(2)})
    unickpt.save(b, {"model": {"w": w + 1e-3, "b": torch.zeros(3), "new": torch.ones(1)}, "lr": 0.2,
                     "h": torch.ones(2, dtype=torch.float64)})
    assert main(["diff", str(a), str(a)]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["diff", str(a), str(b), "--json"]) == 1
    got = {(d["key"], d["kind"]) for d in json.loads(capsys.readouterr().out)}
    assert got == {("model.gone", "missing_in_b"), ("model.new", "missing_in_a"), ("model.w", "values"),
                   ("h", "dtype"), ("lr", "object")}
    assert main(["diff", str(a), str(b), "--atol", "0.01"]) == 1
    out = capsys.readouterr().out
    assert "model.w" not in out and "lr" in out


def test_ls_of_a_checkpoint_and_inspect_of_one_without_step(tmp_path, capsys):
    unickpt.save(tmp_path / "c", {"w": torch.zeros(2)})
    assert main(["ls", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out == f"no checkpoints under {tmp_path / 'c'} (it is a checkpoint itself: see `unickpt inspect`)\n"
    assert main(["inspect", str(tmp_path / "c")]) == 0
    assert "unickpt v1   step -   framework -" in capsys.readouterr().out


def test_inspect_of_a_file_says_it_is_not_a_checkpoint_directory(tmp_path, capsys):
    f = tmp_path / "last.ckpt"
    f.write_bytes(b"not a directory")
    assert main(["inspect", str(f)]) == 2
    assert "is a file, not a checkpoint directory" in capsys.readouterr().err
