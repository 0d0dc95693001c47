"""Which unickpt checkpoint a path names: the directory itself, the ``unickpt/`` folder a plugin keeps
beside a framework's own files, the checkpoint ``latest`` names, or what a plugin's locator finds.

Runs on the caller's thread; reads a few small files; no collective.
"""
from __future__ import annotations

from ..errors import StateMismatchError
from ..lifecycle.directory import CheckpointDir
from ..lifecycle.root import CheckpointRoot
from ..storage.base import StorageBackend
from . import entry_points

__all__ = ["SUBDIR", "locate_checkpoint"]

SUBDIR = "unickpt"
"""Plugins that keep unickpt's data beside a framework's own files put it in a subdirectory of this name
(Accelerate's ``checkpoint_<N>/unickpt/``: a root; Megatron's ``<iter dir>/unickpt``: a checkpoint)."""


def locate_checkpoint(path: str, storage: StorageBackend) -> str:
    """The unickpt checkpoint directory ``path`` names: ``path`` itself when it holds unickpt's
    ``metadata.json``; else ``path/unickpt``; else the checkpoint ``latest`` names in ``path`` or
    ``path/unickpt`` (a DeepSpeed ``save_dir``, an Accelerate folder, a checkpoint root); else what an
    installed locator finds (entry-point group ``unickpt.locators``: ``locate(path, storage) -> str |
    None``, e.g. Lightning's pointer files; a locator raises StateMismatchError for a checkpoint of its
    framework that cannot move, e.g. Lightning's full-dict packs, and that error is raised here); else
    ``path`` (the read then reports it)."""
    def is_ours(p: str) -> bool:
        return CheckpointDir(storage, p).is_unickpt()

    def latest(root: str) -> str | None:
        try:
            name = CheckpointRoot(root, storage=storage).read_latest()
        except (OSError, ValueError):
            return None
        return storage.join(root, name) if name else None

    inner = storage.join(path, SUBDIR)
    for candidate in (path, inner, latest(path), latest(inner)):
        if candidate is not None and is_ours(candidate):
            return candidate
    for locate in entry_points.load_all("unickpt.locators").values():
        try:
            found = locate(path, storage) if callable(locate) else None
        except StateMismatchError:  # a checkpoint the locator knows and refuses (a Lightning full-dict pack)
            raise
        except (OSError, ValueError):
            found = None
        if found is not None and is_ours(found):
            return found
    return path
