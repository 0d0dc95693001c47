"""unickpt.lightning as a drop-in for Lightning's own checkpoint IO: one regression test per contract
that an earlier release broke (listings, the path existing when a save returns, reads waiting for
in-flight saves, symlinked ``last`` files, Lightning's HPC scan, ``pl_load``, ``ddp_spawn``)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("lightning")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lightning.fabric.utilities.cloud_io import _load as pl_load  # noqa: E402  (bound before the plugin exists)
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

from unickpt.lightning import UnickptCheckpointIO  # noqa: E402
from unickpt.lightning import io as io_module  # noqa: E402
import unickpt.storage.registry as storage_base  # noqa: E402
from unickpt.testing import Fault, install  # noqa: E402


class Gate:
    """Holds back the data writes of unickpt saves (``write_file`` of ``.../data/...``) until
    :meth:`open`; ``fail=True`` makes them fail with ENOSPC then (:mod:`unickpt.testing.faults`,
    installed for the test: ``monkeypatch`` puts the storage wrappers back at its end)."""

    def __init__(self, monkeypatch, fail: bool = False):
        import errno

        monkeypatch.setattr(storage_base, "_WRAPPERS", list(storage_base._WRAPPERS))
        self.hold = Fault("write", match="*/data/*", nth=None, action="hold", delay_s=60)
        faults = [self.hold] + ([Fault("write", match="*/data/*", nth=None, errno=errno.ENOSPC)] if fail else [])
        install(*faults)

    def open(self):
        self.hold.release()


@pytest.fixture
def in_run(monkeypatch):
    """Saves behave as inside a Trainer run (asynchronous)."""
    monkeypatch.setattr(io_module, "trainer_running", lambda: True, raising=False)


def ckpt(step: int, value: float) -> dict:
    return {"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.6.6",
            "state_dict": {"layer.weight": torch.full((2, 32), value), "layer.bias": torch.full((2,), value)}}


def test_listing_shows_only_the_checkpoint_files(tmp_path):
    """os.listdir / glob / fsspec ls of a checkpoint folder show the names Lightning's own IO shows,
    and each is a plain file."""
    import fsspec

    io = UnickptCheckpointIO()
    for name in ("epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"):
        io.save_checkpoint(ckpt(2, 1.0), tmp_path / name)
    io.save_checkpoint(ckpt(4, 2.0), tmp_path / "last.ckpt")
    io.wait()
    expected = ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    assert sorted(os.listdir(tmp_path)) == expected
    assert sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*"))) == expected
    assert sorted(os.path.basename(p) for p in fsspec.filesystem("file").ls(str(tmp_path), detail=False)) == expected
    assert all(os.path.isfile(tmp_path / n) for n in expected)
    io.remove_checkpoint(tmp_path / "epoch=0-step=2.ckpt")
    assert sorted(os.listdir(tmp_path)) == expected[1:]
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["state_dict"]["layer.bias"], torch.full((2,), 2.0))


@pytest.mark.parametrize("async_save", [True, False])
def test_listing_never_shows_a_temporary_name_during_a_trainer_run(tmp_path, monkeypatch, async_save):
    """At every moment of a Trainer run (saves in flight, overwrites of last.ckpt, top-k removals) a
    listing of the checkpoint folder shows only names Lightning saved, and afterwards exactly what
    Lightning's own IO leaves; Lightning's own regression test lists the folder from a hook
    (an earlier release showed ``.unickpt-tmp-<hex>`` while a checkpoint was renamed into place)."""
    import listing_spy
    from lightning.fabric.plugins import TorchCheckpointIO

    def run(root, io, watch):
        saved: set = set()
        original = io.save_checkpoint

        def save_checkpoint(checkpoint, path, storage_options=None):
            saved.add(os.path.basename(path))
            return original(checkpoint, path, storage_options)

        io.save_checkpoint = save_checkpoint
        hooks: list = []

        class Listed(BoringModel):
            def training_step(self, batch, batch_idx):
                self.log("step", float(self.global_step))
                return super().training_step(batch, batch_idx)

            def on_train_batch_start(self, batch, batch_idx):
                if os.path.isdir(root):
                    hooks.append(sorted(os.listdir(root)))

        mc = ModelCheckpoint(dirpath=root, monitor="step", mode="max", save_top_k=2, save_last=True,
                             every_n_train_steps=1)
        seen = listing_spy.watch(str(root), monkeypatch.setattr) if watch else []
        Trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=0, callbacks=[mc], logger=False,
                enable_progress_bar=False, enable_model_summary=False, plugins=[io]).fit(Listed())
        monkeypatch.undo()
        return saved, seen, hooks, sorted(os.listdir(root))

    saved, seen, hooks, final = run(tmp_path / "ours", UnickptCheckpointIO(async_save=async_save), watch=True)
    _, _, theirs_hooks, theirs = run(tmp_path / "theirs", TorchCheckpointIO(), watch=False)
    assert len(seen) > 10 and all(set(names) <= saved for names in seen), [n for n in seen if not set(n) <= saved]
    assert hooks == theirs_hooks and final == theirs == ["epoch=1-step=4.ckpt", "epoch=1-step=5.ckpt", "last.ckpt"]
    assert sorted(os.listdir(tmp_path)) == ["ours", "theirs"]  # the hidden folder of a rename is gone too


def test_path_exists_when_save_returns(tmp_path, monkeypatch, in_run):
    """ModelCheckpoint's version counter asks whether the name exists right after a save returned:
    it must, while the data are still being written."""
    gate = Gate(monkeypatch)
    io = UnickptCheckpointIO()
    io.save_checkpoint(ckpt(1, 1.0), tmp_path / "m.ckpt")
    assert not io.last_handle.done()
    assert os.path.isfile(tmp_path / "m.ckpt") and os.listdir(tmp_path) == ["m.ckpt"]
    gate.open()
    io.wait()
    assert torch.equal(io.load_checkpoint(tmp_path / "m.ckpt")["state_dict"]["layer.bias"], torch.full((2,), 1.0))


def test_model_checkpoint_keeps_every_version(tmp_path):
    """save_top_k=-1 with one file name over 4 epochs: m.ckpt, m-v1.ckpt, m-v2.ckpt, m-v3.ckpt, each
    holding its own epoch (an earlier release reused a name and lost epoch 0)."""

    class Scored(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("score", float(self.current_epoch))
            return out

    mc = ModelCheckpoint(dirpath=tmp_path, filename="m", monitor="score", mode="max", save_top_k=-1)
    trainer = Trainer(max_epochs=4, limit_train_batches=2, limit_val_batches=0, callbacks=[mc], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, plugins=[UnickptCheckpointIO()])
    trainer.fit(Scored())
    names = ["m.ckpt", "m-v1.ckpt", "m-v2.ckpt", "m-v3.ckpt"]
    assert sorted(os.listdir(tmp_path)) == sorted(names)
    assert [pl_load(tmp_path / n)["epoch"] for n in names] == [0, 1, 2, 3]


def test_reads_wait_for_an_in_flight_save_of_the_path(tmp_path, monkeypatch, in_run):
    """A read by another instance (load_from_checkpoint, pl_load) while a save of the same path is in
    flight waits for it and returns the new checkpoint, for a new path and for an overwrite."""
    io = UnickptCheckpointIO()
    path = tmp_path / "x.ckpt"
    model = BoringModel()
    for value in (1.0, 2.0):  # a new path, then an overwrite of it
        gate = Gate(monkeypatch)
        io.save_checkpoint(ckpt(int(value), value), path)
        results: list = []
        readers = [threading.Thread(target=lambda: results.append(
                       BoringModel.load_from_checkpoint(path).layer.bias.detach().clone())),
                   threading.Thread(target=lambda: results.append(pl_load(path)["state_dict"]["layer.bias"]))]
        for t in readers:
            t.start()
        time.sleep(0.3)
        assert not results and all(t.is_alive() for t in readers)  # waiting, not reading a stale or missing file
        gate.open()
        for t in readers:
            t.join(60)
        assert len(results) == 2 and all(torch.equal(r, torch.full((2,), value)) for r in results)
        io.wait()
    assert isinstance(model, LightningModule)


def test_a_reader_never_sees_a_half_replaced_checkpoint(tmp_path):
    """A reader that opened a checkpoint keeps reading that version while a save replaces the file."""
    from unickpt.lightning import _pack

    io = UnickptCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(ckpt(1, 1.0), path)
    io.wait()
    with _pack.open_pack(str(path)) as (url, index):
        io.save_checkpoint(ckpt(2, 2.0), path)
        io.wait()
        from unickpt.ext import load_solo

        state = {"tensors": {k: torch.empty_like(v) for k, v in ckpt(1, 0.0)["state_dict"].items()}, "lightning": None}
        state["tensors"] = {f"state_dict.{k}": v for k, v in state["tensors"].items()}
        load_solo(url, state, strict=True, allow_pickle=False, redistribute=False)
        assert torch.equal(state["tensors"]["state_dict.layer.bias"], torch.full((2,), 1.0))
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["layer.bias"], torch.full((2,), 2.0))


def test_failed_save_keeps_the_previous_checkpoint_and_leaves_no_file(tmp_path, monkeypatch, in_run):
    io = UnickptCheckpointIO()
    io.save_checkpoint(ckpt(1, 1.0), tmp_path / "last.ckpt")
    io.wait()
    gate = Gate(monkeypatch, fail=True)
    io.save_checkpoint(ckpt(2, 2.0), tmp_path / "last.ckpt")  # an overwrite that fails
    io.save_checkpoint(ckpt(2, 2.0), tmp_path / "new.ckpt")  # a new path that fails
    gate.open()
    with pytest.raises(Exception, match="No space left on device"):
        io.wait()
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["state_dict"]["layer.bias"], torch.full((2,), 1.0))


def test_removing_a_symlink_removes_the_link(tmp_path, monkeypatch, in_run):
    """save_last="link": removing the link (even to a checkpoint still being saved, or one gone)
    removes the link itself and leaves its target."""
    io = UnickptCheckpointIO()
    gate = Gate(monkeypatch)
    io.save_checkpoint(ckpt(1, 1.0), tmp_path / "epoch=0.ckpt")
    os.symlink("epoch=0.ckpt", tmp_path / "last-v1.ckpt")
    io.remove_checkpoint(tmp_path / "last-v1.ckpt")
    assert os.listdir(tmp_path) == ["epoch=0.ckpt"]
    gate.open()
    io.wait()
    os.symlink("gone.ckpt", tmp_path / "last.ckpt")  # dangling
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert os.listdir(tmp_path) == ["epoch=0.ckpt"]


def test_save_last_link_matches_lightning(tmp_path):
    """A Trainer with save_last="link" leaves the same files and links as with Lightning's own IO."""
    from lightning.fabric.plugins import TorchCheckpointIO

    def run(root, io):
        mc = ModelCheckpoint(dirpath=root, monitor="step", mode="max", save_top_k=1, save_last="link",
                             every_n_train_steps=1)

        class Logged(BoringModel):
            def training_step(self, batch, batch_idx):
                out = super().training_step(batch, batch_idx)
                self.log("step", float(self.global_step))
                return out

        Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0, callbacks=[mc], logger=False,
                enable_progress_bar=False, enable_model_summary=False, plugins=[io]).fit(Logged())
        return {n: (os.readlink(root / n) if os.path.islink(root / n) else None) for n in os.listdir(root)}

    ours = run(tmp_path / "ours", UnickptCheckpointIO())
    theirs = run(tmp_path / "theirs", TorchCheckpointIO())
    assert ours == theirs and any(v is not None for v in ours.values())
    assert pl_load(tmp_path / "ours" / "last.ckpt")["global_step"] == 4


def test_temporary_files_are_invisible_to_lightnings_hpc_scan(tmp_path, monkeypatch):
    """While a checkpoint file is replaced, the folder holds no name Lightning's HPC version scan
    parses (``hpc_ckpt_3.ckpt.tmp-<hex>`` read as version 3<hex digits>)."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    scan = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder
    seen = []
    real_replace = os.replace

    def spy(src, dst, *args, **kwargs):
        if str(tmp_path) in str(dst):
            seen.append((sorted(os.listdir(tmp_path)), scan(tmp_path, "hpc_ckpt_")))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy)
    io = UnickptCheckpointIO()
    for n in (1, 2, 3, 3):
        io.save_checkpoint(ckpt(n, float(n)), tmp_path / f"hpc_ckpt_{n}.ckpt")
    io.wait()
    assert seen and all(version in (None, 1, 2, 3) for _, version in seen), seen
    assert scan(tmp_path, "hpc_ckpt_") == 3 and sorted(os.listdir(tmp_path)) == [
        "hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt", "hpc_ckpt_3.ckpt"]


def test_pl_load_reads_unickpt_checkpoints(tmp_path):
    """``lightning.fabric.utilities.cloud_io._load`` (imported by name before the plugin existed)
    returns the checkpoint dict; torch.save files still go through torch.load."""
    io = UnickptCheckpointIO()
    io.save_checkpoint(ckpt(7, 3.0), tmp_path / "a.ckpt")
    io.wait()
    out = pl_load(tmp_path / "a.ckpt")
    assert out["global_step"] == 7 and torch.equal(out["state_dict"]["layer.weight"], torch.full((2, 32), 3.0))
    assert pl_load(str(tmp_path / "a.ckpt"), map_location="cpu")["global_step"] == 7
    torch.save({"x": torch.ones(1)}, tmp_path / "plain.ckpt")
    assert torch.equal(pl_load(tmp_path / "plain.ckpt")["x"], torch.ones(1))


DDP_SPAWN = """
import os, sys, torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel


def main():
    root = sys.argv[1]
    torch.manual_seed(0)
    model = BoringModel()
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, limit_train_batches=2,
                      limit_val_batches=0, default_root_dir=root, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(model)
    from lightning.fabric.utilities.cloud_io import _load
    ck = os.path.join(root, "checkpoints")
    last = _load(os.path.join(ck, os.listdir(ck)[0]))
    same = all(torch.equal(v, model.state_dict()[k]) for k, v in last["state_dict"].items())
    print("RESULT", type(trainer.strategy.checkpoint_io).__name__, same, sorted(os.listdir(ck)))


if __name__ == "__main__":
    main()
"""


def test_ddp_spawn_main_process_uses_unickpt(tmp_path):
    """strategy="ddp_spawn" with UNICKPT_LIGHTNING=1: the main process reads the weights its worker
    saved with unickpt too, and ends with the trained weights."""
    script = tmp_path / "spawn.py"
    script.write_text(DDP_SPAWN)
    env = {**os.environ, "UNICKPT_LIGHTNING": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1]
    assert line == "RESULT UnickptCheckpointIO True ['epoch=0-step=2.ckpt']", line
