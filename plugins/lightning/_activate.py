"""Zero-code activation: Lightning's ``callbacks_factory`` entry points (declared in pyproject.toml).

Lightning calls every ``lightning.pytorch.callbacks_factory`` entry point when it builds a Trainer
(lightning 2.6 ``pytorch/trainer/connectors/callback_connector.py``) and every
``lightning.fabric.callbacks_factory`` one when it builds a Fabric. With ``UNICKPT_LIGHTNING=1``
in the environment the factories below return a callback that makes the strategy use
:class:`~unickpt.lightning.UnickptCheckpointIO`; otherwise they return ``[]`` and nothing else
happens (this module imports nothing beyond ``os``).

Options from the environment (read when the callback is created):
``UNICKPT_LIGHTNING_ASYNC=0`` for synchronous saves; ``UNICKPT_LIGHTNING_ALLOW_PICKLE=1|0`` for
``allow_pickle=True|False`` (unset: ``None``, Lightning's trust model).
"""
from __future__ import annotations

import os

__all__ = ["callbacks_factory", "fabric_callbacks_factory", "enabled"]

ENV = "UNICKPT_LIGHTNING"


def enabled() -> bool:
    """True when ``UNICKPT_LIGHTNING`` is set to ``1`` / ``true`` / ``yes`` / ``on``."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _tiers_wanted() -> bool:
    """A UnickptCheckpointIO with checkpoint tiers (``memory_every``) exists in this process."""
    import sys

    io = sys.modules.get("unickpt.lightning.io")
    return io is not None and any(x.tier_options is not None for x in list(io._LIVE))


def callbacks_factory() -> list:
    """Entry point of ``lightning.pytorch.callbacks_factory``: ``[UnickptCallback()]`` with
    ``UNICKPT_LIGHTNING=1``, plus ``UnickptTiersCallback()`` while a UnickptCheckpointIO with tiers
    exists (docs/tiers.md); else ``[]``."""
    out: list = []
    if enabled():
        from ._callback import UnickptCallback

        out.append(UnickptCallback())
    if _tiers_wanted():
        from ._tiers import UnickptTiersCallback

        out.append(UnickptTiersCallback())
    return out


def fabric_callbacks_factory() -> list:
    """Entry point of ``lightning.fabric.callbacks_factory``: ``[UnickptFabricCallback()]`` or ``[]``."""
    if not enabled():
        return []
    from ._callback import UnickptFabricCallback

    return [UnickptFabricCallback()]
