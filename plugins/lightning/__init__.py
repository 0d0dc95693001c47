"""unickpt plugin for Lightning (``lightning`` >= 2.3): every checkpoint a Trainer writes or restores
goes through unickpt.

::

    from unickpt.lightning import UnickptCheckpointIO
    trainer = Trainer(plugins=[UnickptCheckpointIO()])     # any strategy

or, with no code change, ``UNICKPT_LIGHTNING=1 python train.py`` (Lightning's
``callbacks_factory`` entry points, :mod:`._activate`).

Modules, bottom to top: :mod:`._tree` (the checkpoint dict kept exactly), :mod:`._pickles` (the trust
model), :mod:`._torchzip` (torch.save's zip archive), :mod:`._pack` (one file per full-dict checkpoint),
:mod:`._pointers` (pointer files and versions of the sharded routes) and :mod:`._versions` (publishing and collecting them),
:mod:`._inflight` (the saves in flight in this process), :mod:`._tracking` (an IO's pending saves
and their failures), :mod:`._reading` (reading a checkpoint file), :mod:`._strategies` (the route for
sharded strategies, which bypass ``CheckpointIO``, and DeepSpeedStrategy), :mod:`.io` (the
``CheckpointIO``), :mod:`._callback`, :mod:`._tiers` and :mod:`._activate` (zero-code activation).
See ``docs/lightning.md``.
"""
from __future__ import annotations

from unickpt.ext import lazy_getattr

__all__ = ["UnickptCheckpointIO", "UnickptCallback", "UnickptFabricCallback"]

_LAZY = {"UnickptCheckpointIO": ".io", "UnickptCallback": "._callback", "UnickptFabricCallback": "._callback"}
__getattr__ = lazy_getattr(__name__, _LAZY)
