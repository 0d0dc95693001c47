"""Storage through fsspec (the in-memory filesystem stands in for an object store here)."""
from __future__ import annotations

import os
import shutil

import fsspec
import fsspec.implementations.memory
import pytest
import torch

import unickpt


def test_fsspec_memory_round_trip_with_partial_reads():
    root = "memory://unickpt-test/run"
    ckpt = unickpt.Checkpointer(root, keep_last=1, async_save=True)
    w = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    ckpt.save(1, {"w": w, "meta": {"lr": 0.5}})
    ckpt.save(2, {"w": w * 2, "meta": {"lr": 0.25}}).wait()
    fs = fsspec.filesystem("memory")
    assert fs.cat_file("/unickpt-test/run/latest") == b"step_2"
    assert not fs.exists("/unickpt-test/run/step_1")  # retention through fsspec
    out = {"w": torch.zeros(6, 10), "meta": None}
    assert ckpt.load(out) == 2 and torch.equal(out["w"], w * 2) and out["meta"] == {"lr": 0.25}
    # a ranged read of two rows only
    part = torch.zeros(2, 10)
    stats = unickpt.load(f"{root}/step_2", {"w": unickpt.Shard(part, (6, 10), offsets=(3, 0))}, strict=False,
                         verify=False)
    assert torch.equal(part, (w * 2)[3:5]) and stats.bytes_read == 2 * 10 * 4
    fs.rm("/unickpt-test", recursive=True)


def test_missing_remote_checkpoint_is_clear():
    with pytest.raises(unickpt.CheckpointNotFoundError, match="metadata.json is missing"):
        unickpt.load("memory://nothing-here/step_1", {"w": torch.zeros(1)})


class _FlakyMemory(fsspec.implementations.memory.MemoryFileSystem):
    """In-memory store whose reads and writes fail transiently, ``fail_every``-th call each."""

    protocol = ("flakymem",)
    calls = 0
    fail_every = 3
    error: type = ConnectionResetError

    def _maybe_fail(self, what):
        type(self).calls += 1
        if self.fail_every and type(self).calls % self.fail_every == 0:
            raise self.error(f"injected {what} failure")

    def cat_file(self, path, start=None, end=None, **kw):
        self._maybe_fail("read")
        return super().cat_file(path, start=start, end=end, **kw)

    def pipe_file(self, path, value, **kw):
        self._maybe_fail("write")
        return super().pipe_file(path, value, **kw)

    def _open(self, path, mode="rb", **kw):
        if "w" in mode:
            self._maybe_fail("open")
        return super()._open(path, mode, **kw)


def test_transient_remote_errors_are_retried(caplog):
    fsspec.register_implementation("flakymem", _FlakyMemory, clobber=True)
    _FlakyMemory.fail_every, _FlakyMemory.error = 3, ConnectionResetError
    w = torch.randn(1000)
    with caplog.at_level("WARNING", logger="unickpt"):
        unickpt.save("flakymem://bucket/c", {"w": w, "n": 1})
        out = {"w": torch.zeros(1000), "n": 0}
        unickpt.load("flakymem://bucket/c", out)
    assert torch.equal(out["w"], w) and out["n"] == 1
    assert "retrying" in caplog.text and "injected" in caplog.text


def test_permanent_and_persistent_remote_errors_fail_clearly(monkeypatch):
    from unickpt.storage.remote import FsspecStorage

    fsspec.register_implementation("flakymem", _FlakyMemory, clobber=True)
    _FlakyMemory.fail_every, _FlakyMemory.error = 1, PermissionError
    st = FsspecStorage("flakymem://bucket2/x", retry_total_s=5)
    with pytest.raises(PermissionError):
        st.read_bytes("flakymem://bucket2/x")  # not retried: fails on the first call
    assert st.retries == 0
    _FlakyMemory.error = TimeoutError
    st = FsspecStorage("flakymem://bucket2/x", retry_total_s=0.5)
    with pytest.raises(TimeoutError):
        st.read_bytes("flakymem://bucket2/x")  # retried until the time budget is spent
    assert st.retries >= 2
    _FlakyMemory.fail_every = 0


def test_two_tier_save_uploads_and_load_prefers_the_local_copy(tmp_path):
    remote = "memory://unickpt-two-tier/run"
    fs = fsspec.filesystem("memory")
    ckpt = unickpt.Checkpointer(remote, local_root=tmp_path / "local", keep_last=2)
    for step in range(3):
        ckpt.save(step, {"w": torch.full((1000,), float(step)), "step": step})
    ckpt.wait()
    for listing in (sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/unickpt-two-tier/run", detail=False)),
                    sorted(os.listdir(tmp_path / "local"))):
        assert listing == ["latest", "step_1", "step_2"]
    assert fs.cat_file("/unickpt-two-tier/run/latest") == b"step_2"
    assert fs.exists("/unickpt-two-tier/run/step_2/metadata.json")
    out = {"w": torch.zeros(1000), "step": -1}
    fs.rm("/unickpt-two-tier/run/step_2/data", recursive=True)  # the local copy is preferred
    assert ckpt.load(out) == 2 and out["w"][0] == 2 and out["step"] == 2
    shutil.rmtree(tmp_path / "local" / "step_1")  # no local copy: the remote one is used
    assert ckpt.load(out, step=1) == 1 and out["w"][0] == 1
    fs.rm("/unickpt-two-tier", recursive=True)


def test_direct_write_truncates_padding_and_falls_back_when_unaligned(tmp_path):
    from unickpt.storage import DIRECT_ALIGN, open_storage

    storage = open_storage(str(tmp_path))
    payload = torch.randint(0, 256, (3 * DIRECT_ALIGN + 100,), dtype=torch.uint8)
    # an aligned buffer whose last block is padded up to the alignment, as the staging ring hands it over
    raw = torch.zeros(5 * DIRECT_ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % DIRECT_ALIGN
    buf = raw[skip: skip + 4 * DIRECT_ALIGN]
    buf[: payload.numel()] = payload
    buf[payload.numel():] = 7  # padding: must not reach the file
    view = memoryview(buf.numpy())
    path = str(tmp_path / "direct.bin")
    n = storage.write_file(path, [view[: 2 * DIRECT_ALIGN], view[2 * DIRECT_ALIGN:]], direct=True,
                           size=payload.numel())
    assert n == payload.numel()
    assert open(path, "rb").read() == payload.numpy().tobytes()
    # unaligned buffers (any bytes object): the file system refuses O_DIRECT, the write falls back to buffered
    odd = bytes(range(256)) * 33 + b"x"
    path2 = str(tmp_path / "fallback.bin")
    assert storage.write_file(path2, [odd[:4097], odd[4097:]], direct=True, size=len(odd)) == len(odd)
    assert open(path2, "rb").read() == odd
    with pytest.raises(ValueError, match="direct write needs the file's logical size"):
        storage.write_file(str(tmp_path / "x.bin"), [odd], direct=True)
