"""unickpt.lightning: a failed background save is never silent. The next save raises
``unickpt.EarlierSaveFailedError`` naming the checkpoint path and global step (when the failed save has
finished by then), ``wait()`` raises every failure not reported yet in one error, each once;
``on_error="warn"`` warns and counts. (Sharded-route saves go through the group engine's rule:
tests/distributed/test_save_errors_dist.py.)"""
from __future__ import annotations

import errno
import os
import time

import pytest
import torch

pytest.importorskip("lightning")

import unickpt  # noqa: E402
from unickpt.lightning import UnickptCheckpointIO  # noqa: E402
from unickpt.testing import Fault, inject  # noqa: E402
from test_lightning_dropin import ckpt, in_run  # noqa: E402,F401 - the fixture and the checkpoint dict


def _enospc() -> Fault:
    return Fault("write", match="*/data/*", nth=None, errno=errno.ENOSPC)


def _finished(io: UnickptCheckpointIO) -> None:
    deadline = time.monotonic() + 120
    while not io.last_handle.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_next_save_raises_a_finished_failure(tmp_path, in_run):
    io = UnickptCheckpointIO()
    with inject(_enospc()):
        io.save_checkpoint(ckpt(1, 1.0), tmp_path / "a.ckpt")
        _finished(io)
    with pytest.raises(unickpt.EarlierSaveFailedError) as info:
        io.save_checkpoint(ckpt(2, 2.0), tmp_path / "b.ckpt")
    err = info.value
    assert err.steps == [1] and err.path == str(tmp_path / "a.ckpt")
    assert str(err).startswith(f"1 earlier asynchronous save(s) failed: step 1 ({str(tmp_path / 'a.ckpt')!r})")
    assert isinstance(err.__cause__, unickpt.SaveFailedError) and "No space left on device" in str(err.__cause__)
    assert os.listdir(tmp_path) == []  # neither the failed save nor the refused one left a file
    assert io.failed_saves == 1 and io.last_error is err
    io.save_checkpoint(ckpt(2, 2.0), tmp_path / "b.ckpt")  # the following saves run; nothing raised twice
    io.wait()
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["state_dict"]["layer.bias"], torch.full((2,), 2.0))
    io.teardown()


def test_wait_raises_every_failure_once(tmp_path, in_run):
    io = UnickptCheckpointIO()
    hold = Fault("write", match="*/data/*", nth=None, action="hold", delay_s=60)
    with inject(hold, _enospc()):
        io.save_checkpoint(ckpt(1, 1.0), tmp_path / "a.ckpt")
        io.save_checkpoint(ckpt(2, 2.0), tmp_path / "b.ckpt")  # save 1 is held: nothing to report yet
        hold.release()
        with pytest.raises(unickpt.EarlierSaveFailedError) as info:
            io.wait()
    assert info.value.steps == [1, 2] and [e[1] for e in info.value.errors] == [str(tmp_path / "a.ckpt"),
                                                                               str(tmp_path / "b.ckpt")]
    assert io.failed_saves == 2
    io.wait()
    io.teardown()  # nothing left to raise


def test_on_error_warn_warns_and_goes_on(tmp_path, in_run):
    io = UnickptCheckpointIO(on_error="warn")
    with inject(_enospc()):
        io.save_checkpoint(ckpt(1, 1.0), tmp_path / "a.ckpt")
        _finished(io)
    with pytest.warns(RuntimeWarning, match=r"^unickpt.lightning: the asynchronous save of '.*a.ckpt' \(global step "
                      r"1\) failed \(OSError: \[Errno 28\] No space left on device .*\); on_error='warn'") as rec:
        io.save_checkpoint(ckpt(2, 2.0), tmp_path / "b.ckpt")
    assert len(rec) == 1 and io.failed_saves == 1 and io.last_error.steps == [1]
    io.wait()
    assert os.listdir(tmp_path) == ["b.ckpt"]
    io.teardown()
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'warn', got 'ignore'"):
        UnickptCheckpointIO(on_error="ignore")


def test_a_synchronous_save_raises_its_own_failure(tmp_path):
    io = UnickptCheckpointIO(async_save=False)
    with inject(_enospc()):
        with pytest.raises(unickpt.SaveFailedError, match="No space left on device") as info:
            io.save_checkpoint(ckpt(1, 1.0), tmp_path / "a.ckpt")
    assert not isinstance(info.value, unickpt.EarlierSaveFailedError)
    io.save_checkpoint(ckpt(2, 2.0), tmp_path / "a.ckpt")  # not raised again
    assert io.failed_saves == 0 and os.listdir(tmp_path) == ["a.ckpt"]


def test_a_failure_the_engine_finds_is_named_by_its_checkpoint_path(tmp_path, in_run, monkeypatch):
    """A save that finishes between the plugin's own check and the engine's is reported by the engine,
    still under its Lightning path (not the staging directory)."""
    io = UnickptCheckpointIO()
    with inject(_enospc()):
        io.save_checkpoint(ckpt(1, 1.0), tmp_path / "a.ckpt")
        _finished(io)
    monkeypatch.setattr(io, "_report_finished", lambda: None)  # as if it finished right after that check
    with pytest.raises(unickpt.EarlierSaveFailedError) as info:
        io.save_checkpoint(ckpt(2, 2.0), tmp_path / "b.ckpt")
    assert info.value.steps == [1] and info.value.path == str(tmp_path / "a.ckpt")
    assert "No space left on device" in str(info.value.__cause__) and io.failed_saves == 1
    assert os.listdir(tmp_path) == []
    io.wait()
    io.teardown()


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_a_failed_sharded_save_leaves_no_empty_checkpoint_directory(tmp_path, on_error):
    """Sharded route (ModelParallelStrategy, 2 processes), step 2's save fails on rank 1: the folder lists
    only checkpoints that exist (before, the failed step's ``P/`` and, raising, the refused next step's
    ``P/`` stayed as empty directories, and loading them failed)."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_sharded_failure.py")
    out = subprocess.run([sys.executable, script, str(tmp_path / "ckpt"), on_error], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    if on_error == "raise":
        want = [f"rank {r}: EarlierSaveFailedError ['epoch=0-step=1.ckpt']" for r in (0, 1)]
    else:
        want = [f"rank {r}: finished ['epoch=0-step=1.ckpt', 'epoch=0-step=3.ckpt', 'epoch=0-step=4.ckpt']"
                for r in (0, 1)]
    assert lines == want, out.stdout + out.stderr[-3000:]
