"""``Checkpointer``: numbered checkpoints of one run under a root, ``latest``, retention, async saves,
and the checkpoint tiers (memory, a peer's memory, storage) with a save on a preemption notice.

The directory rules (``step_<N>``, ``latest``, retention) are :class:`~unickpt.lifecycle.root.CheckpointRoot`'s;
saves and loads go through the group's engine with this checkpointer's options; the tiers are
:class:`~unickpt.tiers.manager.Tiers` (docs/tiers.md).
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any, Callable

from .engine import SaveHandle, get_engine
from .errors import EarlierSaveFailedError, SaveFailedError, StorageError
from .lifecycle.root import CheckpointRoot, list_checkpoints
from .loading.stats import LoadStats
from .options import LoadOptions, SaveOptions, TierOptions, env
from .requests import LoadRequest, SaveRequest

__all__ = ["Checkpointer", "list_checkpoints"]

log = logging.getLogger("unickpt")


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
        memory_every, persist_every: the checkpoint tiers (docs/tiers.md): a memory save (this rank's
            state in host shared memory, tier 0, copied to a rank on another node, tier 1) every
            ``memory_every`` steps and a persistent save (tier 2, under ``root``) every
            ``persist_every`` steps. With either set, call :meth:`save` at every step: it saves what
            the schedule says, and persistently on a preemption notice (a ``SIGTERM`` or ``SIGUSR1``
            to any rank; :attr:`preempted`); :meth:`load` restores from the nearest tier. Shorthands
            for the fields of ``tiers``.
        tiers: the other tier options (:class:`~unickpt.TierOptions`: memory directory, steps kept,
            memory bound, node id, signals, peer copies).
        on_error: what happens when an asynchronous save fails after :meth:`save` returned.
            ``"raise"`` (default): the next :meth:`save`, :meth:`wait`, :meth:`close` or :meth:`load`
            raises :class:`~unickpt.EarlierSaveFailedError` (a ``SaveFailedError``) naming the failed
            step(s), on every rank, once (that ``save`` then saves nothing). ``"warn"``: the same call
            warns instead (a ``RuntimeWarning`` per failed save, on every rank) and training goes on.
            Either way :attr:`failed_saves` counts the failures reported and :attr:`last_error` holds
            the latest; later saves run as usual. A save that fails at its own call (a synchronous
            save, or one refused while planning) raises its ``SaveFailedError`` there, or with
            ``"warn"`` warns, counts it and returns None.

    Attributes:
        failed_saves: how many of this checkpointer's persistent saves failed (reported so far).
        last_error: the EarlierSaveFailedError of the latest of them (its ``__cause__`` is the save's
            own error), or None.

    Construction is collective over ``process_group`` (with tiers it creates two private gloo groups).
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, async_save: bool = True,
                 process_group: Any = None, storage_options: dict | None = None, allow_pickle: bool = False,
                 local_root: str | os.PathLike | None = None, save_options: SaveOptions | None = None,
                 load_options: LoadOptions | None = None, on_commit: Callable[[int], None] | None = None,
                 framework: str | None = None, memory_every: int | None = None,
                 persist_every: int | None = None, tiers: TierOptions | None = None, on_error: str = "raise"):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        self.on_error = on_error
        self.failed_saves = 0
        self.last_error: BaseException | None = None
        changes = {k: v for k, v in (("memory_every", memory_every), ("persist_every", persist_every)) if v is not None}
        self.tier_options = (tiers or TierOptions()).with_(**changes)
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
        self._local = None if self.local_root is None else CheckpointRoot(self.local_root)
        self._engine = get_engine(process_group)
        self._closed = False
        self.preempted = False  # a preemption notice made this run save persistently: stop training
        self.last_load_stats: LoadStats | None = None
        self._tiers = None
        if self.tier_options.enabled:
            from .tiers.manager import Tiers

            self._tiers = Tiers(self.root, self.tier_options, process_group=process_group, save_options=save_options,
                                timeout_s=env().collective_timeout_s, local_world_size=env().local_world_size)

    def path_for(self, step: int) -> str:
        return self._root.path(int(step))

    def _roots(self) -> list[CheckpointRoot]:
        """The roots of each tier, remote first."""
        return [self._root] + ([self._local] if self._local is not None else [])

    @property
    def tiers(self) -> Any:
        """The :class:`~unickpt.tiers.manager.Tiers` of this checkpointer, or None without tiers."""
        return self._tiers

    def save(self, step: int, state: dict, *, async_save: bool | None = None,
             persist: bool | None = None) -> SaveHandle | None:
        """Save ``state`` as ``step``. Returns when snapshotted (async) or committed (sync).

        Without tiers: a persistent save of ``step``. With tiers (``memory_every`` / ``persist_every``):
        call it at every step (collective: **1 small all-reduce** per call, the preemption flag and the
        memory watermark); it makes a memory save when ``step`` is a multiple of ``memory_every``, a
        persistent one when it is a multiple of ``persist_every`` or ``persist=True``, and, when any
        rank has received a preemption notice, a synchronous persistent save of ``step`` on every rank
        (then :attr:`preempted` is True: leave the training loop; with more than one rank the notice
        acts one call after it was taken, as the all-reduce is pipelined behind a training step). Returns the persistent save's
        handle, else the memory save's, else None (nothing due at this step).

        An earlier async save still in flight keeps draining; this one stages into the other
        staging pool. Raises CheckpointExistsError if ``step`` is already committed (a persistent save),
        and EarlierSaveFailedError (``on_error="raise"``) when an earlier persistent save failed after
        its call returned: then this persistent save is not started, except on a preemption notice,
        where it runs first and the error is raised after it.
        """
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._tiers is None:
            return self._persist(step, state, async_save)
        tiers, opts = self._tiers, self.tier_options
        pending = tiers.start_agreement()  # in flight during the memory snapshot
        handle = None
        if tiers.due(step):
            handle = tiers.memory_save(step, state, allow_pickle=self.allow_pickle)
        agreement = tiers.finish_agreement(pending)
        if agreement.preempt:
            return self._preempt(step, state, agreement) or handle
        if persist or (persist is None and opts.persist_every is not None and step % opts.persist_every == 0):
            handle = self._persist(step, state, async_save)
        return handle

    def _preempt(self, step: int, state: dict, agreement: Any) -> SaveHandle | None:
        """Every rank at the same step: a synchronous persistent save of ``step`` (unless committed)."""
        tiers = self._tiers
        assert tiers is not None, "called only with the checkpoint tiers on"
        notice = tiers.notice
        t0 = time.time()
        if self._engine.rank == 0:
            log.warning("unickpt: preemption notice (%s): saving step %d persistently on every rank", notice.received
                        or "on another rank", step)
        handle, earlier = None, None
        try:  # earlier saves first (they would commit before this one anyway): a failure of theirs never
            self._engine.wait()  # stops this save; it is raised once this save is done
        except EarlierSaveFailedError as e:
            earlier = e
        committed = _from_rank0(self._engine, lambda: self._root.dir(int(step)).is_committed(),
                                self.path_for(step))
        if not committed:
            handle = self._persist(step, state, False)
        self._engine.wait()
        self.preempted = True
        self.preempted_step = int(step)
        self.preempt_save_s = time.time() - t0
        since = f", {time.time() - notice.received_at:.2f} s after the notice" if notice.received_at else ""
        log.warning("unickpt: step %d saved persistently for the preemption in %.2f s%s", step, self.preempt_save_s, since)
        if earlier is not None:
            raise earlier
        return handle

    def _persist(self, step: int, state: dict, async_save: bool | None) -> SaveHandle | None:
        """A persistent save of ``step`` (the path of a checkpointer without tiers)."""
        on_commit = lambda s=int(step): self._after_commit(s)  # noqa: E731
        mode = self.async_save if async_save is None else async_save
        try:
            if self._local is None:
                return self._engine.save(SaveRequest(self.path_for(step), async_save=mode,
                                                     storage_options=self.storage_options, step=int(step),
                                                     framework=self.framework, allow_pickle=self.allow_pickle,
                                                     options=self.save_options, on_commit=on_commit,
                                                     on_error=self._failed), state)
            # the upload target is this save's option, not the engine's
            options = (self.save_options or self._engine.options).with_(upload_to=self.root,
                                                                        upload_options=self.storage_options)
            return self._engine.save(SaveRequest(self._local.path(int(step)), async_save=mode, step=int(step),
                                                 framework=self.framework, allow_pickle=self.allow_pickle,
                                                 options=options, on_commit=on_commit, on_error=self._failed), state)
        except SaveFailedError as e:  # this save's own failure, raised at its call (on every rank alike)
            if isinstance(e, EarlierSaveFailedError):
                raise
            self.failed_saves += 1
            self.last_error = e
            if self.on_error != "warn":
                raise
            warnings.warn(f"unickpt: the save of step {step} ({e.path!r}) failed ({_last_line(e)}); "
                          "on_error='warn': training goes on", RuntimeWarning, stacklevel=3)
            return None

    def _failed(self, error: EarlierSaveFailedError) -> bool:
        """The engine found one of this checkpointer's saves failed (caller's thread, at a later
        ``save`` / ``wait``): count it; with ``on_error="warn"`` warn and report it handled."""
        self.failed_saves += 1
        self.last_error = error
        if self.on_error == "warn":
            warnings.warn(f"unickpt: the asynchronous save of step {error.steps[0]} ({error.path!r}) failed "
                          f"({_last_line(error.__cause__ or error)}); "
                          "on_error='warn': training goes on", RuntimeWarning, stacklevel=2)
            return True
        return False

    def _after_commit(self, step: int) -> None:
        """Group rank 0, commit thread, after ``step`` committed: ``latest`` and retention in every tier
        (:meth:`~unickpt.lifecycle.root.CheckpointRoot.retain`), then ``on_commit(step)``."""
        for root in self._roots():
            root.retain(self.keep_last, step, self._engine.in_flight)
        if self.on_commit is not None:
            self.on_commit(step)

    def latest_step(self) -> int | None:
        """The newest committed step under ``root`` (and ``local_root``), by scanning for
        ``metadata.json``, or None. Raises StorageError when a listing, or a look at a
        ``metadata.json``, fails (never None for a root it could not read)."""
        committed = [s for root in self._roots() for s in root.committed_steps()]
        return max(committed) if committed else None

    def load(self, state: dict, step: int | None = None, *, strict: bool = True,
             allow_pickle: bool | None = None) -> int | None:
        """Load ``step`` (default: the latest committed, as seen by group rank 0) into ``state``.

        With memory tiers, the newest step that every rank can restore from memory (its node's, or a
        peer node's, sent over the group) is loaded when it is at least as new as the newest
        persisted one; every byte is checked against its checksum, and a corrupt or partial copy
        falls back to the next copy or tier with a warning (:mod:`unickpt.tiers.recovery`). Else the
        persisted step is loaded from storage (resharded if the world size changed).
        :attr:`last_load_stats` says which tier this rank's bytes came from.

        Returns the step loaded, or None (state untouched) when there is no checkpoint. Waits for this
        process's pending saves first. Raises as :func:`unickpt.load`.
        """
        self._engine.wait()
        ap = self.allow_pickle if allow_pickle is None else allow_pickle
        if self._tiers is not None and self._tiers.memory:
            persisted = _from_rank0(self._engine, self.latest_step, self.root)
            result = self._tiers.recover(state, persisted=persisted, only=step, strict=strict, allow_pickle=ap,
                                         load_options=self.load_options)
            if result is not None:
                self.last_load_stats = result.stats
                return result.step
            if step is None:
                step = persisted
            if step is None:
                return None
        elif step is None:
            step = _from_rank0(self._engine, self.latest_step, self.root)
            if step is None:
                return None
        path, options = self.path_for(step), self.storage_options
        local_root = self._local
        if local_root is not None:  # prefer the local copy when group rank 0 sees it committed
            local = local_root.path(int(step))
            if _from_rank0(self._engine, lambda: local_root.dir(int(step)).is_committed(), local):
                path, options = local, None
        stats = self._engine.load(LoadRequest.of(path, strict=strict, storage_options=options, allow_pickle=ap,
                                                 options=self.load_options), state)
        stats.tier = "storage"
        stats.bytes_by_tier = {"storage": stats.bytes_read + stats.bytes_received}
        self.last_load_stats = stats
        if self._tiers is not None:
            self._tiers.forget_newer(int(step))
        return int(step)

    def wait(self) -> None:
        """Block until every pending save has committed (and, with tiers, every memory save and peer
        copy is done); then raise EarlierSaveFailedError naming every persistent save that failed and
        was not reported yet (with ``on_error="warn"``: warn, see the class docstring)."""
        if self._tiers is not None:
            self._tiers.wait()
        self._engine.wait()

    def close(self) -> None:
        """Wait for pending saves (and memory saves and peer copies; then stop the tiers' threads and
        put the signal handlers back), reporting failures as :meth:`wait` does. The engine (shared per
        process group) stays usable; the memory copies stay for a restart (:meth:`clear_memory`
        removes them)."""
        if not self._closed:
            self._closed = True
            try:
                self._engine.wait()
            finally:
                if self._tiers is not None:
                    self._tiers.close()

    def clear_memory(self) -> None:
        """Remove this rank's memory copies and the peer copies it holds (no collective; e.g. at the
        end of a run that will not be restarted)."""
        if self._tiers is not None:
            self._tiers.clear_memory()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _from_rank0(engine: Any, fn: Callable[[], Any], path: str) -> Any:
    """``fn()`` (a listing, a look at ``metadata.json``) on group rank 0, its result on every rank
    (1 broadcast), so that ranks never disagree on what storage holds. An OSError there (a
    :class:`~unickpt.errors.StorageError`, or any other, turned into one naming ``path``) is raised
    on every rank: no rank is left waiting, none reads a failure as "no checkpoint"."""
    out: Any = None
    if engine.rank == 0:
        try:
            out = ("ok", fn())
        except StorageError as e:
            out = ("error", e)
        except OSError as e:
            out = ("error", StorageError(f"cannot read {path!r}: {e}", path, e))
    got = engine.broadcast(out)
    if got[0] == "error":
        raise got[1]
    return got[1]


def _last_line(error: BaseException) -> str:
    """The last non-empty line of ``error``'s text (a failing rank's exception), for a one-line warning."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
