"""One owner of a checkpoint directory (issue 32): :class:`~unickpt.lifecycle.directory.CheckpointDir`
claims, commits, answers is-committed / is-incomplete / writer-alive, uncommits and removes; nothing
else in core or the plugins names its commit marker (``metadata.json``)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import uuid

import pytest

import unickpt
from unickpt import ext
from unickpt.errors import CheckpointNotFoundError
from unickpt.format.metadata import CheckpointMetadata
from unickpt.lifecycle.directory import CheckpointDir
from unickpt.storage import LocalStorage, open_storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _meta(step: int) -> CheckpointMetadata:
    return CheckpointMetadata(tensors={}, state_tree={"step": step, "name": "x"}, step=step, framework="test")


def _partial(storage, path: str) -> CheckpointDir:
    """A directory as a save leaves it before its commit: the writer record and one data file."""
    d = CheckpointDir(storage, path)
    storage.makedirs(storage.join(path, "data"))
    d.claim()
    storage.write_small(storage.join(path, "data", "0_0.bin"), b"\x01" * 16)
    return d


def test_commit_then_committed_and_read_back(tmp_path):
    storage = LocalStorage()
    d = _partial(storage, str(tmp_path / "step_3"))
    assert not d.is_committed() and d.is_incomplete()
    with pytest.raises(CheckpointNotFoundError):
        d.read_metadata()
    d.commit(_meta(3))
    assert d.is_committed() and d.is_unickpt() and not d.is_incomplete()
    meta = d.read_metadata()
    assert (meta.step, meta.framework, meta.state_tree) == (3, "test", {"step": 3, "name": "x"})
    assert json.loads(d.metadata_bytes())["step"] == 3
    assert d.files() == ["data/0_0.bin", "metadata.json"]  # the marker last; the writer record left out
    assert d.files(with_marker=False) == ["data/0_0.bin"]


def test_read_extra_is_the_metadata_extra_without_the_tensor_table(tmp_path):
    """The cheap read (DCP's commit of a generation asks only which generation it replaces)."""
    import torch

    path = str(tmp_path / "ck")
    unickpt.save(path, {f"w{i}": torch.full((3,), float(i)) for i in range(5)})
    d = CheckpointDir(LocalStorage(), path)
    full = d.read_metadata()
    assert d.read_extra() == full.extra
    meta = CheckpointMetadata(tensors={}, state_tree={}, step=1, framework="test", extra={"dcp": {"generation": "g/1"}})
    d.commit(meta)
    assert d.read_extra() == {"dcp": {"generation": "g/1"}}
    with pytest.raises(CheckpointNotFoundError, match="metadata.json is missing"):
        CheckpointDir(LocalStorage(), str(tmp_path / "none")).read_extra()
    doc = json.loads(d.metadata_bytes())
    doc["extra"] = ["not", "an", "object"]
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(doc, f)
    for read in (d.read_extra, d.read_metadata):  # the cheap read and the full one refuse it alike
        with pytest.raises(unickpt.errors.IntegrityError, match=r"metadata.json: malformed metadata \('extra' is a "
                                                                 r"list, expected an object\)"):
            read()
    doc["format"] = "other"
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(doc, f)
    with pytest.raises(unickpt.errors.FormatVersionError, match="format is 'other'"):
        d.read_extra()


def test_uncommit_leaves_an_incomplete_directory(tmp_path):
    storage = LocalStorage()
    d = _partial(storage, str(tmp_path / "c"))
    d.commit(_meta(1))
    d.uncommit()
    assert not d.is_committed() and d.is_incomplete()
    assert os.path.exists(tmp_path / "c" / "data" / "0_0.bin")
    with pytest.raises(FileNotFoundError):
        d.files()
    d.uncommit()  # a missing marker is fine


class _Recording(LocalStorage):
    """Local storage that records, at each ``rm``, which of the checkpoint's files still exist."""

    def __init__(self, marker: str, data: str) -> None:
        super().__init__()
        self.marker, self.data, self.seen = marker, data, []

    def rm(self, path: str) -> None:
        self.seen.append((os.path.basename(path), os.path.exists(self.marker), os.path.exists(self.data)))
        super().rm(path)


def test_remove_takes_the_marker_before_the_data(tmp_path):
    path = str(tmp_path / "step_1")
    storage = _Recording(os.path.join(path, "metadata.json"), os.path.join(path, "data", "0_0.bin"))
    d = _partial(storage, path)
    d.commit(_meta(1))
    d.remove()
    # first rm: the marker (both still there); second rm: the tree, when the marker is already gone
    assert storage.seen == [("metadata.json", True, True), ("step_1", False, True)]
    assert not os.path.exists(path)


def test_incomplete_is_only_what_a_save_writes(tmp_path):
    storage = LocalStorage()
    d = _partial(storage, str(tmp_path / "p"))
    assert d.is_incomplete()
    (tmp_path / "p" / "notes.txt").write_text("mine")
    assert not d.is_incomplete()  # something a save does not write: never replaced or removed
    assert not CheckpointDir(storage, str(tmp_path / "absent")).is_incomplete()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _record(path, pid: int) -> None:
    import socket
    import time

    (path / ".unickpt-writer").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "time": time.time()}))


def test_claim_and_writer_alive(tmp_path):
    storage = LocalStorage()
    mine = _partial(storage, str(tmp_path / "mine"))
    assert mine.writer_alive() and mine.writer_is_this_process() and not mine.writer_elsewhere_on_host()
    assert json.loads((tmp_path / "mine" / ".unickpt-writer").read_text())["pid"] == os.getpid()

    dead = _partial(storage, str(tmp_path / "dead"))
    _record(tmp_path / "dead", _dead_pid())
    assert not dead.writer_alive() and not dead.writer_is_this_process()
    assert dead.leftover_reason(older=False) == "incomplete (its writer is gone)"

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _partial(storage, str(tmp_path / "live"))
        _record(tmp_path / "live", other.pid)
        assert live.writer_alive() and live.writer_elsewhere_on_host()
        assert live.leftover_reason(older=True) is None  # a save in flight is no leftover
    finally:
        other.kill()
        other.wait()
    assert not live.writer_alive() and not live.writer_elsewhere_on_host()


def test_commit_over_fsspec_memory():
    path = f"memory://ckptdir-{uuid.uuid4().hex}/step_2"
    storage = open_storage(path)
    d = _partial(storage, path)
    d.commit(_meta(2))
    assert d.is_committed() and storage.exists(storage.join(path, "metadata.json"))
    assert d.read_metadata().step == 2
    assert d.files() == ["data/0_0.bin", "metadata.json"]
    d.remove()
    assert not storage.exists(path) and not d.is_committed()


class _LostReply(LocalStorage):
    """``write_atomic`` that raises after (``lands``) or instead of the replace."""

    def __init__(self, lands: bool) -> None:
        super().__init__()
        self.lands = lands

    def write_atomic(self, path: str, data: bytes) -> None:
        if self.lands:
            super().write_atomic(path, data)
        raise OSError(5, "reply lost")


def test_commit_whose_reply_is_lost(tmp_path):
    landed = _partial(_LostReply(lands=True), str(tmp_path / "a"))
    landed.commit(_meta(1))  # the file holds exactly this commit: it stands
    assert landed.is_committed() and landed.read_metadata().step == 1
    lost = _partial(_LostReply(lands=False), str(tmp_path / "b"))
    with pytest.raises(OSError, match="reply lost"):
        lost.commit(_meta(1))
    assert not lost.is_committed()


def test_a_saved_checkpoint_is_committed_and_ext_names_the_owner(tmp_path):
    import torch

    path = str(tmp_path / "ck")
    unickpt.save(path, {"w": torch.arange(6.0)})
    d = ext.CheckpointDir(open_storage(path), path)
    assert d.is_committed() and d.is_unickpt() and d.read_metadata().tensors["w"].shape == (6,)
    assert d.files()[-1] == "metadata.json" and "data" in {f.split("/")[0] for f in d.files()}


def _marker_literals(path: str) -> list[int]:
    tree = ast.parse(open(path).read(), path)
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and (n.value == "metadata.json" or n.value.endswith("/metadata.json"))]


def test_only_the_format_and_the_owner_name_the_commit_marker():
    allowed = {os.path.join(ROOT, "core", "lifecycle", "directory.py")}
    found = []
    for top in ("core", "plugins"):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            if dirpath.startswith(os.path.join(ROOT, "core", "format")):
                continue
            for f in files:
                p = os.path.join(dirpath, f)
                if f.endswith(".py") and p not in allowed:
                    found += [f"{os.path.relpath(p, ROOT)}:{line}" for line in _marker_literals(p)]
    assert found == []
    # and the check sees one
    assert _marker_literals(os.path.join(ROOT, "core", "format", "files.py"))
