"""unickpt: unified, high-performance distributed checkpointing for PyTorch.

Public surface::

    unickpt.save(path, state, async_save=False, process_group=None, storage_options=None) -> SaveHandle
    unickpt.load(path, state, strict=True, process_group=None, storage_options=None)
    unickpt.Checkpointer(root, keep_last=None, async_save=True, ...)
    unickpt.Shard, unickpt.PerRank, unickpt.RNGState
"""
from .api import load, save
from .checkpointer import Checkpointer, list_checkpoints
from .engine import SaveHandle, SaveStats
from .errors import (CheckpointExistsError, CheckpointNotFoundError, FormatVersionError, IntegrityError,
                     LoadFailedError, PerRankReshardError, SaveFailedError, StateMismatchError, UnickptError, UnsafeObjectError)
from .reader import LoadStats
from .metadata import FORMAT_VERSION, CheckpointMetadata
from .rng import RNGState
from .types import PerRank, Shard

__version__ = "0.1.0"

__all__ = [
    "save",
    "load",
    "Checkpointer",
    "list_checkpoints",
    "SaveHandle",
    "SaveStats",
    "LoadStats",
    "Shard",
    "PerRank",
    "RNGState",
    "CheckpointMetadata",
    "FORMAT_VERSION",
    "UnickptError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "FormatVersionError",
    "StateMismatchError",
    "IntegrityError",
    "PerRankReshardError",
    "UnsafeObjectError",
    "SaveFailedError",
    "LoadFailedError",
]
