"""The callbacks that zero-code activation (:mod:`._activate`) puts on every Trainer / Fabric."""
from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch.callbacks import Callback

__all__ = ["UnickptCallback", "UnickptFabricCallback", "io_from_env", "adopt"]

log = logging.getLogger("unickpt.lightning")


def io_from_env() -> Any:
    """A :class:`~unickpt.lightning.UnickptCheckpointIO` configured from ``UNICKPT_LIGHTNING_*``."""
    from .io import UnickptCheckpointIO

    pickle = os.environ.get("UNICKPT_LIGHTNING_ALLOW_PICKLE", "").strip().lower()
    allow = {"1": True, "true": True, "0": False, "false": False}.get(pickle)
    return UnickptCheckpointIO(async_save=os.environ.get("UNICKPT_LIGHTNING_ASYNC", "1") != "0", allow_pickle=allow,
                               on_error=os.environ.get("UNICKPT_LIGHTNING_ON_ERROR", "").strip() or "raise")


def adopt(strategy: Any) -> bool:
    """Make ``strategy`` use unickpt, unless the user chose a CheckpointIO of their own.

    Replaces no IO / ``TorchCheckpointIO``; inside a user's ``AsyncCheckpointIO`` (with no IO or
    ``TorchCheckpointIO`` under it) it replaces the inner IO and keeps the wrapper. Returns True if the strategy now uses unickpt. A Fabric strategy that
    refuses a CheckpointIO (Fabric's FSDP and ModelParallel raise NotImplementedError) is left
    as it is (False, with a warning).
    """
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from ._strategies import unickpt_io

    if unickpt_io(strategy) is not None:
        return True
    current = getattr(strategy, "_checkpoint_io", None)
    if isinstance(current, AsyncCheckpointIO) and type(current) is AsyncCheckpointIO:
        inner = current.checkpoint_io
        if inner is None or type(inner) is TorchCheckpointIO:
            # the user's AsyncCheckpointIO stays (its thread calls ours); unickpt replaces the torch.save under it
            current._checkpoint_io = io_from_env()
            current._base_checkpoint_io_configured = True
            return True
        log.warning("UNICKPT_LIGHTNING=1: %s has a custom CheckpointIO (%s); leaving it in place",
                    type(strategy).__name__, type(inner).__name__)
        return False
    if not (current is None or type(current) is TorchCheckpointIO):
        log.warning("UNICKPT_LIGHTNING=1: %s has a custom CheckpointIO (%s); leaving it in place",
                    type(strategy).__name__, type(current).__name__)
        return False
    try:
        strategy.checkpoint_io = io_from_env()
    except NotImplementedError as e:
        log.warning("UNICKPT_LIGHTNING=1: %s does not accept a CheckpointIO, so unickpt is not used there (%s)",
                    type(strategy).__name__, e)
        return False
    return True


class UnickptCallback(Callback):
    """Trainer callback: at ``setup`` (before any checkpoint is restored or saved) switch the
    strategy to :class:`~unickpt.lightning.UnickptCheckpointIO`. Stores no state.

    Creating it installs the routes of :func:`unickpt.lightning._strategies.install` in this process
    (Lightning's ``pl_load`` reads unickpt files; a ``ddp_spawn`` main process switches its strategy
    before launching the workers)."""

    def __init__(self) -> None:
        from ._strategies import install

        install()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        adopt(trainer.strategy)

    def unickpt_before_launch(self, strategy: Any) -> None:
        """``ddp_spawn`` / ``ddp_fork``: :func:`adopt` the main process's ``strategy`` before the launch
        (called by the launcher wrapper of :func:`unickpt.lightning._strategies.install`; ``setup`` runs
        in the workers only)."""
        adopt(strategy)


class UnickptFabricCallback:
    """Fabric callback: after ``fabric.setup(...)`` switch the strategy to
    :class:`~unickpt.lightning.UnickptCheckpointIO` (DDP and single-device strategies; Fabric's
    FSDP and ModelParallel strategies refuse a CheckpointIO and stay on
    ``torch.distributed.checkpoint``)."""

    def on_after_setup(self, fabric: Any, module: Any) -> None:
        adopt(fabric.strategy)
