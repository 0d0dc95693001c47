"""Storage failing under a save or a load (issue 29), through the fault-injecting backend
(:mod:`unickpt.testing.faults`): a listing that fails on one rank reaches every rank as the same
:class:`~unickpt.errors.StorageError`; storage that turns read-only in the middle of a save fails the
save, keeps the last checkpoint, and the failed attempt's files go with the next successful save.
(The fault x save-mode matrix is test_fault_matrix.py; single-process rules: tests/unit/test_leftovers.py.)"""
from __future__ import annotations

import errno
import os
import re

import pytest
import torch

import storage_fault_workers as w
import unickpt
from unickpt.testing import Fault, inject


def test_a_listing_failing_on_rank_0_raises_the_same_error_on_every_rank(pool, tmp_path):
    root = str(tmp_path / "run")
    pool(2).run(w.save_steps, root, [1, 2])
    results = pool(2).run(w.load_with_rank0_listing_failing, root)
    want = ("StorageError", f"cannot list {root!r}: [Errno 5] Input/output error (injected: list of {root}); "
            "refusing to read it as holding no checkpoint", errno.EIO, -1, False)
    assert [r["error"] for r in results] == [want, want]  # the state untouched on every rank
    assert [r["after"] for r in results] == [(2, True), (2, True)]


def test_storage_turning_read_only_mid_save_keeps_the_last_checkpoint(tmp_path):
    root = tmp_path / "run"
    ck = unickpt.Checkpointer(root, keep_last=2, async_save=False)
    ck.save(1, {"w": torch.arange(4096.0), "step": 1})
    # once the directory and its writer record exist, every write, replace, marker and removal fails
    ro = [Fault(op, match="*/step_2*", nth=None, errno=errno.EROFS) for op in ("write", "rename", "rm")]
    ro.append(Fault("marker", match="*/step_2/*", nth=2, errno=errno.EROFS))  # the 1st: the writer record
    with inject(*ro):
        with pytest.raises(unickpt.SaveFailedError, match=r"Read-only file system \(injected: write of .*step_2/data/0_0\.bin\)"):
            ck.save(2, {"w": torch.arange(4096.0) * 2, "step": 2})
    assert ro[0].fired >= 1 and ro[3].fired == 1  # neither the failed mark nor the removal (ro[2]) could be done
    assert ro[2].fired == 1
    assert (root / "step_2").is_dir() and not (root / "step_2" / "metadata.json").exists()
    assert (root / "latest").read_text() == "step_1"
    out = {"w": torch.zeros(4096), "step": -1}
    assert ck.load(out) == 1 and torch.equal(out["w"], torch.arange(4096.0)) and out["step"] == 1
    ck.save(3, {"w": torch.arange(4096.0) * 3, "step": 3})  # writable again: step 2's files go
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_3"]
    assert ck.load(out) == 3 and torch.equal(out["w"], torch.arange(4096.0) * 3)


def test_a_writer_dying_at_commit_leaves_a_failed_directory_that_prune_removes(tmp_path):
    """Rank 1 dies during step 2's save: rank 0 (alive, the writer of record) raises SaveFailedError,
    marks step 2's record failed (it cannot remove it: rank 1 might have been writing still), and
    ``unickpt prune`` removes it although its writer process lives on."""
    import json

    from unickpt.testing import DistPool

    root, report = str(tmp_path / "run"), tmp_path / "report.json"
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] died"):
        with DistPool(2, timeout_s=120) as pool:
            pool.run(w.die_during_step_2, root, str(report))
    got = json.loads(report.read_text())  # the pool lets survivors finish before it kills them
    assert got["error"].startswith("SaveFailedError:") and "lost contact with rank 1" in got["error"], got["error"]
    assert got["record_failed"] is True and got["record_pid_is_mine"] is True
    assert got["removed"] == [[2, "incomplete (failed save)"]] and got["left"] == ["latest", "step_1"]


def test_a_short_write_of_an_index_file_fails_the_save_on_every_rank(pool, tmp_path):
    root = str(tmp_path / "run")
    results = pool(2).run(w.short_index_write, root)
    assert [r["fired"] for r in results] == [0, 1]
    for r in results:
        assert r["error"] is not None and re.search(
            rf"{re.escape(root)}/step_2/index/1\.idx: (\d+) bytes were written, the file holds \d+ \(a short write\)",
            r["error"]), r["error"]
        assert r["step"] == 1 and r["equal"]
    assert sorted(os.listdir(root)) == ["latest", "step_1"]


def test_a_metadata_read_failing_on_one_rank_is_the_same_storage_error_on_every_rank(pool, tmp_path):
    root = str(tmp_path / "run")
    pool(2).run(w.save_steps, root, [1])
    a, b = pool(2).run(w.load_with_rank1_metadata_read_failing, root)
    why = (f"cannot read '{root}/step_1/metadata.json': [Errno 5] Input/output error (injected: read of "
           f"{root}/step_1/metadata.json)")
    assert b == [("StorageError", why), -1, False]
    assert a == [("StorageError", f"rank 1: {why}"), -1, False]
