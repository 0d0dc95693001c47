"""Removing checkpoints by hand (``unickpt rm``, ``unickpt prune``) under the commit rules.

The rules (the same as :class:`~unickpt.Checkpointer`'s retention, see docs/format.md):

- a checkpoint is uncommitted first (``metadata.json`` goes), then its directory, so a
  half-deleted directory is never loadable;
- a directory whose writer may still be running (see :func:`unickpt.metadata.writer_alive`) is
  never touched, nor one holding anything a unickpt save does not write;
- the newest committed checkpoint of a root is kept unless forced, and ``latest`` is rewritten to
  the newest committed checkpoint that remains (removed when none remains).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass

from .checkpointer import LATEST_FILE, STEP_DIR, list_checkpoints
from .errors import UnickptError
from .metadata import METADATA_FILE, WRITER_FILE, writer_alive
from .storage import Storage

__all__ = ["Removal", "remove_checkpoint", "prune_checkpoints", "update_latest", "step_of"]

_ENTRIES = re.compile(r"^(data|objects|metadata\.json|metadata\.json\.tmp-[0-9a-f]+|" + re.escape(WRITER_FILE) + r")$")
_FILES = {"data": re.compile(r"^\d+_\d+\.bin$"), "objects": re.compile(r"^rank_\d+\.json$")}


@dataclass(frozen=True)
class Removal:
    """One directory removed (or, for a dry run, that would be): its path, step (None outside a
    ``step_<N>`` name), whether it was committed, and why."""

    path: str
    step: int | None
    committed: bool
    reason: str


def step_of(path: str) -> tuple[str, int | None]:
    """``(root, N)`` for a path ``root/step_<N>``, else ``(parent, None)``."""
    root, _, name = path.rstrip("/").rpartition("/")
    m = STEP_DIR.match(name)
    return root, int(m.group(1)) if m else None


def _foreign_entry(storage: Storage, path: str) -> str | None:
    """The first entry of ``path`` a unickpt save does not write, or None."""
    for name in sorted(storage.listdir(path)):
        if not _ENTRIES.match(name):
            return name
        if name in _FILES:
            sub = storage.join(path, name)
            if not storage.isdir(sub):
                return name
            bad = [f for f in storage.listdir(sub) if not _FILES[name].match(f)]
            if bad:
                return f"{name}/{sorted(bad)[0]}"
    return None


def _check_removable(storage: Storage, path: str) -> bool:
    """Raise UnickptError unless ``path`` is a unickpt checkpoint directory nobody is writing.
    Returns whether it is committed."""
    if storage.is_local and os.path.islink(storage.strip(path)):  # prune: its target may be another run's
        raise UnickptError(f"{path!r} is a symbolic link to {os.readlink(storage.strip(path))!r}; "
                           "not removing it or its target")
    if not storage.isdir(path):
        raise UnickptError(f"{path!r} is not a directory")
    foreign = _foreign_entry(storage, path)
    if foreign is not None:
        raise UnickptError(f"{path!r} holds {foreign!r}, which no unickpt save writes; not removing it")
    committed = storage.exists(storage.join(path, METADATA_FILE))
    if not committed and writer_alive(storage, path):
        raise UnickptError(f"{path!r} is being written by a live process (see its {WRITER_FILE}); not removing it")
    return committed


def _delete(storage: Storage, path: str) -> None:
    """Uncommit ``path`` (remove ``metadata.json``), then remove its tree. Entries that vanish
    meanwhile (another ``prune``/``rm``, or a Checkpointer's retention, removing it too) are fine."""
    if not storage.is_local:
        storage.rm(storage.join(path, METADATA_FILE))  # uncommit first
        storage.rm(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(storage.strip(storage.join(path, METADATA_FILE)))  # uncommit first

    def gone_is_fine(func, name, exc_info):
        if not issubclass(exc_info[0], FileNotFoundError):
            raise exc_info[1]

    shutil.rmtree(storage.strip(path), onerror=gone_is_fine)


def update_latest(storage: Storage, root: str, storage_options: dict | None = None) -> None:
    """Point ``root/latest`` at the newest committed ``step_<N>`` under ``root`` (remove it when there is none).

    ``latest`` is left alone while it names a committed checkpoint at least as new as every one
    listed here: a save committing step N+1 meanwhile (and writing ``latest``) is never undone by
    this rewrite to an older step."""
    committed = [s for s, ok in list_checkpoints(root, storage_options) if ok]
    latest = storage.join(root, LATEST_FILE)
    try:
        current = step_of(storage.read_bytes(latest).decode().strip())[1]
    except (OSError, UnicodeDecodeError):
        current = None
    if current is not None and storage.exists(storage.join(root, f"step_{current}", METADATA_FILE)) \
            and (not committed or current >= max(committed)):
        return
    if committed:
        storage.write_atomic(latest, f"step_{max(committed)}".encode())
    else:
        storage.rm(latest)


def remove_checkpoint(path: str, *, force: bool = False, dry_run: bool = False,
                      storage_options: dict | None = None) -> Removal:
    """Remove the checkpoint directory ``path`` (committed or left by a crashed save).

    A local ``path`` is resolved first (relative paths, ``.``, symlinks: the target goes, a symlink
    itself stays), so the rules apply to the real directory: the newest committed ``step_<N>`` of
    its root needs ``force=True``; a directory being written or holding foreign files is refused
    even then. ``latest`` is updated afterwards. Raises UnickptError naming the reason for a refusal.
    """
    path = os.fspath(path).rstrip("/")
    storage = Storage(path, storage_options)
    if storage.is_local:  # `step_3`, `run/step_3/.`, a symlink: the real directory, so its root is known
        path = os.path.realpath(storage.strip(path))
    committed = _check_removable(storage, path)
    root, step = step_of(path)
    if step is not None and committed and root:
        newest = max(s for s, ok in list_checkpoints(root, storage_options) if ok)
        if step == newest and not force:
            raise UnickptError(f"{path!r} is the newest committed checkpoint of {root!r}; use --force to remove it")
    removal = Removal(path, step, committed, "requested")
    if not dry_run:
        try:
            _delete(storage, path)
        finally:  # also when the tree could not be removed after the uncommit: `latest` never names it
            if step is not None and root and (committed or storage.exists(storage.join(root, LATEST_FILE))):
                update_latest(storage, root, storage_options)
    return removal


def prune_checkpoints(root: str, keep_last: int, *, dry_run: bool = False,
                      storage_options: dict | None = None, skipped: list[str] | None = None) -> list[Removal]:
    """Retention for the root ``root``: remove the oldest committed ``step_<N>`` beyond the newest
    ``keep_last`` (never the newest), and incomplete ones older than the newest commit whose writer
    is dead (crashed saves). Directories holding foreign files, or being written, are skipped.
    Returns what was (``dry_run``: would be) removed, oldest first; ``skipped`` (when given)
    receives the reason for each directory due for removal that was kept (one line each)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = os.fspath(root).rstrip("/")
    storage = Storage(root, storage_options)
    if storage.is_local:
        root = os.path.realpath(storage.strip(root))
    if not storage.isdir(root):
        raise UnickptError(f"{root!r} is not a directory")
    entries = list_checkpoints(root, storage_options)
    committed = [s for s, ok in entries if ok]
    if not committed:
        return []
    keep = set(committed[-keep_last:])
    out = []
    for step, ok in entries:
        path = storage.join(root, f"step_{step}")
        if ok and step not in keep:
            reason = f"beyond the newest {keep_last}"
        elif not ok and step < max(committed):
            reason = "incomplete (crashed save)"
        else:
            continue
        try:
            _check_removable(storage, path)
        except UnickptError as e:
            if not storage.exists(path):
                continue  # removed meanwhile by someone else: nothing to do, nothing to report
            if skipped is not None:
                skipped.append(str(e))
            continue
        except FileNotFoundError:  # vanished while being looked at (a concurrent prune)
            continue
        out.append(Removal(path, step, ok, reason))
        if not dry_run:
            _delete(storage, path)
    if out and not dry_run:
        update_latest(storage, root, storage_options)
    return out
