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


def callbacks_factory() -> list:
    """Entry point of ``lightning.pytorch.callbacks_factory``: ``[UnickptCallback()]`` or ``[]``."""
    if not enabled():
        return []
    from ._callback import UnickptCallback

    return [UnickptCallback()]


def fabric_callbacks_factory() -> list:
    """Entry point of ``lightning.fabric.callbacks_factory``: ``[UnickptFabricCallback()]`` or ``[]``."""
    if not enabled():
        return []
    from ._callback import UnickptFabricCallback

    return [UnickptFabricCallback()]
