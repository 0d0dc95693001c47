"""unickpt plugin for Lightning (``lightning`` >= 2.3): every checkpoint a Trainer writes or restores
goes through unickpt.

::

    from unickpt.lightning import UnickptCheckpointIO
    trainer = Trainer(plugins=[UnickptCheckpointIO()])     # any strategy

or, with no code change, ``UNICKPT_LIGHTNING=1 python train.py`` (Lightning's
``callbacks_factory`` entry points, :mod:`._activate`).

Modules: :mod:`.io` (the ``CheckpointIO``), :mod:`._strategies` (the route for sharded strategies,
which bypass ``CheckpointIO``, and DeepSpeedStrategy), :mod:`._tree` (the checkpoint dict kept
exactly), :mod:`._layout` (pointer files and versions on storage), :mod:`._callback` and
:mod:`._activate` (zero-code activation). See ``docs/lightning.md``.
"""
from __future__ import annotations

from typing import Any

__all__ = ["UnickptCheckpointIO", "UnickptCallback", "UnickptFabricCallback"]

_LAZY = {"UnickptCheckpointIO": ".io", "UnickptCallback": "._callback", "UnickptFabricCallback": "._callback"}


def __getattr__(name: str) -> Any:
    """Import the submodule defining ``name`` on first use (``import unickpt.lightning`` stays cheap)."""
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'unickpt.lightning' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
