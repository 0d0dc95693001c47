"""Issue 29: leftovers of failed saves, listing errors, short writes (one process; the multi-rank and
read-only cases: tests/faults/test_storage_faults.py).

- a failed save's directory is removed at once, or, when that fails, by the next successful save of
  the same process, whatever its step (also one newer than the newest commit), never while a save
  into it is in flight;
- ``unickpt prune`` removes uncommitted leftovers whose writer is gone or recorded as failed,
  whatever their step; one without a writer record only when older than the newest commit;
- a listing or metadata read that fails is a :class:`~unickpt.errors.StorageError`, never "no checkpoint";
- a short write (a disk that keeps fewer bytes than it reports) fails the save before the commit; a
  truncated data file is refused on load, naming the file, the length needed and the length found.
"""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import unickpt
from unickpt.errors import IntegrityError, SaveFailedError, StorageError
from unickpt.testing import Fault, inject
from unickpt.tools.cli import main

N = 4096  # elements per test tensor: 16 KiB, one data file per save


def value(step: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(step))


def state(step: int) -> dict:
    return {"w": value(step), "step": step}


def loaded(load) -> dict:
    out = {"w": torch.zeros(N), "step": -1}
    load(out)
    return out


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def record(path, **fields) -> None:
    import socket
    import time

    rec = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), **fields}
    os.makedirs(path / "data", exist_ok=True)
    (path / "data" / "0_0.bin").write_bytes(b"partial")
    (path / ".unickpt-writer").write_text(json.dumps(rec))


# -- (1) a failed save's directory goes at once, else with the next successful save -------------------
def test_a_failed_save_is_removed_at_once(tmp_path):
    root = tmp_path / "run"
    ck = unickpt.Checkpointer(root, keep_last=3, async_save=False)
    ck.save(1, state(1))
    with inject(Fault("write", match="*/step_2/data/*", errno=errno.ENOSPC)) as (f,):
        with pytest.raises(SaveFailedError, match="No space left on device"):
            ck.save(2, state(2))
    assert f.fired == 1 and sorted(os.listdir(root)) == ["latest", "step_1"]
    with inject(Fault("write", match="*/a/data/*", errno=errno.EIO)):  # a plain save alike
        with pytest.raises(SaveFailedError, match="Input/output error"):
            unickpt.save(tmp_path / "a", state(1))
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_failed_step_that_could_not_be_removed_goes_with_the_next_commit_also_when_newer(tmp_path):
    """The disk fills during step 2's (and step 9's) save and the removal fails too; step 3 commits
    once the disk has room: both failed attempts go, step 9 although newer than every commit."""
    root = tmp_path / "run"
    ck = unickpt.Checkpointer(root, keep_last=3, async_save=False)
    ck.save(1, state(1))
    for failed in (2, 9):
        faults = [Fault("write", match=f"*/step_{failed}/data/*", errno=errno.ENOSPC),
                  Fault("rm", match=f"*/step_{failed}", nth=None, errno=errno.EBUSY)]
        with inject(*faults):
            with pytest.raises(SaveFailedError, match="No space left on device"):
                ck.save(failed, state(failed))
        assert faults[1].fired == 1 and (root / f"step_{failed}" / "data").is_dir()
        assert json.loads((root / f"step_{failed}" / ".unickpt-writer").read_text())["failed"] is True
    ck.save(3, state(3))
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_3"]
    assert (root / "latest").read_text() == "step_3"
    got = loaded(ck.load)
    assert got["step"] == 3 and torch.equal(got["w"], value(3))


def test_a_retry_in_flight_into_a_failed_path_is_never_removed(tmp_path):
    """Step 5 fails; its retry is in flight (held) while another save commits: the retry's directory
    stays, and the retry commits."""
    with inject(Fault("write", match="*/s5/data/*", errno=errno.EIO),
                Fault("rm", match="*/s5", nth=None, errno=errno.EROFS)):
        with pytest.raises(SaveFailedError):
            unickpt.save(tmp_path / "s5", state(5))
    assert (tmp_path / "s5" / "data").is_dir()  # left: removed after the next commit, unless retried by then
    hold = Fault("write", match="*/s6/data/*", action="hold", delay_s=60)
    with inject(hold):
        other = unickpt.save(tmp_path / "s6", state(6), async_save=True)  # drains held: commits after the retry starts
        retry = unickpt.save(tmp_path / "s5", state(5), async_save=True)
        hold.release()
        other.wait()
        retry.wait()
    for step in (5, 6):
        got = loaded(lambda s: unickpt.load(tmp_path / f"s{step}", s))
        assert got["step"] == step and torch.equal(got["w"], value(step))


# -- (2) prune ------------------------------------------------------------------------------------------
def test_prune_removes_failed_and_dead_leftovers_whatever_their_step(tmp_path, capsys):
    root = tmp_path / "run"
    ck = unickpt.Checkpointer(root, async_save=False)
    for s in (2, 3):
        ck.save(s, state(s))
    with inject(Fault("write", match="*/step_7/data/*", errno=errno.ENOSPC),
                Fault("rm", match="*/step_7", nth=None, errno=errno.EROFS)):
        with pytest.raises(SaveFailedError):
            ck.save(7, state(7))  # failed and left (not removable then); its writer lives, its record says failed
    record(root / "step_9", pid=dead_pid())  # a writer that is gone
    record(root / "step_8")  # a save in flight (this process, alive, not failed): kept
    record(root / "step_1")  # the same, older than the newest commit: kept, and prune says why
    os.makedirs(root / "step_6" / "data")  # no writer record, newer than every commit: maybe in flight, kept
    os.makedirs(root / "step_0" / "data")  # no writer record, older than the newest commit: a crash leftover
    assert main(["prune", str(root), "--keep-last", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"removed {root / 'step_0'} (incomplete (crashed save))",
                                f"removed {root / 'step_7'} (incomplete (failed save))",
                                f"removed {root / 'step_9'} (incomplete (its writer is gone))"]
    assert err == f"unickpt prune: kept {str(root / 'step_1')!r} is being written by a live process " \
                  f"(see its .unickpt-writer); not removing it\n"
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_2", "step_3", "step_6", "step_8"]
    assert (root / "latest").read_text() == "step_3"
    got = loaded(ck.load)
    assert got["step"] == 3 and torch.equal(got["w"], value(3))


def test_prune_removes_dead_leftovers_when_nothing_is_committed(tmp_path, capsys):
    root = tmp_path / "run"
    record(root / "step_3", pid=dead_pid())
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert capsys.readouterr().out == f"removed {root / 'step_3'} (incomplete (its writer is gone))\n"
    assert os.listdir(root) == []


# -- (3) listing and metadata reads that fail -----------------------------------------------------------
def test_a_failing_listing_is_an_error_never_no_checkpoint(tmp_path):
    root = tmp_path / "run"
    unickpt.Checkpointer(root, async_save=False).save(1, state(1))
    with inject(Fault("list", nth=None, errno=errno.EIO)) as (f,):
        ck = unickpt.Checkpointer(root)
        out = {"w": torch.zeros(N), "step": -1}
        with pytest.raises(StorageError) as err:
            ck.load(out)
        assert str(err.value) == f"cannot list {str(root)!r}: [Errno 5] Input/output error (injected: list of {root}); " \
                                 "refusing to read it as holding no checkpoint"
        assert isinstance(err.value, OSError) and err.value.errno == errno.EIO and err.value.path == str(root)
        assert f.fired >= 1 and out["step"] == -1 and not out["w"].any()  # the state is untouched
        with pytest.raises(StorageError):
            unickpt.list_checkpoints(str(root))
        assert main(["prune", str(root), "--keep-last", "1"]) == 2


def test_a_failing_metadata_stat_is_an_error_never_uncommitted(tmp_path):
    """``metadata.json`` that cannot be looked at (a symlink loop: ELOOP) is not "uncommitted": the
    newest step is unknown, so latest_step() raises instead of naming the step before it."""
    root = tmp_path / "run"
    ck = unickpt.Checkpointer(root, async_save=False)
    for s in (1, 2):
        ck.save(s, state(s))
    meta = root / "step_2" / "metadata.json"
    meta.unlink()
    os.symlink(meta.name, meta)  # points to itself
    with pytest.raises(StorageError, match=r"cannot tell whether .*step_2.* is committed: \[Errno 40\]"):
        ck.latest_step()
    with inject(Fault("stat", match="*/step_1/metadata.json", errno=errno.EIO)):
        with pytest.raises(StorageError, match="Input/output error"):
            unickpt.list_checkpoints(str(root))


def test_listing_a_missing_root_is_still_empty(tmp_path):
    assert unickpt.list_checkpoints(str(tmp_path / "none")) == []
    assert unickpt.Checkpointer(tmp_path / "none").load({"w": torch.zeros(N)}) is None


# -- (4) short writes and truncated files --------------------------------------------------------------
def test_a_short_write_fails_the_save_before_the_commit(tmp_path):
    root = tmp_path / "run"
    ck = unickpt.Checkpointer(root, async_save=False)
    ck.save(1, state(1))
    with inject(Fault("write", match="*/step_2/data/*", action="truncate", keep=0.5)) as (f,):
        with pytest.raises(SaveFailedError) as err:
            ck.save(2, state(2))
    assert f.fired == 1
    path = root / "step_2" / "data" / "0_0.bin"
    assert f"{path}: {N * 4} bytes were written, the file holds {N * 2} (a short write)" in str(err.value)
    assert not (root / "step_2" / "metadata.json").exists() and (root / "latest").read_text() == "step_1"
    got = loaded(ck.load)
    assert got["step"] == 1 and torch.equal(got["w"], value(1))


def test_a_short_write_of_the_per_rank_object_file_fails_the_save_and_keeps_the_last(tmp_path):
    """objects/rank_<r>.json (RNGState, PerRank) is checked as the data files are: a lying disk that kept
    half of it fails the save, so retention (keep_last=1) never trades the last good step for it."""
    root = tmp_path / "run"
    per_rank = lambda v: {**state(v), "d": unickpt.PerRank({"v": v})}  # noqa: E731
    ck = unickpt.Checkpointer(root, keep_last=1, async_save=False)
    ck.save(1, per_rank(1))
    with inject(Fault("write", match="*/step_2/objects/*", action="truncate", keep=0.5)) as (f,):
        with pytest.raises(SaveFailedError) as err:
            ck.save(2, per_rank(2))
    assert f.fired == 1
    assert re.search(rf"{re.escape(str(root / 'step_2' / 'objects' / 'rank_0.json'))}: (\d+) bytes were written, "
                     r"the file holds \d+ \(a short write\)", str(err.value)), str(err.value)
    assert (root / "latest").read_text() == "step_1" and not (root / "step_2").exists()
    out = {**state(0), "d": unickpt.PerRank({"v": None})}
    out["w"], out["step"] = torch.zeros(N), -1
    assert ck.load(out) == 1 and out["d"].value == {"v": 1} and torch.equal(out["w"], value(1))


def test_a_truncated_per_rank_object_file_is_an_integrity_error(tmp_path):
    unickpt.save(tmp_path / "c", {**state(3), "d": unickpt.PerRank({"v": 3})})
    objects = tmp_path / "c" / "objects" / "rank_0.json"
    os.truncate(objects, 6)
    with pytest.raises(IntegrityError, match=r"the per-rank state file 'objects/rank_0.json' of rank 0 is damaged "
                       r"or truncated \(6 bytes\)"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(N), "step": -1, "d": unickpt.PerRank({"v": None})})


@pytest.mark.parametrize("verify", [True, False])
def test_a_truncated_data_file_is_refused_on_load(tmp_path, verify):
    unickpt.save(tmp_path / "c", state(3))
    data = tmp_path / "c" / "data" / "0_0.bin"
    size = data.stat().st_size
    os.truncate(data, size - 100)
    out = {"w": torch.zeros(N), "step": -1}
    with pytest.raises(IntegrityError) as err:
        unickpt.load(tmp_path / "c", out, options=unickpt.LoadOptions(verify=verify))
    assert f"{data}: the file holds {size - 100} bytes, the checkpoint needs {N * 4} (the file is truncated)" \
        in str(err.value)


def test_a_failed_two_tier_save_leaves_no_copy_in_either_tier(tmp_path):
    """The upload of step 2 fails (a short write on the remote copy): neither the local directory nor
    the remote one stays; step 3 commits in both."""
    import fsspec

    remote, fs = "memory://unickpt-leftovers/run", fsspec.filesystem("memory")
    ck = unickpt.Checkpointer(remote, local_root=tmp_path / "local", async_save=False)
    ck.save(1, state(1))
    with inject(Fault("write", match="memory://*/step_2/data/*", action="truncate", keep=0.5)) as (f,):
        with pytest.raises(SaveFailedError, match="16384 bytes were uploaded, the store holds 8192"):
            ck.save(2, state(2))
    assert f.fired == 1
    ck.save(3, state(3))
    listing = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/unickpt-leftovers/run", detail=False))
    assert listing == ["latest", "step_1", "step_3"] and sorted(os.listdir(tmp_path / "local")) == listing
    got = loaded(ck.load)
    assert got["step"] == 3 and torch.equal(got["w"], value(3))
    fs.rm("/unickpt-leftovers", recursive=True)


def test_a_failed_writer_record_leaves_no_directory(tmp_path):
    """The writer record is the save's first write: when it fails the directory just made is nobody's
    (prune would keep it as a save that may be in flight): it is removed at once."""
    root = tmp_path / "run"
    ck = unickpt.Checkpointer(root, async_save=False)
    ck.save(1, state(1))
    with inject(Fault("marker", match="*/step_2/*", errno=errno.EIO)) as (f,):
        with pytest.raises(SaveFailedError, match=r"Input/output error \(injected: marker of .*step_2/\.unickpt-writer\)"):
            ck.save(2, state(2))
    assert f.fired == 1 and sorted(os.listdir(root)) == ["latest", "step_1"]
    ck.save(2, state(2))
    assert [s for s, ok in unickpt.list_checkpoints(str(root)) if ok] == [1, 2]


def test_an_error_reported_after_the_commit_took_effect_is_no_failure(tmp_path, caplog):
    """The replace of metadata.json took effect, then the storage reported EIO: a load and a listing see
    the checkpoint, so the save is committed (a warning), never a SaveFailedError beside a loadable step."""
    import logging

    root = tmp_path / "run"
    ck = unickpt.Checkpointer(root, async_save=False)
    ck.save(1, state(1))
    with inject(Fault("rename", match="*/step_2/metadata.json", errno=errno.EIO, after=True)) as (f,):
        with caplog.at_level(logging.WARNING, logger="unickpt"):
            ck.save(2, state(2))
    assert f.fired == 1 and (root / "latest").read_text() == "step_2"
    assert "reported an error writing" in caplog.text and "the save is committed" in caplog.text
    got = loaded(ck.load)
    assert got["step"] == 2 and torch.equal(got["w"], value(2))
