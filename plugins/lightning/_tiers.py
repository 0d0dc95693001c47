"""The checkpoint tiers in Lightning (docs/tiers.md): ``UnickptCheckpointIO(memory_every=N)``.

:class:`UnickptTiersCallback` is put on every Trainer by the ``callbacks_factory`` entry point while a
:class:`~unickpt.lightning.UnickptCheckpointIO` with tiers exists in the process (:mod:`._activate`);
it acts only when the Trainer's strategy uses such an IO. What runs where (every rank):

- ``setup``: the tiers of the run (:func:`unickpt.ext.memory_tiers`, collective), named after the
  Trainer's checkpoint directory (``ModelCheckpoint.dirpath``, else ``default_root_dir``);
- after each optimizer step (``on_train_batch_end`` with a new ``global_step``): one small all-reduce
  (the preemption flag) and, every ``memory_every`` steps, a memory save of the whole checkpoint
  dict (``dump_checkpoint``, as ``trainer.save_checkpoint`` would write it) into this rank's memory,
  copied to a rank of another node in the background;
- on a preemption notice to any rank (``SIGTERM`` / ``SIGUSR1``): every rank calls
  ``trainer.save_checkpoint(<dir>/preempted-step=<N>.ckpt)``, waits for it, and stops the fit
  (``trainer.should_stop``); ``io.preempted_path`` names the file.

Restoring: ``trainer.fit(model, ckpt_path=io.memory_ckpt_path(fallback))`` (the string
``unickpt-memory:<fallback>``): every rank restores the newest step that every rank holds in memory
(its node's, or a peer node's sent over the group), checksums verified; without one, ``fallback`` (a
checkpoint path, may be empty) is loaded as usual.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from unickpt import ext

__all__ = ["UnickptTiersCallback", "MEMORY_PREFIX", "memory_root"]

log = logging.getLogger("unickpt.lightning")

from .io import MEMORY_PREFIX  # noqa: E402


def memory_root(trainer: Any) -> str:
    """The run's checkpoint directory: the first ModelCheckpoint's ``dirpath``, else ``default_root_dir``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            return os.fspath(cb.dirpath)
    return os.fspath(trainer.default_root_dir)


class UnickptTiersCallback(Callback):
    """Runs the checkpoint tiers of the Trainer's :class:`~unickpt.lightning.UnickptCheckpointIO` (see the
    module docstring). Stores no state in checkpoints."""

    def __init__(self) -> None:
        self._io: Any = None
        self._last_step: int | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from ._strategies import unickpt_io

        io = unickpt_io(trainer.strategy)
        if io is None or io.tier_options is None:
            return
        self._io = io
        if io.tiers is None:
            root = memory_root(trainer)
            io.tiers = ext.memory_tiers(root, io.tier_options)
            io.tiers_root = root
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        io = self._io
        if io is None or io.tiers is None or trainer.global_step == self._last_step:
            return  # not ours, or no optimizer step since the last call (gradient accumulation)
        step = self._last_step = trainer.global_step

        def state() -> dict:
            return io.memory_state(trainer._checkpoint_connector.dump_checkpoint(weights_only=False))

        if io.tiers.step(step, state, allow_pickle=io._save_pickle()) and not io.preempted:
            path = os.path.join(io.tiers_root, f"preempted-step={step}.ckpt")
            if io.tiers.rank == 0:
                log.warning("unickpt.lightning: preemption notice (%s): saving %s", io.tiers.notice.received
                            or "on another rank", path)
            trainer.save_checkpoint(path)
            io.wait()
            trainer.strategy.barrier("unickpt_preempted")
            io.preempted, io.preempted_path = True, path
            trainer.should_stop = True

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._io is not None and self._io.tiers is not None:
            self._io.tiers.wait()
