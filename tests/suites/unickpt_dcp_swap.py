"""pytest plugin for ``torch_dcp.py --mode unickpt``: DCP's ``FileSystemWriter`` / ``FileSystemReader``
replaced by unickpt's ``StorageWriter`` / ``StorageReader`` wherever PyTorch's tests reach them.

Loaded with ``pytest -p unickpt_dcp_swap`` (the suite runner copies it into a scratch directory on ``PYTHONPATH``),
so it is imported before any test module. The multi-process test bases (``MultiProcessTestCase``:
``ShardedTensorTestBase``, ``DTensorTestBase``) run each rank in a *spawned* child that does not load
pytest plugins; the runner therefore also puts a ``sitecustomize.py`` on the children's
``PYTHONPATH`` that calls :func:`install` when ``UNICKPT_DCP_SWAP=1``.

Swapped names: ``torch.distributed.checkpoint.FileSystemWriter`` / ``FileSystemReader`` (as ``dcp.X``
and ``from torch.distributed.checkpoint import X``), ``torch.distributed.checkpoint.filesystem.X``,
the default selection for a ``checkpoint_id`` path (``_storage_utils._storage_setup``) and
``format_utils``' writer and reader (``torch_save_to_dcp``, ``dcp_to_torch_save``). The replacements take FileSystemWriter's and
FileSystemReader's constructor arguments; those that tune DCP's own file layout (``thread_count``,
``single_file_per_rank``, ``sync_files``, ``per_thread_copy_ahead``, ``cache_staged_state_dict``,
``_extensions``, ``serialization_format``, ``_extension_registry``) have no counterpart in unickpt's
format and are accepted and ignored (unickpt's own writer threads, fsync and checksums apply).
``overwrite=False`` is honoured (an existing checkpoint raises, as DCP's writer does).
"""
from __future__ import annotations

import os
from typing import Any

_INSTALLED = False


def _classes() -> tuple[type, type]:
    import unickpt.fsdp

    class FileSystemWriter(unickpt.fsdp.StorageWriter):
        """unickpt's StorageWriter with DCP FileSystemWriter's constructor."""

        def __init__(self, path: Any, single_file_per_rank: bool = True, sync_files: bool = True,
                     thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                     cache_staged_state_dict: bool = False, overwrite: bool = True,
                     _extensions: Any = None, serialization_format: Any = None, **kwargs: Any) -> None:
            super().__init__(path, overwrite=overwrite)

    class FileSystemReader(unickpt.fsdp.StorageReader):
        """unickpt's StorageReader with DCP FileSystemReader's constructor."""

        def __init__(self, path: Any, _extension_registry: Any = None, **kwargs: Any) -> None:
            super().__init__(path)

    return FileSystemWriter, FileSystemReader


def install() -> None:
    """Replace DCP's filesystem writer and reader by unickpt's (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _storage_utils, filesystem, format_utils

    writer, reader = _classes()
    for mod in (dcp, filesystem, _storage_utils):
        mod.FileSystemWriter = writer
        mod.FileSystemReader = reader
    format_utils.FileSystemWriter = writer
    format_utils.FileSystemReader = reader
    _INSTALLED = True


if os.environ.get("UNICKPT_DCP_SWAP") == "1":
    install()
