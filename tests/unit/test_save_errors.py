"""A failed asynchronous save is never silent (one process): the next ``save()``, ``wait()`` or
``close()`` raises ``EarlierSaveFailedError`` naming the failed step(s), once, or warns and counts with
``on_error="warn"``; a failure never stops the following saves. Two ranks:
tests/distributed/test_save_errors_dist.py."""
from __future__ import annotations

import errno
import time

import pytest
import torch

import unickpt
from unickpt import Checkpointer
from unickpt.testing import Fault, inject


def _state(step: int) -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32) + step, "step": step}


def _enospc(*steps: int) -> Fault:
    """Every data-file write of the given steps fails with ENOSPC."""
    pattern = "*step_[" + "".join(map(str, steps)) + "]/data/*"
    return Fault("write", match=pattern, nth=None, errno=errno.ENOSPC)


def _finished(handle, timeout_s: float = 120.0) -> None:
    """Wait until ``handle``'s save has finished without asking for its outcome."""
    deadline = time.monotonic() + timeout_s
    while not handle.done():
        assert time.monotonic() < deadline, "the save did not finish"
        time.sleep(0.01)


def _loads_bitwise(ckpt: Checkpointer, step: int) -> None:
    out = {"w": torch.zeros(1000), "step": -1}
    assert ckpt.load(out, step) == step
    assert torch.equal(out["w"], _state(step)["w"]) and out["step"] == step


def test_next_save_raises_a_finished_failure_and_saves_nothing(tmp_path):
    root = tmp_path / "run"
    ckpt = Checkpointer(root)
    with inject(_enospc(1)):
        h1 = ckpt.save(1, _state(1))
        _finished(h1)
    with pytest.raises(unickpt.EarlierSaveFailedError) as info:
        ckpt.save(2, _state(2))
    err = info.value
    assert isinstance(err, unickpt.SaveFailedError) and err.steps == [1] and err.path == str(root / "step_1")
    assert str(err).startswith(f"1 earlier asynchronous save(s) failed: step 1 ({str(root / 'step_1')!r})")
    assert "No space left on device" in str(err)
    assert isinstance(err.__cause__, unickpt.SaveFailedError) and err.__cause__ is err.errors[0][2]
    assert "rank(s) [0]" in str(err.__cause__) and "No space left on device" in str(err.__cause__)
    assert not (root / "step_2").exists()  # the call that raised started no save
    assert ckpt.failed_saves == 1 and ckpt.last_error is not None and ckpt.last_error.steps == [1]
    # raised once: the following saves run, and nothing is raised again
    ckpt.save(2, _state(2))
    ckpt.save(3, _state(3))
    ckpt.wait()
    ckpt.close()
    _loads_bitwise(Checkpointer(root), 3)
    assert [s for s, ok in unickpt.list_checkpoints(str(root)) if ok] == [2, 3]


def test_a_failure_still_running_at_the_next_save_is_raised_by_wait(tmp_path):
    root = tmp_path / "run"
    ckpt = Checkpointer(root)
    hold = Fault("write", match="*step_1/data/*", action="hold")
    with inject(hold, _enospc(1)):
        ckpt.save(1, _state(1))
        while not hold.seen:  # save 1 is writing (held)
            time.sleep(0.01)
        ckpt.save(2, _state(2))  # save 1 has not finished: nothing to raise yet
        hold.release()
        with pytest.raises(unickpt.EarlierSaveFailedError) as info:
            ckpt.wait()
    assert info.value.steps == [1] and "No space left on device" in str(info.value.__cause__)
    ckpt.wait()  # raised once
    ckpt.close()
    _loads_bitwise(Checkpointer(root), 2)


def test_several_failures_are_raised_together_by_close(tmp_path):
    root = tmp_path / "run"
    ckpt = Checkpointer(root)
    with inject(_enospc(1, 2)):
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        with pytest.raises(unickpt.EarlierSaveFailedError) as info:
            ckpt.close()
    err = info.value
    assert err.steps == [1, 2] and [e[1] for e in err.errors] == [str(root / "step_1"), str(root / "step_2")]
    assert str(err).splitlines()[0] == (f"2 earlier asynchronous save(s) failed: step 1 ({str(root / 'step_1')!r}), "
                                        f"step 2 ({str(root / 'step_2')!r})")
    assert err.__cause__ is err.errors[0][2] and all(isinstance(e, unickpt.SaveFailedError) for _, _, e in err.errors)
    assert sorted(err.failures) == [0] and "step 1: " in err.failures[0] and "step 2: " in err.failures[0]
    assert ckpt.failed_saves == 2
    ckpt.close()  # closed: nothing left


def test_on_error_warn_warns_counts_and_goes_on(tmp_path):
    root = tmp_path / "run"
    ckpt = Checkpointer(root, on_error="warn")
    with inject(_enospc(1, 3)):
        _finished(ckpt.save(1, _state(1)))
        expected = (r"^unickpt: the asynchronous save of step 1 \('.*/run/step_1'\) failed \(OSError: \[Errno 28\] "
                    r"No space left on device \(injected: write of .*step_1/data/0_0.bin\)\); on_error='warn': "
                    r"training goes on$")
        with pytest.warns(RuntimeWarning, match=expected) as rec:
            ckpt.save(2, _state(2))
        assert len(rec) == 1
        assert ckpt.failed_saves == 1 and isinstance(ckpt.last_error, unickpt.EarlierSaveFailedError)
        assert ckpt.last_error.steps == [1] and "No space left on device" in str(ckpt.last_error.__cause__)
        ckpt.save(3, _state(3))
        with pytest.warns(RuntimeWarning, match=r"^unickpt: the asynchronous save of step 3 \(") as rec:
            ckpt.close()
        assert len(rec) == 1
    assert ckpt.failed_saves == 2 and ckpt.last_error.steps == [3]
    _loads_bitwise(Checkpointer(root), 2)
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'warn', got 'ignore'"):
        Checkpointer(root, on_error="ignore")


def test_a_synchronous_save_reports_an_earlier_failure_found_after_its_commit(tmp_path):
    root = tmp_path / "run"
    ckpt = Checkpointer(root)
    hold = Fault("write", match="*step_1/data/*", action="hold")
    with inject(hold, _enospc(1)):
        ckpt.save(1, _state(1))
        while not hold.seen:
            time.sleep(0.01)
        threading_release(hold, after_s=0.2)
        with pytest.raises(unickpt.EarlierSaveFailedError) as info:
            ckpt.save(2, _state(2), async_save=False)  # runs (save 1 was running), commits, then reports 1
    assert info.value.steps == [1]
    _loads_bitwise(ckpt, 2)
    ckpt.close()


def threading_release(fault: Fault, after_s: float) -> None:
    import threading

    threading.Timer(after_s, fault.release).start()


def test_unickpt_save_names_the_path(tmp_path):
    with inject(Fault("write", match="*a/data/*", nth=None, errno=errno.ENOSPC)):
        _finished(unickpt.save(tmp_path / "a", _state(1), async_save=True))
    with pytest.raises(unickpt.EarlierSaveFailedError) as info:
        unickpt.save(tmp_path / "b", _state(2), async_save=True)
    assert info.value.steps == [None] and str(info.value).startswith(
        f"1 earlier asynchronous save(s) failed: the save to {str(tmp_path / 'a')!r}")
    unickpt.save(tmp_path / "b", _state(2), async_save=True).wait()
    out = {"w": torch.zeros(1000), "step": -1}
    unickpt.load(tmp_path / "b", out)
    assert torch.equal(out["w"], _state(2)["w"])


def test_a_failure_the_handle_raised_is_not_raised_again(tmp_path):
    ckpt = Checkpointer(tmp_path / "run")
    with inject(_enospc(1)):
        h1 = ckpt.save(1, _state(1))
        with pytest.raises(unickpt.SaveFailedError, match="No space left on device") as info:
            h1.wait()
    assert not isinstance(info.value, unickpt.EarlierSaveFailedError)
    ckpt.save(2, _state(2))
    ckpt.close()
    assert ckpt.failed_saves == 0


def test_a_preemption_save_runs_despite_an_earlier_failure(tmp_path):
    """With memory tiers, a preemption notice saves the step persistently even when an earlier
    persistent save failed; that failure is raised once the preemption save is done."""
    import shutil
    import tempfile

    from unickpt import TierOptions

    shm = tempfile.mkdtemp(prefix="unickpt-test-save-errors-", dir="/dev/shm")
    root = tmp_path / "run"
    try:
        ck = Checkpointer(root, tiers=TierOptions(memory_dir=shm, signals=()), memory_every=1, persist_every=2)
        ck.save(1, _state(1))
        with inject(Fault("write", match=f"{root}/step_2/data/*", nth=None, errno=errno.ENOSPC)):
            _finished(ck.save(2, _state(2)))  # the persistent save of step 2 fails
        ck.tiers.notice.notify("SIGTERM")
        with pytest.raises(unickpt.EarlierSaveFailedError) as info:
            ck.save(3, _state(3))
        assert info.value.steps == [2] and "No space left on device" in str(info.value.__cause__)
        assert ck.preempted and ck.preempted_step == 3
        assert [s for s, ok in unickpt.list_checkpoints(str(root)) if ok] == [3]
        ck.close()
        _loads_bitwise(Checkpointer(root), 3)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_a_save_failing_at_its_own_call_is_counted_and_warned_in_warn_mode(tmp_path, on_error):
    """A synchronous save's own failure is raised at the call (default) or, with on_error="warn", a
    RuntimeWarning and None; counted either way, and not reported again by the next call."""
    ckpt = Checkpointer(tmp_path / "run", async_save=False, on_error=on_error)
    ckpt.save(1, _state(1))
    with inject(_enospc(2)):
        if on_error == "raise":
            with pytest.raises(unickpt.SaveFailedError, match="No space left on device") as info:
                ckpt.save(2, _state(2))
            assert not isinstance(info.value, unickpt.EarlierSaveFailedError)
        else:
            with pytest.warns(RuntimeWarning, match=r"^unickpt: the save of step 2 \('.*/run/step_2'\) failed "
                              r"\(.*No space left on device.*\); on_error='warn': training goes on") as rec:
                assert ckpt.save(2, _state(2)) is None
            assert len(rec) == 1
    assert ckpt.failed_saves == 1 and isinstance(ckpt.last_error, unickpt.SaveFailedError)
    ckpt.save(3, _state(3))  # nothing raised or warned again
    ckpt.close()
    _loads_bitwise(Checkpointer(tmp_path / "run"), 3)
