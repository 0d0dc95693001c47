"""The save pipeline on one rank: stage -> serialize/checksum -> write -> (upload), overlapping per piece.

It receives a save whose plan is agreed (:mod:`.agree`) and runs it; it never plans and never calls
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
5. the commit thread (:mod:`.commit`) waits for :meth:`SavePipeline.wait_drained`.

Failures: the first failure of any stage (with the stage's name) fails the save
(:meth:`~unickpt.saving.request.SaveProgress.fail`); staging stops, still completes the merge transfers
it owes its peers (so they never hang), and the commit gathers every rank's failure; nothing is
committed. No collective here: only point-to-point merge transfers.
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..dist.p2p import P2P
from ..format.integrity import CHECKSUM_BLOCK_BYTES, block_size
from ..geometry import Box
from ..options import SaveOptions
from ..plan.save_plan import RecvFill, SavePlan
from ..plan.stream import stream_layout
from .drain import JobSpec, ThreadDrain
from .writer_process import ProcessDrain
from .request import SaveProgress, SaveRequest, SaveStats
from .staging import CudaStager, PoolAborted, StagingPool, byte_view, copy_bytes, ring_capacity
from .transfers import MergeTransfers
from .upload import Uploader

__all__ = ["SavePipeline", "DrainResult"]


def _format(stage: str, e: BaseException) -> str:
    return f"{stage}: " + "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _narrow(t: torch.Tensor, view: Box | None) -> torch.Tensor:
    if view is None:
        return t
    for d, (o, n) in enumerate(zip(view.offsets, view.lengths)):
        t = t.narrow(d, o, n)
    return t


@dataclass
class DrainResult:
    """What the drain of one save produced on this rank: per chunk of ``plan.writes[rank]``,
    ``(checksum, block checksums, block bytes)`` (None where a chunk was not written), and whether
    the drain ran at all."""

    digests: list
    started: bool


class _Run:
    """One save's staging and drain on this rank (private to the pipeline)."""

    def __init__(self, request: SaveRequest, progress: SaveProgress, stats: SaveStats, plan: SavePlan):
        self.request, self.progress, self.stats, self.plan = request, progress, stats, plan
        self.seq = request.seq
        self.mine = plan.writes[request.rank]
        self.leaves: dict[str, torch.Tensor] = {}
        self.guarded: frozenset = frozenset()
        self.cuda_ready: dict = {}
        self.cuda_begun = False
        self.pool: StagingPool | None = None
        self.backend: Any = None  # the drain, once the run is registered with it
        self.stream_pos: list[int] = []  # stream position of each of this rank's chunks
        self.digests: list = []
        self.timings = {"checksum_s": 0.0, "merge_wait_s": 0.0, "write_s": 0.0, "upload_s": 0.0}
        self.lock = threading.Lock()
        self.gate_open = False
        self.held: list = []
        self.posted_sends: set = set()  # merge transfers posted (:mod:`.transfers`), by index
        self.posted_recvs: set = set()
        self.send_works: list = []
        self.backend_done = threading.Event()
        self.uploads_done = threading.Event()

    def fail(self, text: str) -> None:
        self.progress.fail(text)


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
        self._runs: dict[int, _Run] = {}  # begun, not yet waited for by the commit thread
        self._active: dict[int, _Run] = {}  # registered with the drain, not yet done
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
        busy = bool(self._active)
        if self._backend is not None and (self._backend_key == key or busy) and self._backend.alive:
            return self._backend
        if self._backend is not None:
            self._backend.close()
        self._backend = (ProcessDrain if kind == "process" else ThreadDrain)(self, options.background_nice)
        self._backend_key = key
        return self._backend

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid (``writer="process"``), else None."""
        return self._backend.pid if isinstance(self._backend, ProcessDrain) else None

    # -- the save thread -----------------------------------------------------------------------------
    def begin(self, request: SaveRequest, progress: SaveProgress, stats: SaveStats, plan: SavePlan,
              leaf: Callable[[str], torch.Tensor], guarded: frozenset = frozenset(),
              cuda_ready: dict | None = None) -> _Run:
        """Save thread, once planned: a staging ring (waiting if both are draining), the leaves this
        rank reads (``leaf(fqn)``), the drain registration. Never raises: a failure fails the save
        (the run then has no drain; :meth:`stage` still settles its merge transfers)."""
        run = _Run(request, progress, stats, plan)
        run.guarded, run.cuda_ready = guarded, dict(cuda_ready or {})
        self._runs[run.seq] = run
        opts = request.options
        try:
            needed = {c.fqn for c in run.mine} | {s.fqn for s in plan.sends[self.rank]}
            run.leaves = {fqn: leaf(fqn) for fqn in needed}
            pin = any(t.is_cuda for t in run.leaves.values()) and torch.cuda.is_available()
            backend = self.drain_for(opts, request.storage.is_local)
            run.pool, stats.pool_wait_s = self._acquire_pool()
            progress.on_failure(run.pool.abort)
            _, stream_len = stream_layout([n for _, n in plan.segments[self.rank]])
            cap = self.ring_bytes(opts)
            run.pool.reserve(min(stream_len, cap), pin=pin, shared=backend.kind == "process", limit=cap)
            run.pool.begin()
            stats.pool_capacity, stats.pool_allocations, stats.pool_index = (run.pool.capacity_bytes,
                                                                             run.pool.allocations, run.pool.index)
            stats.streamed = stream_len > run.pool.capacity_bytes
            if run.mine:
                request.storage.makedirs(request.storage.join(request.path, "data"))
            self._start(run, backend)
        except BaseException as e:
            run.fail(_format("snapshot stage (preparing)", e))
            if run.pool is not None and run.backend is None:
                run.pool.released.set()
                run.pool = None
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

    def _start(self, run: _Run, backend: ThreadDrain | ProcessDrain) -> None:
        """Register ``run`` with the drain (its pool is reserved and acquired)."""
        assert run.pool is not None
        req, plan = run.request, run.plan
        sizes = [n for _, n in plan.segments[self.rank]]
        bases, _ = stream_layout(sizes)
        segs = [(req.storage.join(req.path, rel), bases[i], n) for i, (rel, n) in enumerate(plan.segments[self.rank])]
        chunks = [(bases[c.segment] + c.offset, c.nbytes,
                   block_size(c.nbytes) if c.nbytes > CHECKSUM_BLOCK_BYTES else 0) for c in run.mine]
        run.digests = [None] * len(run.mine)
        run.stream_pos = [bases[c.segment] + c.offset for c in run.mine]
        run.gate_open = req.options.overlap_drain
        backend.attach(run.pool)  # may raise: then nothing is registered
        run.backend = backend
        self._active[run.seq] = run
        backend.start_job(JobSpec(run.seq, run.pool.index, run.pool.capacity_bytes, segs, chunks,
                                  direct=req.options.direct_io, write_block=req.options.write_block,
                                  storage_options=req.storage_options))

    def stage(self, run: _Run) -> None:
        """Save thread: stage the run (what the caller must not change first, then the rest), setting
        ``released`` once the caller may go on and ``snapshot_done`` once every byte is staged."""
        progress = run.progress
        try:
            if run.backend is None:  # this rank could not start its drain: settle what it owes, report at the commit
                self.transfers.settle(run)
                progress.finish_snapshot()
                return
            first, rest = self._items(run)
            self._run_items(run, first, final=not rest)
            if rest:
                progress.released.set()
                self._run_items(run, rest, final=True)
        except BaseException as e:  # pragma: no cover - a bug: never leave a caller waiting
            run.fail(_format("snapshot stage (internal)", e))
            progress.finish_snapshot()

    def _items(self, run: _Run) -> tuple[list, list]:
        """(what must be staged before the caller may go on, the rest)."""
        sends = [("send", s) for s in run.plan.sends[self.rank]]
        chunks = [("chunk", i, c) for i, c in enumerate(run.mine)]
        if not run.guarded:
            return sends + chunks, []
        # the plan put this rank's guarded chunks last: everything before them goes first
        first = next((i for i, c in enumerate(run.mine) if c.fqn in run.guarded), len(run.mine))
        return sends + chunks[:first], chunks[first:]

    def _run_items(self, run: _Run, items: list, final: bool) -> None:
        """Stage ``items``; on the final part, close the run's stream and mark the snapshot done."""
        t0 = time.perf_counter()
        backend = run.backend
        try:
            if run.progress.error is None:
                self._stage_items(run, items, backend)
            if final:
                self._sync_cuda(run)
        except BaseException as e:
            if not isinstance(e, PoolAborted):
                run.fail(_format("snapshot stage (staging copy)", e))
            self.transfers.settle(run)
        run.stats.stage_s += time.perf_counter() - t0
        if final:
            if run.progress.error is not None:
                self.transfers.settle(run)
            self._open_gate(run)
            backend.end_job(run.seq, run.progress.error)
            run.stats.snapshot_s = time.perf_counter() - run.request.t0
            run.progress.finish_snapshot()

    def _stage_items(self, run: _Run, items: list, backend: Any) -> None:
        pool = run.pool
        assert pool is not None
        piece = run.request.options.piece_bytes
        cuda = self._cuda_for(run)
        sends = [it[1] for it in items if it[0] == "send"]
        if sends:
            self.transfers.post_sends(run, sends, cuda)
        stats = run.stats
        for it in items:
            if it[0] != "chunk":
                continue
            _, ci, chunk = it
            base = run.stream_pos[ci]
            for fill in chunk.fills:
                if run.progress.error is not None:
                    raise PoolAborted(run.progress.error)
                if isinstance(fill, RecvFill):
                    start, end = base + fill.byte_start, base + fill.byte_start + fill.nbytes
                    pool.acquire(end, on_block=lambda: self._open_gate(run))
                    (dst,) = pool.region(start, end)  # receives never straddle the wrap (granule cuts)
                    work = self.transfers.post_recv(run, fill, dst)
                    self._item(run, backend, start, end, ci, work.wait)
                    continue
                src = byte_view(_narrow(run.leaves[chunk.fqn], fill.view))
                on_cuda = src.is_cuda
                done = 0
                while done < fill.nbytes:
                    n = min(piece, fill.nbytes - done)
                    start = base + fill.byte_start + done
                    pool.acquire(start + n, on_block=lambda: self._open_gate(run))
                    dst = pool.region(start, start + n)
                    if on_cuda:
                        stream = cuda.stream_for(src.device)
                        with torch.cuda.stream(stream):
                            copy_bytes(dst, src, fill.src_byte + done, n, stream)
                        ev = cuda.record(src.device)
                        wait = ev.synchronize
                    else:
                        copy_bytes(dst, src, fill.src_byte + done, n)
                        wait = None
                    stats.bytes_staged += n
                    self._item(run, backend, start, start + n, ci, wait)
                    done += n

    def _item(self, run: _Run, backend: Any, start: int, end: int, ci: int, wait: Callable | None) -> None:
        with run.lock:
            if not run.gate_open:
                run.held.append((start, end, ci, wait))
                return
        backend.item(run.seq, start, end, ci, wait)

    def _open_gate(self, run: _Run) -> None:
        """Let the drain start on ``run`` (at the end of the snapshot, or when the ring is full)."""
        with run.lock:
            if run.gate_open:
                return
            run.gate_open = True
            held, run.held = run.held, []
        for start, end, ci, wait in held:
            run.backend.item(run.seq, start, end, ci, wait)

    # -- CUDA ----------------------------------------------------------------------------------------
    def _cuda_for(self, run: _Run) -> CudaStager | None:
        if not run.cuda_ready:
            return None
        if self._cuda is None:
            self._cuda = CudaStager()
        if not run.cuda_begun:
            self._cuda.begin(run.cuda_ready)
            run.cuda_begun = True
        return self._cuda

    def _sync_cuda(self, run: _Run) -> None:
        """Block until every D2H copy of the run has landed (the snapshot is then complete)."""
        if run.cuda_ready and self._cuda is not None:
            for dev in run.cuda_ready:
                self._cuda.stream_for(dev).synchronize()

    # -- drain events (drain threads; DrainEvents) -----------------------------------------------------
    def on_freed(self, seq: int, pos: int) -> None:
        run = self._active.get(seq)
        if run is not None and run.pool is not None:
            run.pool.freed(pos)

    def on_chunk(self, seq: int, c: int, digest: str, blocks: tuple, block_bytes: int) -> None:
        self._active[seq].digests[c] = (digest, tuple(blocks), block_bytes)

    def on_segment(self, seq: int, i: int) -> None:
        run = self._active[seq]
        if run.request.options.upload_to is not None:
            rel = run.plan.segments[self.rank][i][0]
            self.uploader.upload_later(run.request, run.progress, rel, lambda n, s, e, r=run: self._uploaded(r, n, s, e))

    def _uploaded(self, run: _Run, nbytes: int, seconds: float, error: BaseException | None) -> None:
        run.stats.bytes_uploaded += nbytes
        run.timings["upload_s"] += seconds
        if error is not None:
            run.fail(_format("upload stage", error))

    def on_failed(self, seq: int, text: str) -> None:
        run = self._active.get(seq)
        if run is not None:
            run.fail(text)

    def on_done(self, seq: int, error: str | None, timings: dict) -> None:
        run = self._active.pop(seq, None)
        if run is None:
            return
        if error is not None:
            run.fail(error)
        for k in ("checksum_s", "merge_wait_s", "write_s"):
            run.timings[k] = timings.get(k, 0.0)
        run.stats.bytes_written += timings.get("bytes_written", 0)
        run.backend_done.set()
        if run.request.options.upload_to is not None:
            self.uploader.after_uploads(run.uploads_done.set)
        else:
            run.uploads_done.set()

    def on_died(self, text: str) -> None:
        for seq in list(self._active):
            self.on_failed(seq, text)
            self.on_done(seq, text, {})

    # -- the commit thread ------------------------------------------------------------------------------
    def wait_drained(self, seq: int) -> DrainResult:
        """Commit thread, after ``planned``: block until save ``seq``'s bytes are written, fsynced and
        uploaded and its merge sends have completed; then free its ring and fill its stage times."""
        run = self._runs.pop(seq)
        started = run.backend is not None
        if started:
            run.backend_done.wait()
            run.uploads_done.wait()
            for w in run.send_works:
                try:
                    w.wait()
                except Exception as e:  # a peer died: the commit gather will report it too
                    run.fail(_format("merge send", e))
            run.send_works = []
        stats = run.stats
        for k in ("checksum_s", "merge_wait_s", "write_s", "upload_s"):
            setattr(stats, k, run.timings.get(k, 0.0))
        if run.pool is not None:
            stats.ring_wait_s = run.pool.wait_s
            run.pool.released.set()
        return DrainResult(run.digests, started)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        for pool in self.pools:
            pool.close()
