"""The checkpoint tiers through ``UnickptCheckpointIO(memory_every=...)`` (docs/tiers.md): a new Trainer
restores the last step from memory (``ckpt_path=io.memory_ckpt_path()``), bitwise, and training goes on;
a preemption notice saves the current step and stops the fit. One process, one CPU device."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_train import Tiny, data  # noqa: E402
from unickpt import TierOptions  # noqa: E402
from unickpt.lightning import UnickptCheckpointIO  # noqa: E402


@pytest.fixture
def shm():
    d = tempfile.mkdtemp(prefix="unickpt-test-lightning-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _trainer(root, io, max_steps, callbacks=()):
    return L.Trainer(max_steps=max_steps, plugins=[io], default_root_dir=str(root), enable_checkpointing=False,
                     logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                     devices=1, callbacks=list(callbacks))


class Snapshot(Callback):
    """The model and optimizer state at the start of training (right after a restore)."""

    def on_train_start(self, trainer, pl_module):
        self.model = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.step = trainer.global_step


def test_a_new_trainer_restores_the_last_step_from_memory(tmp_path, shm):
    torch.manual_seed(0)
    io = UnickptCheckpointIO(memory_every=1, tiers=TierOptions(memory_dir=shm, signals=()))
    model = Tiny()
    first = _trainer(tmp_path, io, 5)
    first.fit(model, data())
    assert io.tiers is None  # closed at teardown; its memory copies stay
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = first.optimizers[0].state_dict()["state"]

    io2 = UnickptCheckpointIO(memory_every=1, tiers=TierOptions(memory_dir=shm, signals=()))
    torch.manual_seed(1)
    model2, snap = Tiny(), Snapshot()
    second = _trainer(tmp_path, io2, 7, [snap])
    second.fit(model2, data(), ckpt_path=io2.memory_ckpt_path())
    step, stats = io2.last_memory_load
    assert step == 5 and snap.step == 5 and stats.tier == "memory"
    assert snap.model.keys() == want.keys() and all(torch.equal(snap.model[k], want[k]) for k in want)
    assert second.global_step == 7  # and training went on
    got_opt = second.optimizers[0].state_dict()["state"]
    assert got_opt.keys() == want_opt.keys()


def test_without_a_memory_step_the_fallback_path_is_loaded(tmp_path, shm):
    io = UnickptCheckpointIO(memory_every=1, tiers=TierOptions(memory_dir=shm, signals=()))
    with pytest.raises(FileNotFoundError, match="no step to restore in the memory tiers"):
        _trainer(tmp_path, io, 2).fit(Tiny(), data(), ckpt_path=io.memory_ckpt_path())


class Notice(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            trainer.strategy.checkpoint_io.tiers.notice.notify("SIGTERM")


def test_a_preemption_notice_saves_the_step_and_stops(tmp_path, shm):
    io = UnickptCheckpointIO(memory_every=1, tiers=TierOptions(memory_dir=shm))
    trainer = _trainer(tmp_path, io, 50, [Notice()])
    trainer.fit(Tiny(), data())
    assert io.preempted and trainer.global_step in (2, 3)
    assert os.path.basename(io.preempted_path) == f"preempted-step={trainer.global_step}.ckpt"
    ckpt = UnickptCheckpointIO().load_checkpoint(io.preempted_path)
    assert ckpt["global_step"] == trainer.global_step
