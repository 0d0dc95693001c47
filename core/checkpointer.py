"""``Checkpointer``: numbered checkpoints of one run under a root, ``latest``, retention, async saves.

The directory rules (``step_<N>``, ``latest``, retention) are :class:`~unickpt.lifecycle.root.CheckpointRoot`'s;
saves and loads go through the group's engine with this checkpointer's options.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from .engine import SaveHandle, get_engine
from .lifecycle.directory import is_committed
from .lifecycle.root import CheckpointRoot, list_checkpoints
from .options import LoadOptions, SaveOptions

__all__ = ["Checkpointer", "list_checkpoints"]


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
        save_options, load_options: how this checkpointer's saves and loads run
            (:class:`~unickpt.SaveOptions`, :class:`~unickpt.LoadOptions`; default: the engine's).
        on_commit: ``on_commit(step)`` runs on group rank 0 after each commit, once ``latest`` and
            retention are done (for a framework's own rotation, say). Its errors are logged.
        framework: recorded in each checkpoint's ``metadata.json`` (a plugin's name: which layout
            reads it in a cross-framework load, docs/cross-framework.md).
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, async_save: bool = True,
                 process_group: Any = None, storage_options: dict | None = None, allow_pickle: bool = False,
                 local_root: str | os.PathLike | None = None, save_options: SaveOptions | None = None,
                 load_options: LoadOptions | None = None, on_commit: Callable[[int], None] | None = None,
                 framework: str | None = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.root = os.fspath(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.save_options, self.load_options = save_options, load_options
        self.on_commit = on_commit
        self.framework = framework
        self._root = CheckpointRoot(self.root, storage_options)
        self.local_root = None if local_root is None else os.fspath(local_root)
        self._local = None if local_root is None else CheckpointRoot(self.local_root)
        self._engine = get_engine(process_group)
        self._closed = False

    def path_for(self, step: int) -> str:
        return self._root.path(int(step))

    def _tiers(self) -> list[CheckpointRoot]:
        """The roots of each tier, remote first."""
        return [self._root] + ([self._local] if self._local is not None else [])

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
                                     step=int(step), on_commit=on_commit, allow_pickle=self.allow_pickle,
                                     options=self.save_options, framework=self.framework)
        # the upload target is this save's option, not the engine's
        options = (self.save_options or self._engine.options).with_(upload_to=self.root,
                                                                    upload_options=self.storage_options)
        return self._engine.save(self._local.path(int(step)), state, async_save=mode, step=int(step),
                                 on_commit=on_commit, allow_pickle=self.allow_pickle, options=options,
                                 framework=self.framework)

    def _after_commit(self, step: int) -> None:
        """Group rank 0, commit thread, after ``step`` committed: ``latest`` and retention in every tier
        (:meth:`~unickpt.lifecycle.root.CheckpointRoot.retain`), then ``on_commit(step)``."""
        for root in self._tiers():
            root.retain(self.keep_last, step, self._engine.in_flight)
        if self.on_commit is not None:
            self.on_commit(step)

    def latest_step(self) -> int | None:
        """The newest committed step under ``root`` (and ``local_root``), by scanning for
        ``metadata.json``, or None."""
        committed = [s for root in self._tiers() for s in root.committed_steps()]
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
            local = self._local.path(int(step))
            use_local = is_committed(self._local.storage, local) if self._engine.rank == 0 else None
            if self._engine.broadcast(use_local):
                path, options = local, None
        self._engine.load(path, state, strict=strict, storage_options=options,
                          allow_pickle=self.allow_pickle if allow_pickle is None else allow_pickle,
                          options=self.load_options)
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

