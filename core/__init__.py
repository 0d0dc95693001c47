"""unickpt: unified, high-performance distributed checkpointing for PyTorch.

Public surface::

    unickpt.save(path, state, async_save=False, process_group=None, storage_options=None, options=None) -> SaveHandle
    unickpt.load(path, state, strict=True, process_group=None, storage_options=None, options=None) -> LoadStats
    unickpt.Checkpointer(root, keep_last=None, async_save=True, ...)
    unickpt.Shard, unickpt.PerRank, unickpt.RNGState
    unickpt.SaveOptions, unickpt.LoadOptions, unickpt.TierOptions (memory tiers: docs/tiers.md)
    unickpt.Mapping, unickpt.Rename, unickpt.Split, unickpt.Fuse, unickpt.Permute   (cross-framework loads)

Framework plugins use :mod:`unickpt.ext`. The package is laid out by layer (docs/design.md):
``state`` -> ``plan`` -> ``saving`` / ``loading`` -> ``format`` / ``storage`` / ``dist``, with
``lifecycle`` (directory rules) beside them and ``tools`` (the ``unickpt`` command) on top.

The names are imported lazily (PEP 562 module ``__getattr__``): ``import unickpt`` itself does not import
torch, so the startup hook (:mod:`unickpt._startup`, run from a ``.pth`` file in every interpreter) and the
``unickpt`` command stay cheap.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_getattr

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "save": ".api",
    "load": ".api",
    "Checkpointer": ".checkpointer",
    "list_checkpoints": ".checkpointer",
    "SaveOptions": ".options",
    "LoadOptions": ".options",
    "TierOptions": ".options",
    "SaveHandle": ".saving.request",
    "SaveStats": ".saving.request",
    "LoadStats": ".loading.stats",
    "Shard": ".state.leaves",
    "PerRank": ".state.leaves",
    "RNGState": ".state.rng",
    "CheckpointMetadata": ".format.metadata",
    "FORMAT_VERSION": ".format.metadata",
    "UnickptError": ".errors",
    "CheckpointNotFoundError": ".errors",
    "CheckpointExistsError": ".errors",
    "FormatVersionError": ".errors",
    "StateMismatchError": ".errors",
    "ReplicaMismatchError": ".errors",
    "IntegrityError": ".errors",
    "StorageError": ".errors",
    "PerRankReshardError": ".errors",
    "UnsafeObjectError": ".errors",
    "RankFailuresError": ".errors",
    "SaveFailedError": ".errors",
    "EarlierSaveFailedError": ".errors",
    "LoadFailedError": ".errors",
    "SyncError": ".errors",
    "Mapping": ".plan.mapping",
    "Rename": ".plan.mapping",
    "Split": ".plan.mapping",
    "Fuse": ".plan.mapping",
    "Permute": ".plan.mapping",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from .api import load, save
    from .checkpointer import Checkpointer, list_checkpoints
    from .errors import (CheckpointExistsError, CheckpointNotFoundError, EarlierSaveFailedError,
                         FormatVersionError, IntegrityError, LoadFailedError, PerRankReshardError,
                         RankFailuresError, ReplicaMismatchError, SaveFailedError, StateMismatchError,
                         StorageError, SyncError, UnickptError, UnsafeObjectError)
    from .format.metadata import FORMAT_VERSION, CheckpointMetadata
    from .loading.stats import LoadStats
    from .options import LoadOptions, SaveOptions, TierOptions
    from .plan.mapping import Fuse, Mapping, Permute, Rename, Split
    from .saving.request import SaveHandle, SaveStats
    from .state.leaves import PerRank, Shard
    from .state.rng import RNGState
