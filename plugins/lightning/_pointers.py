"""The pointer layout: where a *sharded-route* Lightning checkpoint lives on storage (and where
full-dict checkpoints lived before :mod:`._pack`; those are still read).

Lightning names checkpoints by path (``.../epoch=3-step=400.ckpt``, ``last.ckpt``) and overwrites
``last.ckpt`` in place. A unickpt checkpoint is a directory that is never modified after its
commit. The two meet like this, for a Lightning path ``P``::

    P/                              a directory, as Lightning's own sharded checkpoints are
    P/unickpt-lightning.json        the pointer: a small JSON file, written atomically after the commit
    P/step_<v>/                     the unickpt checkpoints (versions) of P; the pointer names one

so a listing of ``P``'s folder shows ``P`` alone, as with Lightning's own IO, and ``P`` is copied,
moved or removed as a whole. Earlier releases wrote the pointer as the file ``P`` itself and the
versions beside it, in ``P.unickpt/step_<v>/``; such checkpoints still load, and their next saves
keep that layout (as do saves to a path holding another file, e.g. a ``torch.save`` checkpoint:
its replacement by a directory would not be atomic). :func:`data_root` tells which.

The pointer is ``{"format": "unickpt-lightning", "format_version": 1, "checkpoint":
"<name>/step_<v>", "route": "io" | "sharded", "global_step": int, "tensors_from": null |
"<other name>/step_<u>"}`` (earlier layout: ``<name>.unickpt/step_<v>``); the paths are relative
to the directory holding ``P``, so a checkpoint folder can be moved or copied as a whole.
``tensors_from`` marks a *link* (earlier releases only): a save whose tensors were identical to an
earlier save of a sibling path (``save_last`` after a top-k save) stored only its non-tensor state
and reads its tensors from there.

Overwriting ``P`` writes version ``v + 1``, commits it, replaces the pointer, then deletes the
older versions: a crash at any point leaves ``P`` naming a committed checkpoint. Lightning's fsspec
checks (``exists``, ``ls``, ``modified``: ``ModelCheckpoint``'s version counter and
``ckpt_path="last"``) work unchanged on local disks and object stores.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from unickpt import ext

__all__ = ["Pointer", "pointer_from_doc", "data_root", "old_data_root", "version_dir", "relative", "resolve",
           "read_pointer", "write_pointer", "is_pointer", "claims_format", "versions", "siblings_linking_to",
           "POINTER_FORMAT", "POINTER_NAME"]

POINTER_FORMAT = "unickpt-lightning"
POINTER_VERSION = 1
DATA_SUFFIX = ".unickpt"  # the earlier layout's data directory, P.unickpt
POINTER_NAME = "unickpt-lightning.json"  # the pointer inside the directory P
_MAX_POINTER_BYTES = 1 << 16


@dataclass
class Pointer:
    """The contents of a pointer file (see the module docstring)."""

    checkpoint: str  # relative to the pointer's directory
    route: str = "io"
    global_step: int | None = None
    tensors_from: str | None = None

    def to_bytes(self) -> bytes:
        return json.dumps({"format": POINTER_FORMAT, "format_version": POINTER_VERSION, "checkpoint": self.checkpoint,
                           "route": self.route, "global_step": self.global_step,
                           "tensors_from": self.tensors_from}, indent=1).encode()


def _parent(path: str) -> str:
    return posixpath.dirname(path.rstrip("/"))


def _name(path: str) -> str:
    return posixpath.basename(path.rstrip("/"))


def old_data_root(path: str) -> str:
    """``P.unickpt``: the directory of the versions of ``P`` in the earlier layout."""
    return path.rstrip("/") + DATA_SUFFIX


def data_root(storage: ext.StorageBackend, path: str) -> str:
    """The directory of the versions of Lightning path ``P``: ``P`` itself (a directory, or nothing
    yet), or ``P.unickpt`` where ``P`` is a file (a pointer of the earlier layout, or another file that
    only an atomic replacement may overwrite) or ``P.unickpt`` exists (the earlier layout, its pointer
    removed)."""
    if storage.isdir(path):
        return path.rstrip("/")
    if storage.exists(path) or storage.exists(old_data_root(path)):
        return old_data_root(path)
    return path.rstrip("/")


def version_dir(storage: ext.StorageBackend, path: str, version: int) -> str:
    """``<data root>/step_<version>`` (:func:`data_root` is a checkpoint root,
    :class:`unickpt.ext.CheckpointRoot`)."""
    return f"{data_root(storage, path)}/{ext.CheckpointRoot.step_name(version)}"


def _pointer_file(storage: ext.StorageBackend, path: str) -> str:
    """Where the pointer of ``P`` is: ``P/unickpt-lightning.json`` in a directory ``P``, else ``P``."""
    return f"{path.rstrip('/')}/{POINTER_NAME}" if storage.isdir(path) else path


def relative(path: str, target: str) -> str:
    """``target`` relative to the directory of pointer ``path`` (both in the same directory tree)."""
    parent = _parent(path)
    if parent and target.startswith(parent + "/"):
        return target[len(parent) + 1:]
    return target


def resolve(path: str, rel: str) -> str:
    """Inverse of :func:`relative`."""
    if "://" in rel or rel.startswith("/"):
        return rel
    parent = _parent(path)
    return f"{parent}/{rel}" if parent else rel


def read_pointer(storage: ext.StorageBackend, path: str) -> Pointer:
    """Parse the pointer of Lightning path ``path`` (the file ``path``, or ``path/unickpt-lightning.json``
    in a directory ``path``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a unickpt-lightning checkpoint (e.g. a ``torch.save`` ``.ckpt`` or a
            Lightning sharded directory), naming the path and what was found.
    """
    file = _pointer_file(storage, path)
    if file != path and not storage.exists(file):
        raise ValueError(f"{path!r} is a directory, not a unickpt-lightning checkpoint (no {POINTER_NAME} in it: a "
                         "Lightning sharded checkpoint written without unickpt? load it without UnickptCheckpointIO)")
    if storage.size(file) > _MAX_POINTER_BYTES:
        raise ValueError(f"{path!r} is not a unickpt-lightning checkpoint pointer ({storage.size(file)} bytes; "
                         "a torch.save checkpoint? load it without UnickptCheckpointIO)")
    raw = storage.read_bytes(file)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        raise ValueError(f"{path!r} is not a unickpt-lightning checkpoint pointer (expected a JSON file with "
                         f"format={POINTER_FORMAT!r}; a torch.save checkpoint? load it without UnickptCheckpointIO)")
    if doc.get("format_version") != POINTER_VERSION:
        raise ValueError(f"{path!r}: pointer format_version {doc.get('format_version')!r}, this release reads "
                         f"{POINTER_VERSION}")
    return pointer_from_doc(path, doc)


def pointer_from_doc(path: str, doc: dict) -> Pointer:
    """Check the fields of a parsed pointer ``doc`` of ``path`` and return its :class:`Pointer`.

    Raises:
        ValueError: a field is missing or has the wrong type / value, naming the field, the expected
            and the actual value (a pointer edited by hand or truncated).
    """
    def bad(field: str, expected: str) -> ValueError:
        actual = repr(doc[field]) if field in doc else "missing"
        return ValueError(f"{path!r}: damaged unickpt-lightning pointer: field {field!r} must be {expected}, "
                          f"got {actual}")

    checkpoint = doc.get("checkpoint")
    if not isinstance(checkpoint, str) or not checkpoint:
        raise bad("checkpoint", "the relative path of a checkpoint version ('<name>/step_<v>')")
    route = doc.get("route", "io")
    if route not in ("io", "sharded"):
        raise bad("route", "'io' or 'sharded'")
    step = doc.get("global_step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise bad("global_step", "an integer or null")
    tensors_from = doc.get("tensors_from")
    if tensors_from is not None and (not isinstance(tensors_from, str) or not tensors_from):
        raise bad("tensors_from", "null or the relative path of a checkpoint version")
    return Pointer(checkpoint=checkpoint, route=route, global_step=step, tensors_from=tensors_from)


def is_pointer(storage: ext.StorageBackend, path: str) -> bool:
    """Whether ``path`` is a readable unickpt-lightning pointer file."""
    try:
        read_pointer(storage, path)
        return True
    except (OSError, ValueError):
        return False


def claims_format(storage: ext.StorageBackend, path: str) -> bool:
    """Whether ``path`` has a small pointer file that says it is a unickpt-lightning pointer (readable
    or damaged: a reader then raises :func:`read_pointer`'s clear error instead of another format's)."""
    try:
        file = _pointer_file(storage, path)
        if storage.isdir(file) or storage.size(file) > _MAX_POINTER_BYTES:
            return False
        doc = json.loads(storage.read_bytes(file))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == POINTER_FORMAT


def write_pointer(storage: ext.StorageBackend, path: str, pointer: Pointer) -> None:
    """Atomically make ``path`` name ``pointer`` (local: temporary file + rename; object stores: one
    PUT): the pointer file inside the directory ``path``, or the file ``path`` of the earlier layout."""
    file = _pointer_file(storage, path)
    parent = _parent(file)
    if parent:
        storage.makedirs(parent)
    storage.write_atomic(file, pointer.to_bytes())


def versions(storage: ext.StorageBackend, path: str) -> list[int]:
    """Version numbers ``v`` of every ``step_<v>`` directory of ``path`` (:func:`data_root`), committed
    or not, sorted."""
    return [v for v, _ in ext.CheckpointRoot(data_root(storage, path), storage=storage).list()]


def siblings_linking_to(storage: ext.StorageBackend, path: str) -> list[str]:
    """Checkpoints in ``path``'s directory (other than ``path``) whose pointer's ``tensors_from`` lies
    in ``path``'s data root (links that still need ``path``'s tensors)."""
    parent = _parent(path)
    root_rel = relative(path, data_root(storage, path))
    out = []
    for name in storage.listdir(parent) if parent else []:
        other = f"{parent}/{name}"
        if other == path.rstrip("/") or name.endswith(DATA_SUFFIX):
            continue
        try:
            p = read_pointer(storage, other)
        except (OSError, ValueError):
            continue
        if p.tensors_from and (p.tensors_from == root_rel or p.tensors_from.startswith(root_rel + "/")):
            out.append(other)
    return out
