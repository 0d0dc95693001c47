"""One save as the threads of the save path see it: what was asked (:class:`SaveTask`, immutable: the
caller's :class:`~unickpt.requests.SaveRequest` and what the engine added), how far it has got
(:class:`SaveProgress`: events and the first failure), what it cost (:class:`SaveStats`), and what the
caller holds (:class:`SaveHandle`).

Writers of each: the caller's thread creates the task, progress and stats; the save thread sets
``planned`` (with the plan or the planning error), ``released`` and ``snapshot_done``; any thread may
record a failure (:meth:`SaveProgress.fail`, first one wins); the commit thread sets ``committed``
(on the stats) and completes the handle's future. Stats fields are each written by one thread: the
caller's (``stall_s``), the save thread's (plan and staging), the commit thread's (commit, and the
drain's and merge transfers' counts, which those threads keep in their own part of the run,
:mod:`.run`, merged once before the commit); read after the commit.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..errors import EarlierSaveFailedError
from ..options import SaveOptions
from ..plan.save_plan import SavePlan
from ..requests import SaveRequest
from ..storage.base import StorageBackend

__all__ = ["SaveTask", "SaveProgress", "SaveStats", "SaveHandle"]


@dataclass(frozen=True)
class SaveTask:
    """What one save was asked to do, on this rank: the call's ``request`` (its ``path``, ``step``,
    ``framework``, ``extra`` and ``on_commit`` are read through this task) and what the engine added.

    Attributes:
        request: the call (:class:`~unickpt.requests.SaveRequest`).
        seq: the save's number in its engine, equal on every rank (it tags merge transfers).
        storage: the backend of ``request.path``.
        options: the save's options (validated), equal on every rank where they shape the plan.
        rank, world_size: this rank in the save's group.
        t0: ``time.perf_counter()`` at the call.
    """

    request: SaveRequest
    seq: int
    storage: StorageBackend
    options: SaveOptions
    rank: int
    world_size: int
    t0: float = 0.0

    @property
    def path(self) -> str:
        return self.request.path

    @property
    def storage_options(self) -> dict | None:
        return self.request.storage_options

    @property
    def step(self) -> int | None:
        return self.request.step

    @property
    def framework(self) -> str | None:
        return self.request.framework

    @property
    def extra(self) -> dict:
        return self.request.extra

    @property
    def on_commit(self) -> Callable[[], None] | None:
        return self.request.on_commit


class SaveProgress:
    """How far a save has got on this rank (see the module docstring for who sets what).

    Events: ``planned`` (the plan is agreed, or planning failed: :attr:`plan_error`), ``released``
    (the caller may go on: everything not guarded by an optimizer step hook is staged),
    ``snapshot_done`` (every byte is staged: tensors may change freely).
    """

    def __init__(self) -> None:
        self.planned = threading.Event()
        self.released = threading.Event()
        self.snapshot_done = threading.Event()
        self.plan: SavePlan | None = None  # the SavePlan, set before ``planned``
        self.plan_error: BaseException | None = None  # planning failed, on every rank alike
        self._error: str | None = None
        self._lock = threading.Lock()
        self._on_failure: list[Callable[[str], None]] = []

    @property
    def error(self) -> str | None:
        """The first stage failure (text that starts with the stage's name), or None."""
        return self._error

    def fail(self, text: str) -> None:
        """Record a stage failure (only the first is kept) and tell the listeners (e.g. a staging ring
        whose stager waits for space)."""
        with self._lock:
            first = self._error is None
            if first:
                self._error = text
            listeners = list(self._on_failure)
        if first:
            for cb in listeners:
                cb(text)

    def on_failure(self, cb: Callable[[str], None]) -> None:
        """Call ``cb(text)`` at the first failure (at once if there was one)."""
        with self._lock:
            self._on_failure.append(cb)
            text = self._error
        if text is not None:
            cb(text)

    def finish_planning(self, plan: SavePlan | None = None, error: BaseException | None = None) -> None:
        """The save thread, once planning ended: with ``error`` nothing is staged (every event is set)."""
        self.plan, self.plan_error = plan, error
        if error is not None:
            self.released.set()
            self.snapshot_done.set()
        self.planned.set()

    def finish_snapshot(self) -> None:
        self.released.set()
        self.snapshot_done.set()


@dataclass
class SaveStats:
    """One save on this rank. Seconds (``*_s``), bytes (``bytes*``), counts.

    Stall and stages: ``stall_s`` is the time the save blocked the caller: the call itself (in
    ``sync`` snapshot mode ``plan_s`` + ``pool_wait_s`` + ``stage_s`` and flattening), plus, in
    ``overlap`` mode, any wait of ``optimizer.step()`` for the snapshot; ``snapshot_s`` is the time from the call
    until every byte was staged (equal to the stall in ``sync`` snapshot mode); ``ring_wait_s`` is
    staging time spent waiting for ring space (a state larger than the ring); ``checksum_s``,
    ``merge_wait_s``, ``write_s`` (including fsync), ``upload_s`` are the drain stages' busy times
    (they overlap each other and the staging); ``commit_s`` runs from the end of the drain to the
    commit; ``total_s`` from the call to the commit.

    Sizes: ``bytes_per_rank`` is what every rank writes under the plan, ``max_mean_bytes`` its
    largest over its mean. Collectives: the plan and commit collectives this save ran (gloo
    operations, ``all_gather_object`` counting 2), ``p2p_sends``/``p2p_recvs`` merge transfers.
    """

    path: str
    step: int | None = None
    stall_s: float = 0.0
    plan_s: float = 0.0
    pool_wait_s: float = 0.0
    stage_s: float = 0.0
    snapshot_s: float = 0.0
    ring_wait_s: float = 0.0
    checksum_s: float = 0.0
    merge_wait_s: float = 0.0
    write_s: float = 0.0
    upload_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    replica_check_s: float = 0.0  # the replica check's digests and comparisons (part of plan_s)
    bytes_staged: int = 0
    bytes_written: int = 0  # this rank's data + object files
    bytes_uploaded: int = 0
    bytes_per_rank: list = field(default_factory=list)
    max_mean_bytes: float = 1.0
    plan_cache_hit: bool = False  # the layout was planned before: only the signature exchange ran
    collectives_plan: int = 0
    collectives_commit: int = 0
    p2p_sends: int = 0
    p2p_recvs: int = 0
    merge_bytes_sent: int = 0
    merge_bytes_received: int = 0
    pool_capacity: int = 0
    pool_allocations: int = 0  # this ring's (re)allocations so far; unchanged when it was reused
    pool_index: int = 0
    streamed: bool = False  # the rank's bytes exceeded the ring: staged and drained in pieces
    snapshot: str = "sync"
    writer: str = "thread"
    flat_ranges: str = "store"
    committed: bool = False

    @property
    def collectives(self) -> int:
        return self.collectives_plan + self.collectives_commit

    def as_dict(self) -> dict:
        d = asdict(self)
        d["collectives"] = self.collectives
        return d


class SaveHandle:
    """The result of a save: ``wait()`` blocks until committed and raises the save's error, if any.

    Attributes:
        stats: the save's :class:`SaveStats` on this rank.
        seq: the save's number in its engine (equal on every rank; -1: not made by an engine).
        error_reported: the failure was raised (by :meth:`wait`, by the save call itself, or by the
            engine's next ``save()`` / ``wait()`` as an ``EarlierSaveFailedError``); it is raised once.
        on_error: ``on_error(error) -> bool``, or None: called with the ``EarlierSaveFailedError`` of this
            save when a later call of its engine finds it failed; True means handled (not raised).
    """

    def __init__(self, future: Future, stats: SaveStats, progress: SaveProgress | None = None, seq: int = -1,
                 on_error: Callable[[EarlierSaveFailedError], bool] | None = None):
        self._future = future
        self._progress = progress
        self.stats = stats
        self.seq = seq
        self.on_error = on_error
        self.error_reported = False

    @property
    def path(self) -> str:
        return self.stats.path

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def snapshot_done(self) -> bool:
        """True once every byte of the state is staged (tensors may be changed freely after this)."""
        return self._progress is None or self._progress.snapshot_done.is_set()

    def wait_planned(self) -> None:
        """Block until the save's plan is agreed or its planning failed (immediate for a handle made
        without progress)."""
        if self._progress is not None:
            self._progress.planned.wait()

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` once the save has committed or failed (at once if it has; on the commit
        thread otherwise). ``fn`` must not raise."""
        self._future.add_done_callback(lambda _f: fn(self))

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Block until the snapshot is complete (``overlap`` mode; immediate otherwise). Returns False
        if ``timeout`` seconds passed first. A failed snapshot is raised by :meth:`wait`."""
        return self._progress is None or self._progress.snapshot_done.wait(timeout)

    def outcome(self, timeout: float | None = None) -> BaseException | None:
        """Block until the save has committed (None) or failed (its error), without reporting the
        failure: it is still raised once, by :meth:`wait` or by the engine's next ``save()`` / ``wait()``.
        Raises concurrent.futures.TimeoutError if ``timeout`` seconds pass first."""
        return self._future.exception(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save commits. Raises SaveFailedError (or the save's error) if it failed,
        and concurrent.futures.TimeoutError if ``timeout`` seconds pass first."""
        try:
            self._future.result(timeout)
        except BaseException as e:
            if not isinstance(e, TimeoutError):
                self.error_reported = True
            raise
