"""unickpt.accelerate: a failed background save is reported by the next ``save_state`` (which waits for
it) as ``unickpt.EarlierSaveFailedError`` naming the save, once, or with ``on_error="warn"`` as a
warning; the following saves run (in-process, one process; the multi-process rule is the engine's:
tests/distributed/test_save_errors_dist.py)."""
from __future__ import annotations

import errno
import os

import pytest

from test_accelerate import _tiny, accelerator_factory  # noqa: F401 - the fixture

import unickpt
import unickpt.accelerate
from unickpt.testing import Fault, inject


def _enospc(folder) -> tuple[Fault, Fault]:
    """Writes of the data files and of model.safetensors fail (the weights of a model whose optimizer has no
    state yet are all in the latter)."""
    step = f"{folder}{os.sep}unickpt{os.sep}step_*{os.sep}"
    return (Fault("write", match=f"{step}data{os.sep}*", nth=None, errno=errno.ENOSPC),
            Fault("write", match=f"{step}model*.safetensors", nth=None, errno=errno.ENOSPC))


def test_the_next_save_state_raises_the_failure_once(tmp_path, accelerator_factory):  # noqa: F811
    acc = accelerator_factory()
    _tiny(acc)
    with inject(*_enospc(tmp_path / "a")):
        acc.save_state(str(tmp_path / "a"))
        with pytest.raises(unickpt.EarlierSaveFailedError) as info:
            acc.save_state(str(tmp_path / "b"))
    err = info.value
    failed = str(tmp_path / "a" / "unickpt" / "step_0")
    assert err.steps == [0] and err.path == failed
    assert str(err).startswith(f"1 earlier asynchronous save(s) failed: step 0 ({failed!r})")
    assert isinstance(err.__cause__, unickpt.SaveFailedError) and "No space left on device" in str(err.__cause__)
    assert not (tmp_path / "b").exists()  # the save_state that raised saved nothing
    acc.save_state(str(tmp_path / "b"))  # the following saves run; nothing is raised again
    unickpt.accelerate.wait()
    acc.load_state(str(tmp_path / "b"))


def test_on_error_warn(tmp_path, accelerator_factory):  # noqa: F811
    acc = accelerator_factory()
    unickpt.accelerate.enable(acc, on_error="warn")
    _tiny(acc)
    with inject(*_enospc(tmp_path / "a")):
        acc.save_state(str(tmp_path / "a"))
        with pytest.warns(RuntimeWarning, match=r"^unickpt: the asynchronous save of step 0 \('.*/a/unickpt/step_0'\) "
                          r"failed \(OSError: \[Errno 28\] No space left on device .*\); on_error='warn'") as rec:
            acc.save_state(str(tmp_path / "b"))
    assert len(rec) == 1
    unickpt.accelerate.wait()
    acc.load_state(str(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"option on_error must be one of \['raise', 'warn'\], got 'ignore'"):
        unickpt.accelerate.enable(acc, on_error="ignore")
    with pytest.raises(ValueError, match=r"got 'ignore' \(from UNICKPT_ACCELERATE_ON_ERROR\)"):
        unickpt.accelerate.options_from_env({"UNICKPT_ACCELERATE_ON_ERROR": "ignore"})
    assert unickpt.accelerate.options_from_env({"UNICKPT_ACCELERATE_ON_ERROR": "warn"}).on_error == "warn"


GAP_THEN_NEXT_CALL = r"""
import os, sys, time, torch
from accelerate import Accelerator
import unickpt, unickpt.accelerate
from unickpt.testing import Fault, install
work, call = sys.argv[1], sys.argv[2]
fault = Fault("write", nth=None, enabled=False)
install(fault)
acc = Accelerator(cpu=True)
unickpt.accelerate.enable(acc)
m, o = acc.prepare(torch.nn.Linear(4, 1), torch.optim.AdamW(torch.nn.Linear(4, 1).parameters()))
acc.save_state(os.path.join(work, "good"))
unickpt.accelerate.wait()
fault.enabled = True
acc.save_state(os.path.join(work, "bad"))
deadline = time.monotonic() + 60  # a training step's gap: the save fails in the background meanwhile
while os.path.exists(os.path.join(work, "bad", "unickpt", "step_0")) and time.monotonic() < deadline:
    time.sleep(0.05)
fault.enabled = False
print("failed save removed:", not os.path.exists(os.path.join(work, "bad", "unickpt", "step_0")), flush=True)
try:
    (acc.load_state if call == "load" else acc.save_state)(os.path.join(work, "good" if call == "load" else "next"))
except unickpt.EarlierSaveFailedError as e:
    print("raised", e.steps, flush=True)
"""


@pytest.mark.parametrize("call", ["save", "load"])
def test_a_save_failing_in_the_background_is_removed_and_raised_without_a_hang(tmp_path, call):
    """The failed save's commit thread removes its directory through ``shutil.rmtree``, which the plugin
    makes wait for saves in flight under the path: it must not wait for the save it is finishing (it
    did: the process hung at the next ``save_state`` / ``load_state``)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", GAP_THEN_NEXT_CALL, str(tmp_path), call], capture_output=True,
                         text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["failed save removed: True", "raised [0]"], out.stdout + out.stderr[-3000:]
