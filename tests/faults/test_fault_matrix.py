"""The fault matrix (issue 29): storage faults x save modes, through the fault-injecting backend
(:mod:`unickpt.testing.faults`), the real save and load paths and nothing patched.

Every cell runs the same story: step 1 commits; step 2's save meets the fault; the fault goes away
and step 3 commits. In every cell:

- the error reaches the caller at the documented call (sync: the save call; async: the handle's
  ``wait()``; ``Checkpointer``: its ``wait()``, as the next ``save()`` or ``close()`` would; the
  Lightning plugin: ``io.wait()``; the Accelerate plugin: ``unickpt.accelerate.wait()``), as a
  ``SaveFailedError`` naming the step (or path) and the cause; a fault that is no failure (slow
  storage) raises nothing and the save still returns before its write is done;
- while the fault lasts, the newest committed step loads bitwise (a failing listing is an error,
  never "no checkpoint");
- after the next successful save no leftover of the failed attempt remains on storage.

Faults: ``disk_full`` (ENOSPC on every data-file write: ``data/*`` and the weights' ``model*.safetensors``),
``short_write`` (a lying disk: a data file keeps half its bytes and the write reports success), ``eio_rename`` (EIO on the atomic replace that
commits ``metadata.json``), ``failing_listing`` (EIO on every directory listing, while saving and
loading), ``slow`` (every write 0.3 s late), ``read_only`` (after the save's directory exists,
writes, renames, markers and removals fail with EROFS).
"""
from __future__ import annotations

import contextlib
import errno
import os
import time

import pytest
import torch

import unickpt
from unickpt.testing import Fault, install

N = 1 << 14  # elements of the test tensor (64 KiB)
SLOW_S = 0.3


def value(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(N, generator=g)


def make_state(step: int) -> dict:
    return {"w": value(step), "rows": torch.arange(64.0) * step, "step": step}


def blank() -> dict:
    return {"w": torch.zeros(N), "rows": torch.zeros(64), "step": -1}


def check(state: dict, step: int) -> None:
    assert state["step"] == step
    assert torch.equal(state["w"], value(step)) and torch.equal(state["rows"], torch.arange(64.0) * step)


# -- faults ------------------------------------------------------------------------------------------
def faults(name: str, where: str) -> list[Fault]:
    """The faults of ``name`` on the paths under ``where`` (an fnmatch prefix)."""
    data = (where + "*/data/*", where + "*/model*.safetensors")  # data files, and safetensors shards of the weights
    if name == "disk_full":
        return [Fault("write", match=m, nth=None, errno=errno.ENOSPC) for m in data]
    if name == "short_write":
        return [Fault("write", match=m, nth=1, action="truncate", keep=0.5) for m in data]
    if name == "eio_rename":
        return [Fault("rename", match=where + "*metadata.json", nth=None, errno=errno.EIO)]
    if name == "failing_listing":
        return [Fault("list", match=where + "*", nth=None, errno=errno.EIO)]
    if name == "slow":
        return [Fault("write", match=where + "*", nth=None, action="slow", delay_s=SLOW_S)]
    if name == "read_only":
        # the save's directory and writer record exist: then the storage turns read-only
        return [Fault(op, match=where + "*", nth=None, errno=errno.EROFS) for op in ("write", "rename", "rm")]
    raise AssertionError(name)


FAULTS = ["disk_full", "short_write", "eio_rename", "failing_listing", "slow", "read_only"]
FAILS = {"disk_full", "short_write", "eio_rename", "read_only"}  # the save of step 2 must fail
CAUSES = {"disk_full": "No space left on device", "short_write": "short write", "eio_rename": "Input/output error",
          "read_only": "Read-only file system"}  # in the error's message


@contextlib.contextmanager
def armed_during(armed: list[Fault]):
    for f in armed:
        f.enabled = True
    try:
        yield
    finally:
        for f in armed:
            f.enabled = False
            f.release()


def files_under(path: str) -> list[str]:
    out = []
    for d, _, fs in os.walk(path):
        out += [os.path.relpath(os.path.join(d, f), path) for f in fs]
    return sorted(out)


# -- modes -------------------------------------------------------------------------------------------
class Mode:
    """One way to save: ``save(step)`` starts (or makes) step ``step``'s save, ``settle()`` is the
    documented call that raises an earlier failure, ``load()`` the newest committed step into a blank
    state, ``leftovers()`` what storage holds beyond the committed checkpoints."""

    asynchronous = True
    lists_to_load = False  # load() finds the newest step by listing storage
    failed: tuple = ()  # steps whose save failed
    recovery: tuple = (3,)  # the saves after the fault, the last one persistent

    def __init__(self, tmp_path):
        self.base = str(tmp_path / "ckpt")

    def close(self) -> None:
        pass


class SyncSave(Mode):
    """``unickpt.save(path, state)`` (synchronous): one directory per step."""

    asynchronous = False

    def path(self, step):
        return os.path.join(self.base, f"s{step}")

    def name_of(self, step):
        return repr(self.path(step))

    def save(self, step):
        unickpt.save(self.path(step), make_state(step))
        self.committed = step

    def settle(self):
        pass

    def load(self):
        state = blank()
        unickpt.load(self.path(self.committed), state)
        return state

    def leftovers(self):
        return [f"s{s}/{f}" for s in self.failed for f in files_under(self.path(s))]


class AsyncSave(SyncSave):
    """``unickpt.save(path, state, async_save=True)`` and the handle's ``wait()``."""

    asynchronous = True

    def save(self, step):
        self.handle = unickpt.save(self.path(step), make_state(step), async_save=True)
        self.pending = step

    def settle(self):
        self.handle.wait()
        self.committed = self.pending


class CheckpointerMode(Mode):
    options: dict = {}
    lists_to_load = True

    def name_of(self, step):
        return f"step {step} ('{self.base}/step_{step}')"

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        self.ck = unickpt.Checkpointer(self.base, keep_last=2, **self.options)

    def save(self, step):
        self.handle = self.ck.save(step, make_state(step))

    def settle(self):
        self.ck.wait()

    def load(self):
        state = blank()
        self.ck.load(state)
        return state

    def leftovers(self):
        committed = {f"step_{s}" for s, ok in unickpt.list_checkpoints(self.base) if ok}
        return [f for f in files_under(self.base) if f != "latest" and f.split("/")[0] not in committed]

    def close(self):
        self.ck.close()


class OverlapMode(CheckpointerMode):
    options = {"save_options": unickpt.SaveOptions(snapshot="overlap")}


class TiersMode(CheckpointerMode):
    """Memory every step, storage every second step: step 2's persistent save meets the fault (the
    memory tiers are not on the faulty storage's paths: the faults match the root only)."""

    recovery = (3, 4)  # step 3 goes to memory only; step 4 is the next persistent save

    def __init__(self, tmp_path):
        import shutil
        import tempfile

        self.shm = tempfile.mkdtemp(prefix="unickpt-matrix-", dir="/dev/shm")
        self._rm = lambda: shutil.rmtree(self.shm, ignore_errors=True)
        self.options = {"tiers": unickpt.TierOptions(memory_dir=self.shm, signals=(), memory_every=1,
                                                     persist_every=2)}
        super().__init__(tmp_path)

    def close(self):
        super().close()
        self._rm()


class LightningMode(Mode):
    """unickpt's Lightning CheckpointIO, as a Trainer run calls it (asynchronous saves)."""

    def __init__(self, tmp_path, monkeypatch):
        super().__init__(tmp_path)
        pytest.importorskip("lightning")
        from unickpt.lightning import UnickptCheckpointIO
        from unickpt.lightning import io as io_module

        monkeypatch.setattr(io_module, "trainer_running", lambda: True, raising=False)
        self.io = UnickptCheckpointIO()
        os.makedirs(self.base, exist_ok=True)

    def path(self, step):
        return os.path.join(self.base, f"epoch=0-step={step}.ckpt")

    def name_of(self, step):
        return self.path(step)

    def save(self, step):
        sd = make_state(step)
        self.io.save_checkpoint({"epoch": 0, "global_step": step, "state_dict": {"w": sd["w"], "rows": sd["rows"]},
                                 "step": step}, self.path(step))
        self.pending = step

    def settle(self):
        self.io.wait()
        self.committed = self.pending

    def load(self):
        got = self.io.load_checkpoint(self.path(self.committed))
        return {"w": got["state_dict"]["w"], "rows": got["state_dict"]["rows"], "step": got["step"]}

    def leftovers(self):
        return [n for n in os.listdir(self.base) if n.startswith(".")] + (
            [os.path.basename(self.path(2))] if os.path.exists(self.path(2)) and not self._committed(2) else [])

    def _committed(self, step):
        try:
            self.io.load_checkpoint(self.path(step))
            return True
        except Exception:  # noqa: BLE001
            return False

    def close(self):
        try:
            self.io.teardown()
        except Exception:  # noqa: BLE001 - raised already at settle()
            pass


class AccelerateMode(Mode):
    """``accelerator.save_state(folder)`` with unickpt on (async), ``unickpt.accelerate.wait()``."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        pytest.importorskip("accelerate")
        from accelerate import Accelerator

        import unickpt.accelerate

        self.acc = Accelerator(cpu=True)
        self.model = self.acc.prepare(torch.nn.Linear(N // 64, 64, bias=False))
        unickpt.accelerate.enable(self.acc, async_save=True)
        self.wait = unickpt.accelerate.wait

    def path(self, step):
        return os.path.join(self.base, f"checkpoint_{step}")

    def name_of(self, step):
        return self.path(step)

    def save(self, step):
        with torch.no_grad():
            self.model.weight.copy_(value(step).view(64, N // 64))
        self.acc.save_state(self.path(step))
        self.pending = step

    def settle(self):
        self.wait()
        self.committed = self.pending

    def load(self):
        with torch.no_grad():
            self.model.weight.zero_()
        self.acc.load_state(self.path(self.committed))
        step = self.committed
        return {"w": self.model.weight.detach().reshape(-1).clone(), "rows": torch.arange(64.0) * step, "step": step}

    def leftovers(self):
        root = os.path.join(self.path(2), "unickpt")
        if not os.path.isdir(root):
            return []
        committed = {f"step_{s}" for s, ok in unickpt.list_checkpoints(root) if ok}
        return [f for f in files_under(root) if f != "latest" and f.split("/")[0] not in committed]

    def close(self):
        import unickpt.accelerate

        unickpt.accelerate.disable(self.acc)


MODES = ["sync", "async", "checkpointer", "overlap", "tiers", "lightning", "accelerate"]


def make_mode(name, tmp_path, monkeypatch) -> Mode:
    return {"sync": lambda: SyncSave(tmp_path), "async": lambda: AsyncSave(tmp_path),
            "checkpointer": lambda: CheckpointerMode(tmp_path), "overlap": lambda: OverlapMode(tmp_path),
            "tiers": lambda: TiersMode(tmp_path), "lightning": lambda: LightningMode(tmp_path, monkeypatch),
            "accelerate": lambda: AccelerateMode(tmp_path)}[name]()


# -- the matrix --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("mode_name", MODES)
def test_fault_matrix(tmp_path, monkeypatch, mode_name, fault):
    # installed before the mode opens its storage (a Checkpointer opens its root when it is made),
    # armed only for step 2's save
    armed = faults(fault, "*" if mode_name == "lightning" else str(tmp_path / "ckpt"))
    for f in armed:
        f.enabled = False
    uninstall = install(*armed)
    mode = make_mode(mode_name, tmp_path, monkeypatch)
    try:
        mode.save(1)
        mode.settle()
        if isinstance(mode, SyncSave):
            mode.committed = 1
        check(mode.load(), 1)

        if fault in FAILS:
            mode.failed = (2,)
        with armed_during(armed):
            t0 = time.perf_counter()
            if fault in FAILS:  # raised by the save call itself (sync) or by the documented later call
                with pytest.raises(unickpt.SaveFailedError) as err:
                    mode.save(2)
                    assert mode.asynchronous, "a synchronous save that failed returned"
                    mode.settle()
            else:
                mode.save(2)
                returned = time.perf_counter() - t0
                if fault == "slow" and mode.asynchronous:
                    assert returned < SLOW_S, f"an async save call waited for slow storage ({returned:.2f} s)"
                mode.settle()
            assert any(f.fired for f in armed) or fault == "failing_listing", "the fault never fired"
            if fault in FAILS:  # names the failed step (or its path) and the cause
                msg = str(err.value)
                assert mode.name_of(2) in msg, msg
                assert CAUSES[fault] in msg, msg
            newest = 1 if fault in FAILS and not isinstance(mode, TiersMode) else 2  # tiers: step 2 in memory
            if fault == "failing_listing":
                # a load that needs a listing (the newest step of a root) fails with a StorageError
                # naming it, never "no checkpoint"; one that needs none (a given path) loads
                listing = armed[0].seen
                try:
                    got = mode.load()
                except unickpt.StorageError as e:
                    assert armed[0].seen > listing and "cannot list" in str(e) and "Input/output error" in str(e), e
                else:
                    check(got, newest)
                    assert not mode.lists_to_load, "the load listed nothing, yet it found the newest step"
            else:
                check(mode.load(), newest)

        # the storage is well again: the next save commits and removes what the failed one left
        for step in mode.recovery:
            mode.save(step)
            mode.settle()
        if isinstance(mode, SyncSave):
            mode.committed = mode.recovery[-1]
        check(mode.load(), mode.recovery[-1])
        assert mode.leftovers() == [], mode.leftovers()
    finally:
        try:
            mode.close()
        finally:
            uninstall()
