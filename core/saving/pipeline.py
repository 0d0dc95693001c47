"""The save pipeline on one rank: stage -> serialize/checksum -> write -> (upload), overlapping per piece.

It receives a save whose plan is agreed (:mod:`.plan_agreement`) and runs it; it never plans and never calls
back into the engine. Threads (per engine; saves are served in the order they were called):

1. **save thread** (the caller of :meth:`SavePipeline.begin` and :meth:`SavePipeline.stage`, owned
   by :class:`~unickpt.saving.saver.Saver`): takes a free staging ring (ping-pong of two,
   :class:`~unickpt.saving.staging.StagingPool`; waiting only when both are draining, reported as
   ``pool_wait_s``), registers the save with the drain, then copies this rank's chunks into the ring
   piece by piece (at most ``piece_bytes``) in file (stream) order, posts the merge sends and
   receives (:mod:`.transfers`) and hands each piece to the drain. When the state is
   larger than the ring, it waits for the writer to free space: the state streams through bounded
   memory.
2. **serialize/checksum** and 3. **write**: the drain (:mod:`.drain`), in this process
   (``writer="thread"``) or in a worker process that maps the ring as shared memory
   (``writer="process"``). The hasher runs each piece's deferred wait first (merge receive, CUDA copy
   event). The drain starts with the first staged piece (``overlap_drain``), or else when the
   snapshot is complete or the save thread has to wait for ring space.
4. **uploader** (optional, ``upload_to``: :class:`~unickpt.saving.upload.Uploader`): copies each data
   file, once it is written and fsynced, to the remote directory, while the next file is written.
5. the commit thread (:mod:`.commit`) waits for :meth:`SavePipeline.wait_drained`, which merges the
   drain's and the transfers' parts of the run into the save's stats, once.

State: :meth:`SavePipeline.begin` sets a save up as an immutable :class:`~.run.Run`; each thread
writes only its own part of it (:mod:`.run`), so stages hand on results, not a shared record.

Failures: the first failure of any stage (with the stage's name) fails the save
(:meth:`~unickpt.saving.request.SaveProgress.fail`); staging stops, still completes the merge transfers
it owes its peers (so they never hang), and the commit gathers every rank's failure; nothing is
committed. No collective here: only point-to-point merge transfers.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from typing import Callable

import torch

from ..dist.p2p import P2P
from ..format.integrity import CHECKSUM_BLOCK_BYTES, block_size
from ..geometry import Box
from ..options import SaveOptions
from ..plan.save_plan import RecvFill, SavePlan, SendOp
from ..plan.stream import stream_layout
from .drain import JobSpec, ThreadDrain
from .request import SaveProgress, SaveStats, SaveTask
from .run import DrainPart, DrainResult, Run, RunEvents, StagedPiece, StagingGate, failure_text
from .staging import CudaStager, PoolAborted, StagingPool, byte_view, copy_bytes, ring_capacity
from .transfers import MergeTransfers
from .upload import Uploader
from .writer_process import ProcessDrain

__all__ = ["SavePipeline", "take_spare"]


def take_spare(spare_dir: str, target: str) -> bool:
    """In-place staging: move a spare file of ``spare_dir`` (one that nothing else links: a peer copy
    being sent holds a second link) to ``target``, so that the save reuses its memory pages. Returns
    whether one was taken."""
    try:
        names = sorted(os.listdir(spare_dir))
    except OSError:
        return False
    for name in names:
        path = os.path.join(spare_dir, name)
        try:
            if os.stat(path).st_nlink != 1:
                continue
            os.rename(path, target)
            return True
        except OSError:  # taken or removed meanwhile
            continue
    return False


def _narrow(t: torch.Tensor, view: Box | None) -> torch.Tensor:
    if view is None:
        return t
    for d, (o, n) in enumerate(zip(view.offsets, view.lengths)):
        t = t.narrow(d, o, n)
    return t


class SavePipeline:
    """The staging rings, drain and upload of one engine (see the module docstring).

    Args:
        p2p: merge transfers (None for a world of one).
        rank, world_size: this rank in the group.
        uploader: the engine's uploader (two-tier saves).
        local_world_size: ranks on this host (sizes the default ring).
    """

    def __init__(self, p2p: P2P | None, rank: int, world_size: int, uploader: Uploader,
                 local_world_size: int | None = None):
        self.p2p, self.rank, self.world_size = p2p, rank, world_size
        self.transfers = MergeTransfers(p2p, rank)
        self.local_world_size = local_world_size
        self.uploader = uploader
        self.pools = [StagingPool(0), StagingPool(1)]
        self._pools_lock = threading.Lock()
        self._runs: dict[int, Run] = {}  # begun, not yet waited for by the commit thread
        self.events = RunEvents(rank, uploader)
        self._backend: ThreadDrain | ProcessDrain | None = None
        self._backend_key: tuple | None = None
        self._cuda: CudaStager | None = None

    def ring_bytes(self, options: SaveOptions) -> int:
        """The bound of one staging ring under ``options``."""
        return ring_capacity(options, self.world_size, self.local_world_size)

    # -- the drain ---------------------------------------------------------------------------------
    def drain_for(self, options: SaveOptions, local: bool) -> ThreadDrain | ProcessDrain:
        """The drain for these options (started on first use; swapped only while no save drains)."""
        kind = options.writer if local else "thread"
        key = (kind, options.background_nice)
        busy = bool(self.events.active)
        if self._backend is not None and (self._backend_key == key or busy) and self._backend.alive:
            return self._backend
        if self._backend is not None:
            self._backend.close()
        self._backend = (ProcessDrain if kind == "process" else ThreadDrain)(self.events, options.background_nice)
        self._backend_key = key
        return self._backend

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid (``writer="process"``), else None."""
        return self._backend.pid if isinstance(self._backend, ProcessDrain) else None

    # -- the save thread -----------------------------------------------------------------------------
    def begin(self, task: SaveTask, progress: SaveProgress, stats: SaveStats, plan: SavePlan,
              leaf: Callable[[str], torch.Tensor], guarded: frozenset = frozenset(),
              cuda_ready: dict | None = None) -> Run:
        """Save thread, once planned: a staging ring (waiting if both are draining), the leaves this
        rank reads (``leaf(fqn)``), the drain registration. Never raises: a failure fails the save
        (the run then has no drain; :meth:`stage` still settles its merge transfers)."""
        mine = plan.writes[self.rank]
        run = Run(task, progress, stats, plan, mine, guarded=guarded, cuda_ready=dict(cuda_ready or {}))
        pool = None
        try:
            needed = {c.fqn for c in mine} | {s.fqn for s in plan.sends[self.rank]}
            run = replace(run, leaves={fqn: leaf(fqn) for fqn in needed})
            opts, storage = task.options, task.storage
            pin = any(t.is_cuda for t in run.leaves.values()) and torch.cuda.is_available()
            backend = self.drain_for(opts, storage.is_local)
            pool, stats.pool_wait_s = self._acquire_pool()
            progress.on_failure(pool.abort)
            segments = plan.segments[self.rank]
            heads = [len(plan.head(self.rank, i)) for i in range(len(segments))]
            bases, stream_len = stream_layout(plan.stream_sizes(self.rank))
            if mine:
                storage.makedirs(storage.join(task.path, "data"))
            in_place = (opts.in_place is not None and backend.kind == "thread" and storage.is_local
                        and len(segments) == 1 and not any(heads))
            if in_place:  # the ring is the data file: staging writes the checkpoint
                target = storage.strip(storage.join(task.path, segments[0][0]))
                take_spare(str(opts.in_place), target)
                pool.reserve_file(target, stream_len)
            else:
                cap = self.ring_bytes(opts)
                pool.reserve(min(stream_len, cap), pin=pin, shared=backend.kind == "process", limit=cap)
                pool.prefault(stream_len)  # a fresh ring (a first save): its pages faulted in beside the copies
            pool.begin()
            stats.pool_capacity, stats.pool_allocations, stats.pool_index = (pool.capacity_bytes, pool.allocations,
                                                                             pool.index)
            stats.streamed = stream_len > pool.capacity_bytes
            run = replace(run, pool=pool, in_place=in_place, stream_pos=[bases[c.segment] + c.offset - heads[c.segment] for c in mine],
                          staging=StagingGate(opts.overlap_drain), drained=DrainPart([None] * len(mine)))
            backend.attach(pool)  # may raise: then nothing is registered
            run = replace(run, backend=backend)
            self._start(run, bases)
        except BaseException as e:
            run.fail(failure_text("snapshot stage (preparing)", e))
            if pool is not None and run.backend is None:
                pool.released.set()
                run = replace(run, pool=None)
        self._runs[run.seq] = run
        return run

    def _acquire_pool(self) -> tuple[StagingPool, float]:
        t0 = time.perf_counter()
        while True:
            with self._pools_lock:
                for pool in self.pools:
                    if pool.released.is_set():
                        pool.released.clear()
                        return pool, time.perf_counter() - t0
            # both pools are draining: wait for either (the older one finishes first)
            self.pools[0].released.wait(0.05) or self.pools[1].released.wait(0.05)

    def _start(self, run: Run, bases: list[int]) -> None:
        """Register ``run`` with its drain (its pool is reserved, acquired and attached)."""
        assert run.pool is not None and run.backend is not None
        task = run.task
        plan = run.plan
        segs = [(task.storage.join(task.path, rel), bases[i], n)
                for i, ((rel, _), n) in enumerate(zip(plan.segments[self.rank], plan.stream_sizes(self.rank)))]
        heads = {i: h for i in range(len(segs)) if (h := plan.head(self.rank, i))}
        chunks = [(pos, c.nbytes, block_size(c.nbytes) if c.nbytes > CHECKSUM_BLOCK_BYTES else 0)
                  for pos, c in zip(run.stream_pos, run.mine)]
        self.events.active[run.seq] = run
        run.backend.start_job(JobSpec(run.seq, run.pool.index, run.pool.capacity_bytes, segs, chunks,
                                      direct=task.options.direct_io, write_block=task.options.write_block,
                                      storage_options=task.storage_options, in_place=run.in_place, heads=heads))

    def stage(self, run: Run) -> None:
        """Save thread: stage the run (what the caller must not change first, then the rest), setting
        ``released`` once the caller may go on and ``snapshot_done`` once every byte is staged."""
        progress = run.progress
        try:
            if run.backend is None:  # this rank could not start its drain: settle what it owes, report at the commit
                self._settle(run)
                progress.finish_snapshot()
                return
            sends = run.plan.sends[self.rank]
            first, rest = self._chunks(run)
            self._run_items(run, sends, first, final=not rest)
            if rest:
                progress.released.set()
                self._run_items(run, [], rest, final=True)
        except BaseException as e:  # pragma: no cover - a bug: never leave a caller waiting
            run.fail(failure_text("snapshot stage (internal)", e))
            progress.finish_snapshot()

    def _settle(self, run: Run) -> None:
        self.transfers.settle(run.seq, run.plan.sends[self.rank], run.mine, run.transfers, run.fail)

    def _chunks(self, run: Run) -> tuple[range, range]:
        """This rank's chunks (indexes into ``run.mine``): what must be staged before the caller may go
        on, and the rest (the chunks of tensors an optimizer step hook guards: the plan put them last)."""
        n = len(run.mine)
        if not run.guarded:
            return range(n), range(n, n)
        first = next((i for i, c in enumerate(run.mine) if c.fqn in run.guarded), n)
        return range(first), range(first, n)

    def _run_items(self, run: Run, sends: list[SendOp], chunks: range, final: bool) -> None:
        """Post ``sends`` and stage ``chunks``; on the final part, close the run's stream and mark the
        snapshot done."""
        t0 = time.perf_counter()
        backend = run.backend
        assert backend is not None
        try:
            if run.progress.error is None:
                self._stage_items(run, sends, chunks, backend)
            if final:
                self._sync_cuda(run)
        except BaseException as e:
            if not isinstance(e, PoolAborted):
                run.fail(failure_text("snapshot stage (staging copy)", e))
            self._settle(run)
        run.stats.stage_s += time.perf_counter() - t0
        if final:
            if run.progress.error is not None:
                self._settle(run)
            self._open_gate(run)
            backend.end_job(run.seq, run.progress.error)
            run.stats.snapshot_s = time.perf_counter() - run.task.t0
            run.progress.finish_snapshot()

    def _stage_items(self, run: Run, sends: list[SendOp], chunks: range, backend: ThreadDrain | ProcessDrain) -> None:
        pool = run.pool
        assert pool is not None
        piece = run.task.options.piece_bytes
        cuda = self._cuda_for(run)
        if sends:
            self.transfers.post_sends(run.seq, pool, run.leaves, sends, cuda, run.transfers)
        stats = run.stats
        for ci in chunks:
            chunk = run.mine[ci]
            base = run.stream_pos[ci]
            for fill in chunk.fills:
                if run.progress.error is not None:
                    raise PoolAborted(run.progress.error)
                if isinstance(fill, RecvFill):
                    start, end = base + fill.byte_start, base + fill.byte_start + fill.nbytes
                    pool.acquire(end, on_block=lambda: self._open_gate(run))
                    (into,) = pool.region(start, end)  # receives never straddle the wrap (granule cuts)
                    received = self.transfers.post_recv(run.seq, fill, into, run.transfers)
                    self._item(run, backend, start, end, ci, received)
                    continue
                src = byte_view(_narrow(run.leaves[chunk.fqn], fill.view))
                on_cuda = src.is_cuda
                done = 0
                while done < fill.nbytes:
                    n = min(piece, fill.nbytes - done)
                    start = base + fill.byte_start + done
                    pool.acquire(start + n, on_block=lambda: self._open_gate(run))
                    dst = pool.region(start, start + n)
                    wait: Callable[[], object] | None = None
                    if on_cuda:
                        assert cuda is not None  # CUDA tensors come with cuda_ready
                        stream = cuda.stream_for(src.device)
                        with torch.cuda.stream(stream):
                            copy_bytes(dst, src, fill.src_byte + done, n, stream)
                        ev = cuda.record(src.device)
                        wait = ev.synchronize
                    else:
                        copy_bytes(dst, src, fill.src_byte + done, n)
                    stats.bytes_staged += n
                    self._item(run, backend, start, start + n, ci, wait)
                    done += n

    @staticmethod
    def _item(run: Run, backend: ThreadDrain | ProcessDrain, start: int, end: int, ci: int,
              wait: Callable[[], object] | None) -> None:
        gate = run.staging
        with gate.lock:
            if not gate.open:
                gate.held.append(StagedPiece(start, end, ci, wait))
                return
        backend.item(run.seq, start, end, ci, wait)

    @staticmethod
    def _open_gate(run: Run) -> None:
        """Let the drain start on ``run`` (at the end of the snapshot, or when the ring is full)."""
        gate = run.staging
        with gate.lock:
            if gate.open:
                return
            gate.open = True
            held, gate.held = gate.held, []
        assert run.backend is not None
        for p in held:
            run.backend.item(run.seq, p.start, p.end, p.ci, p.wait)

    # -- CUDA ----------------------------------------------------------------------------------------
    def _cuda_for(self, run: Run) -> CudaStager | None:
        if not run.cuda_ready:
            return None
        if self._cuda is None:
            self._cuda = CudaStager()
        if not run.staging.cuda_begun:
            self._cuda.begin(run.cuda_ready)
            run.staging.cuda_begun = True
        return self._cuda

    def _sync_cuda(self, run: Run) -> None:
        """Block until every D2H copy of the run has landed (the snapshot is then complete)."""
        if run.cuda_ready and self._cuda is not None:
            for dev in run.cuda_ready:
                self._cuda.stream_for(dev).synchronize()

    # -- the commit thread ------------------------------------------------------------------------------
    def wait_drained(self, seq: int) -> DrainResult:
        """Commit thread, after ``planned``: block until save ``seq``'s bytes are written, fsynced and
        uploaded and its merge sends have completed; then free its ring and fill its stage times."""
        run = self._runs.pop(seq)
        started, drained, log = run.backend is not None, run.drained, run.transfers
        if started:
            drained.backend_done.wait()
            drained.uploads_done.wait()
            for w in log.send_works:
                try:
                    w.wait()
                except Exception as e:  # a peer died: the commit gather will report it too
                    run.fail(failure_text("merge send", e))
            log.send_works = []
        stats = run.stats  # the drain's and the transfers' parts, merged once
        for k in ("checksum_s", "merge_wait_s", "write_s", "upload_s"):
            setattr(stats, k, drained.timings.get(k, 0.0))
        stats.bytes_written += drained.bytes_written
        stats.bytes_uploaded += drained.bytes_uploaded
        stats.p2p_sends, stats.p2p_recvs = log.sends, log.recvs
        stats.merge_bytes_sent, stats.merge_bytes_received = log.bytes_sent, log.bytes_received
        if run.pool is not None:
            stats.ring_wait_s = run.pool.wait_s
            if run.in_place:  # the file is the checkpoint's now: never touched through this ring again
                if run.backend is not None and hasattr(run.backend, "detach"):
                    run.backend.detach(run.pool)
                run.pool.release_file()
            run.pool.released.set()
        return DrainResult(drained.digests, started)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        for pool in self.pools:
            pool.close()
