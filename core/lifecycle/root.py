"""A checkpoint root: ``root/step_<N>/`` checkpoints, the ``latest`` pointer, retention and removal.

The rules (docs/format.md):

- a step directory is named ``step_<N>`` (``N`` without leading zeros: ``step_01`` is not one; read
  as step 1 it would alias ``step_1``, and retention could remove the other directory under that
  step's name);
- ``root/latest`` holds the name of the newest committed checkpoint and is written (atomically) only
  after that checkpoint's commit; a rewrite never moves it back past a newer commit;
- retention keeps the newest ``keep_last`` committed checkpoints (never the newest one), and removes
  leftovers (:func:`~unickpt.lifecycle.directory.leftover_reason`: failed saves and those of a gone
  writer, whatever their step; those without a writer record when older than the newest commit),
  but never a directory still being written (this process, or a live writer per its record) nor one
  holding anything unickpt did not write; removal uncommits first
  (:func:`unickpt.lifecycle.directory.remove_dir`);
- a listing, or a look at a ``metadata.json``, that fails (other than "not found") raises
  :class:`~unickpt.errors.StorageError`: never "no checkpoint", never "uncommitted".

Who calls what: the :class:`~unickpt.Checkpointer`'s commit callback (group rank 0, commit thread)
runs :meth:`CheckpointRoot.retain`; ``unickpt rm`` / ``unickpt prune`` run :func:`remove_checkpoint`
/ :meth:`CheckpointRoot.prune`; framework plugins use the same root for their own layouts. No
collective.
"""
from __future__ import annotations

import builtins
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import StorageError, UnickptError
from ..format.files import METADATA_FILE
from ..storage import open_storage
from ..storage.base import StorageBackend
from .directory import CheckpointDir, check_removable, is_committed, leftover_reason, remove_dir

log = logging.getLogger("unickpt")

__all__ = ["STEP_DIR", "LATEST_FILE", "CheckpointRoot", "Removal", "list_checkpoints", "remove_checkpoint",
           "prune_checkpoints", "step_of", "step_name"]

STEP_DIR = re.compile(r"^step_(0|[1-9][0-9]*)$")
LATEST_FILE = "latest"


def step_name(step: int) -> str:
    """``step_<N>``: the directory name of step ``N``."""
    return f"step_{int(step)}"


def step_of(path: str) -> tuple[str, int | None]:
    """``(root, N)`` for a path ``root/step_<N>``, else ``(parent, None)``."""
    root, _, name = path.rstrip("/").rpartition("/")
    m = STEP_DIR.match(name)
    return root, int(m.group(1)) if m else None


@dataclass(frozen=True)
class Removal:
    """One directory removed (or, for a dry run, that would be): its path, step (None outside a
    ``step_<N>`` name), whether it was committed, and why."""

    path: str
    step: int | None
    committed: bool
    reason: str


class CheckpointRoot:
    """The checkpoints under one root (see the module docstring).

    Args:
        root: a local directory or fsspec URL.
        storage_options: fsspec options.
        storage: an already opened backend for ``root`` (else one is opened).
    """

    LATEST_FILE = LATEST_FILE
    """The root's pointer file (``latest``): the name of the newest committed checkpoint."""
    step_name = staticmethod(step_name)

    def __init__(self, root: str | os.PathLike, storage_options: dict | None = None,
                 storage: StorageBackend | None = None):
        self.root = os.fspath(root)
        self.storage_options = storage_options
        self.storage = storage if storage is not None else open_storage(self.root, storage_options)

    def path(self, name: str | int) -> str:
        """The path of the entry ``name`` (an int: the step directory ``step_<N>``)."""
        return self.storage.join(self.root, step_name(name) if isinstance(name, int) else name)

    def dir(self, name: str | int) -> CheckpointDir:
        """The :class:`~unickpt.lifecycle.directory.CheckpointDir` of the entry ``name`` (an int: ``step_<N>``)."""
        return CheckpointDir(self.storage, self.path(name))

    def writing(self, in_flight: Callable[[str], bool]) -> bool:
        """Whether a save may still be writing into this root: an uncommitted ``step_<N>`` that
        ``in_flight(path)`` (a save of this process) or whose writer may be alive. Raises StorageError
        when the listing fails."""
        return any(not ok and (in_flight(self.path(s)) or self.dir(s).writer_alive()) for s, ok in self.list())

    # -- listing ----------------------------------------------------------------------------------
    def list(self) -> list[tuple[int, bool]]:
        """``[(step, committed), ...]`` for every ``step_<N>`` directory, by step ([] for a root that
        does not exist). Raises StorageError (naming the path and the cause) when the listing, or the
        look at a ``metadata.json``, fails otherwise."""
        try:
            names = self.storage.listdir(self.root)
        except OSError as e:
            raise StorageError(f"cannot list {self.root!r}: {e}; refusing to read it as holding no checkpoint",
                               self.root, e) from e
        out = []
        for name in names:
            m = STEP_DIR.match(name)
            if m:
                path = self.storage.join(self.root, name)
                try:
                    out.append((int(m.group(1)), is_committed(self.storage, path)))
                except OSError as e:
                    raise StorageError(f"cannot tell whether {path!r} is committed: {e}", path, e) from e
        return sorted(out)

    def committed_steps(self) -> builtins.list[int]:  # `list` is the method above, in this class
        return [s for s, ok in self.list() if ok]

    def newest_committed(self) -> int | None:
        """The newest committed step, by scanning for ``metadata.json`` (not by ``latest``)."""
        steps = self.committed_steps()
        return max(steps) if steps else None

    # -- the latest pointer -------------------------------------------------------------------------
    def read_latest(self) -> str | None:
        """The name ``latest`` holds, or None (no pointer, or unreadable)."""
        try:
            return self.storage.read_bytes(self.storage.join(self.root, LATEST_FILE)).decode().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def write_latest(self, name: str) -> None:
        """Point ``latest`` at ``name`` atomically (call only after ``name`` committed)."""
        self.storage.write_atomic(self.storage.join(self.root, LATEST_FILE), name.encode())

    def update_latest(self) -> None:
        """Point ``latest`` at the newest committed ``step_<N>`` (remove it when there is none).

        ``latest`` is left alone while it names a committed checkpoint at least as new as every one
        listed here: a save committing step N+1 meanwhile (and writing ``latest``) is never undone
        by this rewrite to an older step."""
        committed = self.committed_steps()
        named = self.read_latest()
        current = step_of(named)[1] if named else None
        if current is not None and is_committed(self.storage, self.path(current)) \
                and (not committed or current >= max(committed)):
            return
        if committed:
            self.write_latest(step_name(max(committed)))
        else:
            self.storage.rm(self.storage.join(self.root, LATEST_FILE))

    # -- retention ----------------------------------------------------------------------------------
    def retain(self, keep_last: int | None, newest: int, in_flight: Callable[[str], bool]) -> None:
        """After ``newest`` committed: point ``latest`` at the newest committed step, then remove the
        committed steps beyond ``keep_last`` (never the newest) and the leftovers
        (:func:`~unickpt.lifecycle.directory.leftover_reason`: not in flight here, nothing foreign
        inside; a failed save's or a gone writer's whatever its step, one without a writer record
        when older than ``newest``)."""
        entries = self.list()
        committed = [s for s, ok in entries if ok]
        if not committed:
            return
        self.write_latest(step_name(max(committed)))
        doomed = [s for s, ok in entries
                  if not ok and leftover_reason(self.storage, self.path(s), s < newest, in_flight)]
        if keep_last is not None:
            keep = set(committed[-keep_last:]) | {max(committed)}
            for s in committed:
                if s in keep:
                    continue
                try:
                    check_removable(self.storage, self.path(s))
                except UnickptError as e:  # a link, or files unickpt did not write: never removed
                    log.warning("unickpt: retention keeps %s: %s", self.path(s), e)
                    continue
                doomed.append(s)
        for s in doomed:
            remove_dir(self.storage, self.path(s))  # uncommitted first: a half-deleted directory never loads

    def prune(self, keep_last: int, *, dry_run: bool = False, skipped: builtins.list[str] | None = None) -> builtins.list[Removal]:
        """Retention by hand (``unickpt prune``): remove the oldest committed ``step_<N>`` beyond the
        newest ``keep_last`` (never the newest), and the leftovers of saves that failed or whose
        writer is gone, whatever their step (without a writer record: only older than the newest
        commit; :func:`~unickpt.lifecycle.directory.leftover_reason`). Directories holding foreign
        files, or being written, are skipped. Returns what was (``dry_run``: would be) removed,
        oldest first; ``skipped`` (when given) receives the reason for each directory due for
        removal that was kept (one line each). Raises StorageError when the listing fails."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if not self.storage.isdir(self.root):
            raise UnickptError(f"{self.root!r} is not a directory")
        entries = self.list()
        committed = [s for s, ok in entries if ok]
        keep = set(committed[-keep_last:])
        newest = max(committed, default=-1)
        out = []
        for step, ok in entries:
            path = self.path(step)
            if ok and step not in keep:
                reason: str | None = f"beyond the newest {keep_last}"
            elif not ok:
                try:
                    reason = leftover_reason(self.storage, path, step < newest)
                except FileNotFoundError:  # vanished while being looked at (a concurrent prune)
                    continue
                if reason is None and step < newest:  # due, but kept: check_removable says why
                    reason = "incomplete"
            else:
                continue
            if reason is None:
                continue
            try:
                check_removable(self.storage, path)
            except UnickptError as e:
                if not self.storage.exists(path):
                    continue  # removed meanwhile by someone else: nothing to do, nothing to report
                if skipped is not None:
                    skipped.append(str(e))
                continue
            except FileNotFoundError:  # vanished while being looked at (a concurrent prune)
                continue
            out.append(Removal(path, step, ok, reason))
            if not dry_run:
                remove_dir(self.storage, path)
        if out and not dry_run:
            self.update_latest()
        return out


def _resolved(path: str, storage: StorageBackend) -> str:
    """A local path resolved (relative paths, ``.``, symlinks), so the rules apply to the real directory."""
    return os.path.realpath(storage.strip(path)) if storage.is_local else path


def list_checkpoints(root: str, storage_options: dict | None = None) -> list[tuple[int, bool]]:
    """``[(step, committed), ...]`` for every ``step_<N>`` directory under ``root`` (``N`` without
    leading zeros, as :class:`~unickpt.Checkpointer` names them), by step."""
    return CheckpointRoot(root, storage_options).list()


def remove_checkpoint(path: str, *, force: bool = False, dry_run: bool = False,
                      storage_options: dict | None = None) -> Removal:
    """Remove the checkpoint directory ``path`` (committed or left by a crashed save).

    A local ``path`` is resolved first (relative paths, ``.``, symlinks: the target goes, a symlink
    itself stays), so the rules apply to the real directory: the newest committed ``step_<N>`` of
    its root needs ``force=True``; a directory being written or holding foreign files is refused
    even then. ``latest`` is updated afterwards. Raises UnickptError naming the reason for a refusal.
    """
    path = os.fspath(path).rstrip("/")
    storage = open_storage(path, storage_options)
    path = _resolved(path, storage)
    committed = check_removable(storage, path)
    root, step = step_of(path)
    owner = CheckpointRoot(root, storage_options, storage) if root else None
    if step is not None and committed and owner is not None:
        if step == owner.newest_committed() and not force:
            raise UnickptError(f"{path!r} is the newest committed checkpoint of {root!r}; use --force to remove it")
    removal = Removal(path, step, committed, "requested")
    if not dry_run:
        try:
            remove_dir(storage, path)
        finally:  # also when the tree could not be removed after the uncommit: `latest` never names it
            if step is not None and owner is not None and (committed or storage.exists(storage.join(root, LATEST_FILE))):
                owner.update_latest()
    return removal


def prune_checkpoints(root: str, keep_last: int, *, dry_run: bool = False, storage_options: dict | None = None,
                      skipped: builtins.list[str] | None = None) -> builtins.list[Removal]:
    """:meth:`CheckpointRoot.prune` of ``root`` (a local root resolved first)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = os.fspath(root).rstrip("/")
    storage = open_storage(root, storage_options)
    return CheckpointRoot(_resolved(root, storage), storage_options, storage).prune(keep_last, dry_run=dry_run,
                                                                                   skipped=skipped)
