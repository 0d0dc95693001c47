"""The versions of the pointer layout (:mod:`._pointers`) over time: publish, read, collect, remove.

A sharded-route save commits version ``v`` of ``P``, then :func:`publish_version` points ``P`` at it
and deletes the versions it replaces, except those a sibling *link* (earlier releases) still reads;
:func:`collect_link_target` deletes a version that only links read once none does. Group rank 0
reads a pointer for every rank (:func:`agree_pointer`). Full-dict checkpoints of earlier releases
(pointer file ``P`` beside ``P.unickpt/``) are collected by :func:`collect_old_layout` once ``P`` is a
pack, and removed by :func:`remove_pointer_checkpoint`.
"""
from __future__ import annotations

import json
from typing import Any

from unickpt import ext

from . import _pointers
from ._pointers import Pointer

__all__ = ["publish_version", "read_pointer_or_none", "rm_version", "collect_link_target", "collect_old_layout",
           "remove_pointer_checkpoint", "agree_pointer"]


def publish_version(path: str, version: int, pointer: Pointer, options: dict | None) -> None:
    """Sharded route, after the commit of ``version`` (background thread, group rank 0): point
    ``path`` at it, then delete the versions it replaces (keeping those that sibling links still read).
    Raises RuntimeError if ``pointer`` links to a checkpoint that did not commit (``path`` unchanged)."""
    storage = ext.open_storage(path, options)
    if pointer.tensors_from is not None:
        source = _pointers.resolve(path, pointer.tensors_from)
        if not ext.CheckpointDir(storage, source).is_committed():
            raise RuntimeError(f"{path!r}: the checkpoint it links to, {source!r}, did not commit; "
                               f"{path!r} was not updated")
    old = read_pointer_or_none(storage, path)
    _pointers.write_pointer(storage, path, pointer)
    keep = {_pointers.resolve(other, p.tensors_from)
            for other in _pointers.siblings_linking_to(storage, path)
            for p in [_pointers.read_pointer(storage, other)] if p.tensors_from is not None}
    for v in _pointers.versions(storage, path):
        vdir = _pointers.version_dir(storage, path, v)
        if v < version and vdir not in keep:
            rm_version(storage, vdir)
    if old is not None and old.tensors_from and old.tensors_from != pointer.tensors_from:
        collect_link_target(storage, path, _pointers.resolve(path, old.tensors_from))


def remove_pointer_checkpoint(storage: ext.StorageBackend, path: str) -> None:
    """Remove the pointer-layout checkpoint ``path``: its pointer, then its versions, except those that a
    sibling link still reads (then the version its own link read, if nothing else needs it)."""
    pointer = read_pointer_or_none(storage, path)
    if pointer is None:
        if storage.exists(path):
            storage.rm(path)
        return
    storage.rm(path)
    if not _pointers.siblings_linking_to(storage, path):
        storage.rm(_pointers.data_root(storage, path))
    else:
        keep = {_pointers.resolve(o, p.tensors_from)
                for o in _pointers.siblings_linking_to(storage, path)
                for p in [_pointers.read_pointer(storage, o)] if p.tensors_from is not None}
        for v in _pointers.versions(storage, path):
            if _pointers.version_dir(storage, path, v) not in keep:
                rm_version(storage, _pointers.version_dir(storage, path, v))
    if pointer.tensors_from:
        collect_link_target(storage, path, _pointers.resolve(path, pointer.tensors_from))


def collect_old_layout(path: str, options: dict | None) -> None:
    """Delete ``P.unickpt`` (the data of the pointer layout) once ``path`` no longer is a pointer and
    no sibling link reads it."""
    storage = ext.open_storage(path, options)
    root = _pointers.old_data_root(path)
    if storage.exists(root) and not _pointers.siblings_linking_to(storage, path):
        storage.rm(root)


def read_pointer_or_none(storage: ext.StorageBackend, path: str) -> Pointer | None:
    """The pointer at ``path``, or None (missing, unreadable or damaged)."""
    try:
        return _pointers.read_pointer(storage, path)
    except (OSError, ValueError):
        return None


def rm_version(storage: ext.StorageBackend, vdir: str) -> None:
    """Delete the version directory ``vdir``."""
    ext.CheckpointDir(storage, vdir).remove()  # uncommitted first: a half-deleted version is never loadable


def collect_link_target(storage: ext.StorageBackend, link_path: str, target_vdir: str) -> None:
    """Delete ``target_vdir`` (a version another path's link read) once nothing needs it: its own
    pointer names another version (or is gone) and no sibling link reads it."""
    owner = target_vdir.rsplit("/", 1)[0]
    if not owner.endswith(_pointers.DATA_SUFFIX):
        return
    owner_path = owner[: -len(_pointers.DATA_SUFFIX)]
    current = read_pointer_or_none(storage, owner_path)
    if current is not None and _pointers.resolve(owner_path, current.checkpoint) == target_vdir:
        return
    for other in _pointers.siblings_linking_to(storage, owner_path):
        p = read_pointer_or_none(storage, other)
        if p is not None and p.tensors_from and _pointers.resolve(other, p.tensors_from) == target_vdir:
            return
    rm_version(storage, target_vdir)
    if current is None and not _pointers.versions(storage, owner_path):
        storage.rm(owner)


def agree_pointer(engine: Any, path: str, options: dict | None, foreign: tuple = ()) -> Pointer | None:
    """Group rank 0 reads the pointer (after its own pending saves committed) and every rank gets
    its reading, or the same error. ``foreign``: kinds of existing paths that are not unickpt
    pointers (``"file"``: e.g. a ``torch.save`` checkpoint; ``"dir"``: e.g. Lightning's own sharded
    checkpoint) for which every rank gets None instead of an error, so the caller reads them with
    Lightning's own reader."""
    result: Any = None
    if engine.rank == 0:
        storage = ext.open_storage(path, options)
        try:
            if not storage.exists(path):
                hint = ""
                if _pointers.versions(storage, path):
                    hint = (f" (its data directory {_pointers.data_root(storage, path)!r} exists: the pointer file was deleted "
                            "or never written, e.g. a crash before the first commit)")
                raise FileNotFoundError(f"no checkpoint at {path!r}{hint}")
            kind = "dir" if storage.isdir(path) else "file"
            if kind in foreign and not _pointers.claims_format(storage, path):
                result = ("foreign",)
            else:
                result = ("ok", _pointers.read_pointer(storage, path).to_bytes())
        except Exception as e:  # noqa: BLE001 - every rank must get it, or the others wait in the broadcast
            result = ("error", type(e).__name__, str(e))
    result = engine.broadcast(result)
    if result[0] == "foreign":
        return None
    if result[0] == "error":
        cls = {"FileNotFoundError": FileNotFoundError, "PermissionError": PermissionError}.get(result[1], ValueError)
        raise cls(result[2])
    return _pointers.pointer_from_doc(path, json.loads(result[1]))

