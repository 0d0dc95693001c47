"""unickpt: unified, high-performance distributed checkpointing for PyTorch.

Public surface::

    unickpt.save(path, state, async_save=False, process_group=None, storage_options=None) -> SaveHandle
    unickpt.load(path, state, strict=True, process_group=None, storage_options=None)
    unickpt.Checkpointer(root, keep_last=None, async_save=True, ...)
    unickpt.Shard, unickpt.PerRank, unickpt.RNGState

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
    "SaveHandle": ".engine",
    "SaveStats": ".engine",
    "LoadStats": ".reader",
    "Shard": ".types",
    "PerRank": ".types",
    "RNGState": ".rng",
    "CheckpointMetadata": ".metadata",
    "FORMAT_VERSION": ".metadata",
    "UnickptError": ".errors",
    "CheckpointNotFoundError": ".errors",
    "CheckpointExistsError": ".errors",
    "FormatVersionError": ".errors",
    "StateMismatchError": ".errors",
    "ReplicaMismatchError": ".errors",
    "IntegrityError": ".errors",
    "PerRankReshardError": ".errors",
    "UnsafeObjectError": ".errors",
    "SaveFailedError": ".errors",
    "LoadFailedError": ".errors",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from .api import load, save
    from .checkpointer import Checkpointer, list_checkpoints
    from .engine import SaveHandle, SaveStats
    from .errors import (CheckpointExistsError, CheckpointNotFoundError, FormatVersionError, IntegrityError,
                         LoadFailedError, PerRankReshardError, ReplicaMismatchError, SaveFailedError,
                         StateMismatchError, UnickptError, UnsafeObjectError)
    from .metadata import FORMAT_VERSION, CheckpointMetadata
    from .reader import LoadStats
    from .rng import RNGState
    from .types import PerRank, Shard
