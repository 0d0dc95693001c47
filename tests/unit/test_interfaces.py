"""The seams of the restructured core: the plugin interface (unickpt.ext), per-call options and the
environment, and the fault-injecting storage backend."""
from __future__ import annotations

import errno
import os

import pytest
import torch

import unickpt
from unickpt import ext
from unickpt.testing import Fault, FaultyStorage, inject


def test_every_ext_name_resolves_and_ext_stays_narrow():
    """The plugin interface is at most 15 names (issue 32), each resolving."""
    assert len(ext.__all__) <= 15, ext.__all__
    for name in ext.__all__:
        assert getattr(ext, name) is not None, name


_ALL_NAMES_RESOLVE = r"""
import importlib, json, os, sys
import unickpt
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sys.argv[1]))))
mods = []
for top, prefix in (("core", "unickpt"), ("plugins", "unickpt")):
    for d, dirs, files in os.walk(os.path.join(root, top)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        rel = os.path.relpath(d, os.path.join(root, top)).replace(os.sep, ".")
        pkg = prefix if rel == "." else f"{prefix}.{rel}"
        mods += [pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}" for f in files
                 if f.endswith(".py") and f != "__main__.py"]
bad = []
for name in sorted(set(mods)):
    try:
        m = importlib.import_module(name)
        bad += [f"{name}.{n}" for n in getattr(m, "__all__", []) if not hasattr(m, n)]
    except Exception as e:
        bad.append(f"{name}: {type(e).__name__}: {e}")
print(json.dumps({"modules": len(set(mods)), "bad": bad}))
"""


def test_every_module_imports_and_every_name_in_its_all_resolves():
    """Every module of core/ and plugins/ imports, and every name its ``__all__`` lists (lazy ones
    included) resolves: a rename that leaves a lazy table or an ``__all__`` behind fails here, naming
    it (mypy cannot check those strings). In a subprocess: it imports every framework."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ALL_NAMES_RESOLVE, __file__], capture_output=True, text=True,
                         timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["modules"] > 130 and result["bad"] == [], result


def test_engine_handle_saves_loads_and_tracks_paths_in_flight(tmp_path):
    handle = ext.engine()
    assert (handle.rank, handle.world_size) == (0, 1)
    with inject(Fault("rename", match="*metadata.json", action="hold", delay_s=30)) as (gate,):
        h = handle.save(str(tmp_path / "c"), {"w": torch.arange(4.0)}, async_save=True, framework="test",
                        extra={"k": 1})
        assert handle.in_flight(str(tmp_path / "c")) and not h.done()
        gate.release()
        handle.wait()
    assert not handle.in_flight(str(tmp_path / "c"))
    meta = ext.CheckpointDir.open(str(tmp_path / "c")).read_metadata()
    assert meta.framework == "test" and meta.extra == {"k": 1}
    out = {"w": torch.zeros(4)}
    stats = handle.load(str(tmp_path / "c"), out)
    assert torch.equal(out["w"], torch.arange(4.0)) and stats.bytes_read == 16
    with pytest.raises(RuntimeError, match="only an engine made by new_engine"):
        handle.close()


def test_new_engine_is_private_and_closes(tmp_path):
    own = ext.new_engine(ext.THIS_PROCESS)
    own.save(str(tmp_path / "c"), {"w": torch.ones(3)}).wait()
    own.close()
    out = {"w": torch.zeros(3)}
    ext.load_solo(str(tmp_path / "c"), out)
    assert torch.equal(out["w"], torch.ones(3))


def test_flag_reads_a_boolean_switch(monkeypatch):
    monkeypatch.delenv("UNICKPT_TEST_FLAG", raising=False)
    assert ext.flag("UNICKPT_TEST_FLAG", True) is True and ext.flag("UNICKPT_TEST_FLAG", False) is False
    for value, want in (("0", False), ("off", False), ("No", False), ("1", True), ("yes", True), (" ", True)):
        monkeypatch.setenv("UNICKPT_TEST_FLAG", value)
        assert ext.flag("UNICKPT_TEST_FLAG", True) is want, value


def test_checkpoint_root_rules(tmp_path):
    root = ext.CheckpointRoot(str(tmp_path))
    for step in (1, 2, 3):
        unickpt.save(root.path(step), {"w": torch.full((2,), float(step))})
    os.makedirs(tmp_path / "step_01")  # not a name Checkpointer writes: ignored
    os.makedirs(tmp_path / "step_4" / "data")  # a crashed save
    assert root.list() == [(1, True), (2, True), (3, True), (4, False)]
    assert root.read_latest() is None
    root.retain(keep_last=2, newest=3, in_flight=lambda p: False)
    assert root.list() == [(2, True), (3, True), (4, False)] and root.read_latest() == "step_3"
    root.write_latest("step_2")
    root.update_latest()  # never left behind a newer commit
    assert root.read_latest() == "step_3"
    root.dir(3).remove()
    assert not root.dir(3).is_committed() and not os.path.exists(root.path(3))


# -- options ----------------------------------------------------------------------------------------
def test_options_are_validated_and_name_the_field():
    with pytest.raises(ValueError, match=r"snapshot must be one of \['sync', 'overlap'\], got 'later'"):
        unickpt.SaveOptions(snapshot="later").validated()
    with pytest.raises(ValueError, match=r"unknown save option\(s\) \['pool_size'\]"):
        unickpt.SaveOptions().with_(pool_size=1)
    with pytest.raises(ValueError, match="read_threads must be at least 1, got 0"):
        unickpt.LoadOptions(read_threads=0).validated()
    with pytest.raises(ValueError, match=r"unknown load option\(s\) \['threads'\]"):
        unickpt.LoadOptions().with_(threads=2)


def test_environment_gives_defaults_and_calls_override_them():
    from unickpt.options import Env

    env = Env.read({"UNICKPT_POOL_BYTES": "67108864", "UNICKPT_LOAD_REDISTRIBUTE": "1",
                    "UNICKPT_READ_THREADS": "7", "UNICKPT_CHECK_REPLICAS": "off"})
    assert (env.pool_bytes, env.load_redistribute, env.read_threads, env.check_replicas) == (64 << 20, True, 7, "off")
    assert Env.read({}) == Env()
    with pytest.raises(ValueError, match="UNICKPT_READ_THREADS='many' is not a valid int"):
        Env.read({"UNICKPT_READ_THREADS": "many"})
    opts = unickpt.LoadOptions(read_threads=2).validated()
    assert opts.read_threads == 2 and opts.read_buffer_bytes == 512 << 20 and opts.verify is True


def test_options_per_save_and_per_load(tmp_path):
    w = torch.arange(1 << 21, dtype=torch.float32)  # 8 MiB through a 4 MiB ring
    h = unickpt.save(tmp_path / "c", {"w": w},
                     options=unickpt.SaveOptions(pool_bytes=4 << 20, piece_bytes=1 << 20, segment_bytes=100_000))
    assert h.stats.pool_capacity == 4 << 20 and h.stats.streamed
    assert sorted(os.listdir(tmp_path / "c" / "data")) == ["0_0.bin"]  # one chunk: a file of its own
    assert ext.engine().options.pool_bytes != 4 << 20  # the engine's defaults are untouched
    out = {"w": torch.zeros(1 << 21)}
    stats = unickpt.load(tmp_path / "c", out, options=unickpt.LoadOptions(verify=False))
    assert torch.equal(out["w"], w) and stats.blocks_verified == 0 and stats.bytes_read == 8 << 20
    stats = unickpt.load(tmp_path / "c", out, options=unickpt.LoadOptions(redistribute=False))
    assert stats.blocks_verified == 8 and not stats.redistributed  # the default verifies: 8 blocks of 1 MiB


# -- fault injection -----------------------------------------------------------------------------------
def test_faults_fail_the_nth_matching_operation_only(tmp_path):
    with inject(Fault("write", match="*.bin", nth=2, errno=errno.ENOSPC)) as (fault,):
        unickpt.save(tmp_path / "a", {"w": torch.ones(4)})  # the first data file: fine
        with pytest.raises(unickpt.SaveFailedError, match=r"(?s)No space left on device \(injected: write of .*b/data/0_0.bin\)"):
            unickpt.save(tmp_path / "b", {"w": torch.ones(4)})
        unickpt.save(tmp_path / "c", {"w": torch.ones(4)})  # the third: fine again
    assert (fault.seen, fault.fired) == (3, 1)
    assert not (tmp_path / "b" / "metadata.json").exists() and (tmp_path / "c" / "metadata.json").exists()


def test_a_lying_disk_is_caught_before_the_commit_and_at_load(tmp_path):
    w = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: one chunk, one checksum
    with inject(Fault("write", match="*.bin", action="truncate", keep=0.5)):
        with pytest.raises(unickpt.SaveFailedError, match="1048576 bytes were written, the file holds 524288"):
            unickpt.save(tmp_path / "c", {"w": w})  # the write "succeeds": half the bytes are on disk
    assert not (tmp_path / "c" / "metadata.json").exists()
    unickpt.save(tmp_path / "c", {"w": w})
    os.truncate(tmp_path / "c" / "data" / "0_0.bin", (1 << 20) // 2)  # cut after the commit
    with pytest.raises(unickpt.IntegrityError, match="truncated checkpoint file"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(1 << 18)})


def test_fsync_and_commit_faults(tmp_path):
    with inject(Fault("fsync", match="*.bin")):
        with pytest.raises(unickpt.SaveFailedError, match=r"(?s)write stage: .*injected: fsync of"):
            unickpt.save(tmp_path / "a", {"w": torch.ones(4)})
    assert not (tmp_path / "a").exists()  # the failed attempt's files are removed at once
    with inject(Fault("rename", match="*metadata.json")):
        with pytest.raises(unickpt.SaveFailedError, match=r"(?s)commit stage: .*injected: rename of .*b/metadata.json"):
            unickpt.save(tmp_path / "b", {"w": torch.ones(4)})
    assert not (tmp_path / "b").exists()
    unickpt.save(tmp_path / "b", {"w": torch.ones(4)})


def test_faulty_storage_delegates_everything_else(tmp_path):
    from unickpt.storage import open_storage

    inner = open_storage(str(tmp_path))
    st = FaultyStorage(inner, [Fault("read", match="*x.bin", action="slow", delay_s=0.0, nth=None)])
    assert st.is_local and st.join("a", "b") == os.path.join("a", "b")
    st.write_file(str(tmp_path / "x.bin"), [b"hello"])
    buf = bytearray(3)
    st.read_into(str(tmp_path / "x.bin"), [(1, 3)], memoryview(buf), base=1)
    assert bytes(buf) == b"ell" and st.bytes_read == 3 and st.faults[0].seen == 1
    with pytest.raises(ValueError, match="op must be one of"):
        Fault("unlink")


def test_option_types_are_checked_and_named():
    with pytest.raises(TypeError, match="SaveOptions.pool_bytes must be int or None, got str '1G'"):
        unickpt.SaveOptions(pool_bytes="1G").validated()
    with pytest.raises(TypeError, match="SaveOptions.piece_bytes must be int, got float 1048576.0"):
        unickpt.SaveOptions(piece_bytes=float(1 << 20)).validated()
    with pytest.raises(TypeError, match="SaveOptions.direct_io must be bool, got str 'no'"):
        unickpt.SaveOptions(direct_io="no").validated()
    with pytest.raises(TypeError, match="LoadOptions.redistribute must be bool or None, got str 'no'"):
        unickpt.LoadOptions(redistribute="no").validated()
    with pytest.raises(TypeError, match=r"load\(options=...\) takes a unickpt.LoadOptions, got SaveOptions"):
        unickpt.load("/nonexistent", {}, options=unickpt.SaveOptions())


def test_retention_keeps_a_committed_checkpoint_holding_user_files(tmp_path, caplog):
    ckpt = unickpt.Checkpointer(tmp_path, keep_last=1)
    ckpt.save(0, {"w": torch.ones(2)}).wait()
    (tmp_path / "step_0" / "NOTES.txt").write_text("mine")
    with caplog.at_level("WARNING", logger="unickpt"):
        ckpt.save(1, {"w": torch.ones(2)}).wait()
        ckpt.save(2, {"w": torch.ones(2)}).wait()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_0", "step_2"]  # step_1 went, step_0 is kept
    assert (tmp_path / "step_0" / "NOTES.txt").read_text() == "mine"
    assert "retention keeps" in caplog.text and "holds 'NOTES.txt', which no unickpt save writes" in caplog.text


def test_a_closed_engine_says_so(tmp_path):
    own = ext.new_engine(ext.THIS_PROCESS)
    own.close()
    with pytest.raises(RuntimeError, match="this engine is closed"):
        own.save(str(tmp_path / "c"), {"w": torch.ones(1)})


def test_a_checksum_error_names_the_key(tmp_path):
    unickpt.save(tmp_path / "c", {"layer.weight": torch.arange(1000.0)})
    data = tmp_path / "c" / "data" / "0_0.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(unickpt.IntegrityError, match=r"0_0.bin \('layer.weight'\): bytes \[0, 4000\) .* corrupt"):
        unickpt.load(tmp_path / "c", {"layer.weight": torch.zeros(1000)})


def test_save_failed_error_says_when_the_commit_is_unknown():
    e = unickpt.SaveFailedError("/ckpt/step_1", {1: "lost contact with rank 0"}, committed=None)
    assert str(e).startswith("save to '/ckpt/step_1' failed on rank(s) [1]; whether it committed is unknown")
    assert str(unickpt.SaveFailedError("/x", {0: "boom"})).startswith("save to '/x' failed on rank(s) [0]; "
                                                                       "nothing was committed")
