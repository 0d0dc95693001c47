"""The saves of one process group: :class:`Saver` runs plan -> stage -> pipelined drain -> commit.

Save sequence (every rank of the group), by thread:

1. caller's thread (:meth:`Saver.save`): the snapshot (:mod:`.snapshot`: flatten the state, the local
   plan and its signature; no collective), then the hand-off to the save thread. In ``sync``
   snapshot mode the caller then waits until every byte is staged (step 3); in ``overlap`` mode it
   returns at once (optimizer steps wait for the snapshot instead).
2. save thread, **plan**: group rank 0 checks the target directory
   (:func:`~unickpt.lifecycle.directory.prepare_target`: refuses a committed, in-flight or foreign
   one, clears an incomplete one); then the ranks agree on the plan (:mod:`.plan_agreement`: **1 collective**
   on a plan-cache hit, **3** on a miss, **2 more** on a miss when chunks are replicated: the replica
   check of :mod:`.replicas`).
3. save thread, **stage** (:mod:`.pipeline`): a free staging ring, then this rank's chunks into it,
   piece by piece, merge transfers point to point.
4. background, **drain** (:mod:`.drain`): checksum and write threads (or a writer process) and the
   uploader (:mod:`.upload`) stream the staged pieces to the data files (and the remote copy) while
   staging goes on.
5. commit thread (one per group, so saves commit in order; :mod:`.commit`): waits for the drain,
   then **3 collectives** (2 more if the commit failed) and group rank 0 writes ``metadata.json``.

:class:`~unickpt.saving.request.SaveStats` counts each save's collectives (``collectives_plan``,
``collectives_commit``). The save thread and the commit thread use two different private gloo groups
(*plan* and *background*), so their collectives never interleave.

A failure of a save after its call returned is raised once, on every rank, by the engine's next
``save()`` (when that save has finished on every rank: :meth:`Saver.report_failures`, 1 collective)
or ``wait()`` / ``close()``, as one EarlierSaveFailedError naming every such save (docs/design.md,
"Failures of asynchronous saves").
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..dist.comm import Comm, local_synchronization
from ..dist.p2p import P2P
from ..lifecycle.directory import prepare_target
from ..options import SaveOptions, check_options
from ..plan.save_plan import SavePlan
from ..requests import SaveRequest
from ..storage import open_storage
from . import snapshot as snapshot_mod
from .commit import Committer
from .pipeline import SavePipeline
from .plan_agreement import PlanAgreement
from .replicas import check_replicas
from .reports import agree_finished, report_unreported
from .request import SaveHandle, SaveProgress, SaveStats, SaveTask
from .snapshot import Snapshot, StepGuards, take_snapshot
from .upload import Uploader

__all__ = ["Saver"]

log = logging.getLogger("unickpt")


class Saver:
    """Saves for the ranks of one process group (see the module docstring). Created collectively
    (it creates a private gloo group for merge transfers).

    Args:
        comm: the group's collectives (:class:`~unickpt.dist.comm.Comm`).
        options: the default :class:`~unickpt.options.SaveOptions` of saves that give none.
        run_id: recorded in every ``metadata.json``.
        local_world_size: ranks on this host (sizes the default staging ring).
        busy_elsewhere: ``busy_elsewhere(path)``: a save into ``path`` is in flight in another engine
            of this process (a leftover of this process is replaced only when none is).
        report_earlier: :meth:`save` first raises the failures of earlier saves that have finished on
            every rank (:meth:`report_failures`; 1 collective when an earlier save was not yet seen
            finished everywhere). Off for a saver whose owner waits for each handle itself.
    """

    def __init__(self, comm: Comm, options: SaveOptions, run_id: str, *, local_world_size: int | None = None,
                 timeout_s: float = 1800.0, busy_elsewhere: Callable[[str], bool] = lambda path: False,
                 report_earlier: bool = False):
        self.comm, self.options, self.run_id = comm, options, run_id
        self.rank, self.world_size = comm.rank, comm.world_size
        self._busy_elsewhere = busy_elsewhere
        p2p = None
        if self.world_size > 1:
            import torch.distributed as dist
            from datetime import timedelta

            group = dist.new_group(comm.ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                                   use_local_synchronization=local_synchronization(comm.ranks))
            p2p = P2P(group, comm.ranks)
        self.p2p = p2p
        self.uploader = Uploader()
        self.pipeline = SavePipeline(p2p, self.rank, self.world_size, self.uploader, local_world_size)
        self.agreement = PlanAgreement(comm)
        self.committer = Committer(comm, run_id)
        # the commit never removes a failed save's directory while a save into it is in flight here
        self.committer.busy = self._busy
        self.guards = StepGuards()
        self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unickpt-commit")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="unickpt-stager", daemon=True)
        self._thread.start()
        self._pending: list[SaveHandle] = []
        self._in_flight: dict[str, int] = {}  # paths of saves not yet finished (how many)
        self._lock = threading.Lock()
        self._seq = 0
        self._agreed = 0  # every save numbered below has finished on every rank (changed on every rank alike)
        self._report_earlier = report_earlier
        self._closed = False

    # -- caller's thread ---------------------------------------------------------------------------
    def save(self, request: SaveRequest, state: dict) -> SaveHandle:
        """Save ``state`` as ``request`` says (see :func:`unickpt.save`): the snapshot, then the hand-off
        to the save thread, then (``sync`` snapshot mode) the wait until everything is staged. Planning
        errors are raised here in ``sync`` snapshot mode, on the handle in ``overlap`` mode.

        With ``report_earlier``, first raises EarlierSaveFailedError for earlier saves that failed
        (:meth:`report_failures`; this save is then not started), and, after a synchronous save
        committed, for earlier ones found failed meanwhile. ``request.on_error``: see
        :attr:`~unickpt.saving.request.SaveHandle.on_error`."""
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("unickpt: this engine is closed (its saves ended with close()); use another engine")
        if self._report_earlier:
            self.report_failures()
        # options given to this call are checked as part of the save, so that a bad value on one rank is
        # raised on every rank by the plan agreement instead of leaving the others waiting
        opts, opts_error = self.options, None
        if request.options is not None:
            try:
                opts = check_options(request.options, SaveOptions, "save").validated()
            except (TypeError, ValueError) as e:
                opts_error = e
        path = request.path
        stats = SaveStats(path=path, step=request.step, snapshot=opts.snapshot, writer=opts.writer,
                          flat_ranges=opts.flat_ranges)
        self.guards.remove_finished()
        seq, self._seq = self._seq, self._seq + 1
        req = SaveTask(request, seq, open_storage(path, request.storage_options), opts, self.rank, self.world_size, t0)
        progress = SaveProgress()
        clone_limit = min(snapshot_mod.OVERLAP_CLONE_BYTES, self.pipeline.ring_bytes(opts) // 4)
        snap = take_snapshot(state, rank=self.rank, world_size=self.world_size, snapshot_mode=opts.snapshot,
                             allow_pickle=request.allow_pickle, clone_limit=clone_limit,
                             stream_order_fixed=opts.safetensors is not None)
        if opts_error is not None:
            snap.failed(opts_error, self.rank, tag="options")
        with self._lock:
            self._in_flight[path] = self._in_flight.get(path, 0) + 1
        if snap.optimizers:
            self.guards.guard(progress, stats, snap.optimizers)
        handle = SaveHandle(self._commits.submit(self._commit, req, progress, snap, stats), stats, progress, seq=seq,
                            on_error=request.on_error)
        with self._lock:  # finished saves that committed need no report; failed ones wait for the agreement
            self._pending = [h for h in self._pending if not (h.done() and h.outcome() is None)]
            self._pending.append(handle)
        # the hand-off comes last: the save thread wakes up and competes for the GIL
        self._queue.put((req, progress, snap, stats))
        if snap.must_wait:
            progress.released.wait()
            if progress.plan_error is not None:
                handle.error_reported = True  # raised here, not again by the engine's wait()
                with self._lock:
                    self._pending = [h for h in self._pending if h is not handle]
                handle.outcome()  # its commit-thread part is over: the path is no longer in flight
                raise progress.plan_error
        stats.stall_s = time.perf_counter() - t0
        if not request.async_save:
            handle.wait()
            if self._report_earlier:  # every save up to this one has finished, on every rank
                self._agreed = seq + 1
                self._report(seq + 1)
        return handle

    # -- save thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            got = self._queue.get()
            if got is None:
                return
            req, progress, snap, stats = got
            try:
                self._serve(req, progress, snap, stats)
            except BaseException as e:  # pragma: no cover - a bug: never leave a caller waiting
                progress.fail(f"snapshot stage (internal): {e!r}")
                if not progress.planned.is_set():
                    progress.finish_planning(error=e)
                progress.finish_snapshot()
            # not held while waiting for the next save: the snapshot references the caller's tensors,
            # modules and optimizers (a model deleted after its last save would stay in memory)
            del got, req, progress, snap, stats

    def _serve(self, req: SaveTask, progress: SaveProgress, snap: Snapshot, stats: SaveStats) -> None:
        t0 = time.perf_counter()
        try:
            plan = self._plan(req, snap, stats)
        except BaseException as e:  # every rank failed the plan alike: nothing is staged
            progress.finish_planning(error=e)
            return
        stats.plan_s = time.perf_counter() - t0
        stats.bytes_per_rank, stats.max_mean_bytes = list(plan.bytes_per_rank), plan.max_mean_bytes
        run = self.pipeline.begin(req, progress, stats, plan, snap.leaf, snap.guarded, snap.cuda_ready)
        progress.finish_planning(plan)
        self.pipeline.stage(run)

    def _plan(self, req: SaveTask, snap: Snapshot, stats: SaveStats) -> Any:
        """Group rank 0 checks and claims the target directory (before the agreement: no other rank
        writes into it before then), then every rank agrees on the plan. When the agreement fails, the
        directory rank 0 just made (empty but for its writer record) is removed again."""
        made: list[tuple[Any, str]] = []
        if self.rank == 0 and snap.error is None:
            try:
                prepare_target(req.storage, req.path, in_flight=lambda p: self.in_flight(p, others=1),
                               ours_in_flight=lambda p: self.in_flight(p, others=1) or self._busy_elsewhere(p))
                made.append((req.storage, req.path))
                if req.options.upload_to is not None:
                    made.append(Uploader.prepare_target(req.options, req.path))
            except Exception as e:
                snap.failed(e, self.rank)
        assert snap.local is not None
        try:
            return self.agreement.agree(req.path, snap.local, snap.signature, snap.error, stats, req.options,
                                        lambda plan, full: self._check_replicas(snap, plan, full, stats),
                                        step=req.step, leaf=snap.leaf)
        except BaseException:
            for storage, path in made:
                try:
                    storage.rm(path)
                except Exception:  # a leftover: replaced by the next save into it, or removed by retention
                    log.warning("unickpt: could not remove %s after its save failed to plan", path, exc_info=True)
            raise

    def _check_replicas(self, snap: Snapshot, plan: SavePlan, full: bool, stats: SaveStats) -> None:
        """Before staging: the holders of each replicated chunk hold the same bytes
        (:mod:`.replicas`; raises ReplicaMismatchError on every rank)."""
        if not plan.replicas or self.world_size == 1:
            return
        leaves = {fqn: snap.leaf(fqn) for fqn, _, ranks in plan.replicas if self.rank in ranks}
        stats.collectives_plan += check_replicas(self.comm, plan.replicas, leaves, full=full)

    # -- commit thread ------------------------------------------------------------------------------
    def _commit(self, req: SaveTask, progress: SaveProgress, snap: Snapshot, stats: SaveStats) -> None:
        """Wait for the plan and the drain, then commit (every rank reaches the collectives)."""
        try:
            progress.planned.wait()
            if progress.plan_error is not None:  # every rank failed the plan alike: nothing to gather
                raise progress.plan_error
            assert progress.plan is not None, "finish_planning sets the plan or the error"
            drained = self.pipeline.wait_drained(req.seq)
            self.committer.commit(req, progress.plan, snap, drained, progress.error, stats)
        finally:
            with self._lock:
                left = self._in_flight.get(req.path, 1) - 1
                if left > 0:
                    self._in_flight[req.path] = left
                else:
                    self._in_flight.pop(req.path, None)

    # -- lifecycle ----------------------------------------------------------------------------------
    def _busy(self, path: str, others: int = 0) -> bool:
        """A save into ``path`` is in flight here (``others``: how many to ignore) or in another engine."""
        return self.in_flight(path, others) or self._busy_elsewhere(path)

    def in_flight(self, path: str, others: int = 0) -> bool:
        """True while a save to ``path`` started here has not finished (any thread); ``others``: how
        many in-flight saves to ignore (the caller's own)."""
        with self._lock:
            return self._in_flight.get(str(path), 0) > others

    def pending(self) -> list[SaveHandle]:
        """The handles of saves not yet waited for."""
        with self._lock:
            return list(self._pending)

    def wait_planned(self) -> None:
        """Block until every pending save has agreed its plan (so that the caller's thread may run a
        collective on the plan group without interleaving with the save thread's)."""
        for h in self.pending():
            h.wait_planned()

    def report_failures(self) -> None:
        """Raise the failures of earlier saves that have finished on every rank and were not raised yet
        (caller's thread; every rank of the group calls it at the same point and raises the same error).

        Which saves have finished everywhere is agreed (:func:`~.reports.agree_finished`: **1
        collective**), only when a save started since the last agreement (on every rank alike: a
        rank's own ``wait()`` does not count). A failure that a handle's ``wait()`` raised on every
        rank is not raised again; one raised on some ranks only is raised again, on every rank.

        Raises EarlierSaveFailedError as :func:`~.reports.report_unreported`."""
        if self._agreed >= self._seq:  # the same on every rank: they all skip the collective, or none does
            return
        if self.world_size > 1:
            self.wait_planned()  # the caller's collective must not interleave with the save thread's
        self._agreed = agree_finished(self.comm, self._agreed, self._seq, self.pending())
        self._report(self._agreed)

    def _report(self, upto: int) -> None:
        """Report the unreported failures of the saves numbered below ``upto`` (all finished on every
        rank): :func:`~.reports.report_unreported`."""
        with self._lock:
            finished = [h for h in self._pending if h.seq < upto]
            self._pending = [h for h in self._pending if h.seq >= upto]
        report_unreported(finished)

    def wait(self) -> None:
        """Wait for every pending save; then raise the failures not raised yet (EarlierSaveFailedError
        naming every failed save, as :meth:`report_failures`; no collective: every save has finished)."""
        upto = self._seq
        with self._lock:
            pending = list(self._pending)
        for handle in pending:
            handle.outcome()  # failures are reported below, with the others
        self.guards.remove_finished()
        self._report(upto)

    def close(self) -> None:
        """Wait for the pending saves, then stop the threads, free the staging memory and destroy the
        merge group (no reference to it is kept: torch can then re-initialise on the same store)."""
        self._closed = True
        try:
            self.wait()
        finally:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._commits.shutdown(wait=True)
            self.pipeline.close()
            self.uploader.close()
            if self.p2p is not None:
                import torch.distributed as dist

                if dist.is_initialized():
                    try:
                        dist.destroy_process_group(self.p2p.group)
                    except (ValueError, RuntimeError):  # already gone with the default group
                        pass
                self.p2p.group = None
            self.agreement.cache.clear()
