"""``Checkpointer``: numbered checkpoints under one root, ``latest``, retention, async saves."""
from __future__ import annotations

import os
import re
from typing import Any

from .engine import SaveHandle, get_engine
from .metadata import METADATA_FILE, is_incomplete_checkpoint, writer_alive
from .storage import Storage

__all__ = ["Checkpointer", "list_checkpoints"]

# the names this package writes (``step_{int(step)}``) only: ``step_01`` is not one; read as step 1 it
# would alias ``step_1``, and retention could remove the other directory under that step's name
STEP_DIR = re.compile(r"^step_(0|[1-9][0-9]*)$")
LATEST_FILE = "latest"


def list_checkpoints(root: str, storage_options: dict | None = None) -> list[tuple[int, bool]]:
    """``[(step, committed), ...]`` for every ``step_<N>`` directory under ``root`` (``N`` without
    leading zeros, as :class:`Checkpointer` names them), by step."""
    storage = Storage(root, storage_options)
    out = []
    for name in storage.listdir(root):
        m = STEP_DIR.match(name)
        if m:
            out.append((int(m.group(1)), storage.exists(storage.join(root, name, METADATA_FILE))))
    return sorted(out)


class Checkpointer:
    """Checkpoints of one training run, ``root/step_<N>/``, saved asynchronously by default.

    ``root/latest`` holds the name of the newest committed checkpoint (``step_<N>``) and is
    written only after that checkpoint's commit. Retention (``keep_last``) runs after a commit and
    deletes the oldest committed checkpoints beyond ``keep_last`` (never the newest) and
    incomplete directories older than the new commit (left by crashed saves).

    Args:
        root: a local directory or fsspec URL.
        keep_last: how many committed checkpoints to keep (None: all).
        async_save: default for :meth:`save`.
        process_group: the ranks taking part (default: world); every method but
            :meth:`latest_step` is collective.
        storage_options: passed to fsspec.
        allow_pickle: let saves store, and loads restore, plain values that only pickle can express.
        local_root: two-tier saving: write each checkpoint to this fast local directory, and upload
            it to ``root`` in the save's background pipeline (the remote copy is committed first,
            then the local one; ``latest`` and retention are kept in both). Loads prefer a
            committed local copy and fall back to ``root``.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, async_save: bool = True,
                 process_group: Any = None, storage_options: dict | None = None, allow_pickle: bool = False,
                 local_root: str | os.PathLike | None = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.root = os.fspath(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self._storage = Storage(self.root, storage_options)
        self.local_root = None if local_root is None else os.fspath(local_root)
        self._local = None if local_root is None else Storage(self.local_root)
        self._engine = get_engine(process_group)
        self._closed = False

    def path_for(self, step: int) -> str:
        return self._storage.join(self.root, f"step_{int(step)}")

    def _tiers(self) -> list[tuple[Storage, str, dict | None]]:
        """(storage, root, storage options) of each tier, remote first."""
        tiers = [(self._storage, self.root, self.storage_options)]
        if self._local is not None:
            tiers.append((self._local, self.local_root, None))
        return tiers

    def save(self, step: int, state: dict, *, async_save: bool | None = None) -> SaveHandle:
        """Save ``state`` as ``step``. Returns when snapshotted (async) or committed (sync).

        An earlier async save still in flight keeps draining; this one stages into the other
        staging pool. Raises CheckpointExistsError if ``step`` is already committed.
        """
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        on_commit = lambda s=int(step): self._after_commit(s)  # noqa: E731
        mode = self.async_save if async_save is None else async_save
        if self._local is None:
            return self._engine.save(self.path_for(step), state, async_save=mode, storage_options=self.storage_options,
                                     step=int(step), on_commit=on_commit, allow_pickle=self.allow_pickle)
        previous = self._engine.options  # the upload target is this save's, not the engine's
        self._engine.configure(upload_to=self.root, upload_options=self.storage_options)
        try:
            return self._engine.save(self._local.join(self.local_root, f"step_{int(step)}"), state, async_save=mode,
                                     step=int(step), on_commit=on_commit, allow_pickle=self.allow_pickle)
        finally:
            self._engine.options = previous

    def _after_commit(self, step: int) -> None:
        """Group rank 0, background thread, after ``step`` committed: ``latest``, then retention.

        ``latest`` names the newest committed step (not necessarily ``step``). Retention deletes the
        oldest committed steps beyond ``keep_last`` and leftovers of crashed saves older than
        ``step``, but never a save still in flight (in this process, or in a live process per the
        directory's writer record) nor a directory holding anything unickpt did not write.
        """
        for storage, root, options in self._tiers():
            self._retain(storage, root, options, step)

    def _retain(self, storage: Storage, root: str, options: dict | None, step: int) -> None:
        entries = list_checkpoints(root, options)
        committed = [s for s, ok in entries if ok]
        if not committed:
            return
        storage.write_atomic(storage.join(root, LATEST_FILE), f"step_{max(committed)}".encode())
        path = lambda s: storage.join(root, f"step_{s}")  # noqa: E731
        doomed = [s for s, ok in entries if not ok and s < step and not self._engine.in_flight(path(s))
                  and is_incomplete_checkpoint(storage, path(s)) and not writer_alive(storage, path(s))]
        if self.keep_last is not None:
            keep = set(committed[-self.keep_last:]) | {max(committed)}
            doomed += [s for s in committed if s not in keep]
        for s in doomed:
            # uncommit first (metadata.json goes first), so a half-deleted directory is never loadable
            storage.rm(storage.join(path(s), METADATA_FILE))
            storage.rm(path(s))

    def latest_step(self) -> int | None:
        """The newest committed step under ``root`` (and ``local_root``), by scanning for
        ``metadata.json``, or None."""
        committed = [s for _, root, options in self._tiers() for s, ok in list_checkpoints(root, options) if ok]
        return max(committed) if committed else None

    def load(self, state: dict, step: int | None = None, *, strict: bool = True,
             allow_pickle: bool | None = None) -> int | None:
        """Load ``step`` (default: the latest committed, as seen by group rank 0) into ``state``.

        Returns the step loaded, or None (state untouched) when there is no committed checkpoint.
        Waits for this process's pending saves first. Raises as :func:`unickpt.load`.
        """
        self._engine.wait()
        if step is None:
            step = self._engine.broadcast(self.latest_step() if self._engine.rank == 0 else None)
            if step is None:
                return None
        path, options = self.path_for(step), self.storage_options
        if self._local is not None:  # prefer the local copy when group rank 0 sees it committed
            local = self._local.join(self.local_root, f"step_{int(step)}")
            use_local = self._local.exists(self._local.join(local, METADATA_FILE)) if self._engine.rank == 0 else None
            if self._engine.broadcast(use_local):
                path, options = local, None
        self._engine.load(path, state, strict=strict, storage_options=options,
                          allow_pickle=self.allow_pickle if allow_pickle is None else allow_pickle)
        return int(step)

    def wait(self) -> None:
        """Block until every pending save has committed; raise the first failure."""
        self._engine.wait()

    def close(self) -> None:
        """Wait for pending saves. The engine (shared per process group) stays usable."""
        if not self._closed:
            self._closed = True
            self._engine.wait()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
