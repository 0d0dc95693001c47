"""``Checkpointer``: numbered checkpoints under one root, ``latest``, retention, async saves."""
from __future__ import annotations

import os
import re
from typing import Any

from .engine import SaveHandle, get_engine
from .metadata import METADATA_FILE, is_incomplete_checkpoint, writer_alive
from .storage import Storage

__all__ = ["Checkpointer", "list_checkpoints"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST_FILE = "latest"


def list_checkpoints(root: str, storage_options: dict | None = None) -> list[tuple[int, bool]]:
    """``[(step, committed), ...]`` for every ``step_<N>`` directory under ``root``, by step."""
    storage = Storage(root, storage_options)
    out = []
    for name in storage.listdir(root):
        m = _STEP_DIR.match(name)
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
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, async_save: bool = True,
                 process_group: Any = None, storage_options: dict | None = None, allow_pickle: bool = False):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.root = os.fspath(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self._storage = Storage(self.root, storage_options)
        self._engine = get_engine(process_group)
        self._closed = False

    def path_for(self, step: int) -> str:
        return self._storage.join(self.root, f"step_{int(step)}")

    def save(self, step: int, state: dict, *, async_save: bool | None = None) -> SaveHandle:
        """Save ``state`` as ``step``. Returns when snapshotted (async) or committed (sync).

        An earlier async save still in flight keeps draining; this one stages into the other
        staging pool. Raises CheckpointExistsError if ``step`` is already committed.
        """
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self._engine.save(
            self.path_for(step), state, async_save=self.async_save if async_save is None else async_save,
            storage_options=self.storage_options, step=int(step), on_commit=lambda s=int(step): self._after_commit(s),
            allow_pickle=self.allow_pickle,
        )

    def _after_commit(self, step: int) -> None:
        """Group rank 0, background thread, after ``step`` committed: ``latest``, then retention.

        ``latest`` names the newest committed step (not necessarily ``step``). Retention deletes the
        oldest committed steps beyond ``keep_last`` and leftovers of crashed saves older than
        ``step``, but never a save still in flight (in this process, or in a live process per the
        directory's writer record) nor a directory holding anything unickpt did not write.
        """
        entries = list_checkpoints(self.root, self.storage_options)
        committed = [s for s, ok in entries if ok]
        self._storage.write_atomic(self._storage.join(self.root, LATEST_FILE), f"step_{max(committed)}".encode())
        doomed = [s for s, ok in entries if not ok and s < step and not self._engine.in_flight(self.path_for(s))
                  and is_incomplete_checkpoint(self._storage, self.path_for(s))
                  and not writer_alive(self._storage, self.path_for(s))]
        if self.keep_last is not None:
            keep = set(committed[-self.keep_last:]) | {max(committed)}
            doomed += [s for s in committed if s not in keep]
        for s in doomed:
            # uncommit first (metadata.json goes first), so a half-deleted directory is never loadable
            self._storage.rm(self._storage.join(self.path_for(s), METADATA_FILE))
            self._storage.rm(self.path_for(s))

    def latest_step(self) -> int | None:
        """The newest committed step under ``root`` (by scanning for ``metadata.json``), or None."""
        committed = [s for s, ok in list_checkpoints(self.root, self.storage_options) if ok]
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
        self._engine.load(self.path_for(step), state, strict=strict, storage_options=self.storage_options,
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
