"""The save pipeline on one rank: stage -> serialize/checksum -> write -> (upload), overlapping per piece.

Threads (per engine; saves are served in the order they were called):

1. **stager** (:meth:`SavePipeline.submit`): runs the save's planning (the engine's, with its one
   collective), then copies this rank's chunks into a staging ring
   (:class:`~unickpt.staging.StagingPool`) piece by piece (at most ``piece_bytes``) in file
   (stream) order, issues the merge sends and receives (:mod:`unickpt.merging`) and hands each piece
   to the drain. When the state is larger than the ring, it waits for the writer to free space:
   the state streams through bounded memory.
2. **serialize/checksum** and 3. **write**: :class:`~unickpt.hashwrite.HashWriter`'s hasher and
   writer threads, in this process (``writer="thread"``) or in a worker process that maps the ring
   as shared memory (``writer="process"``). The hasher runs each piece's deferred wait first (merge
   receive, CUDA copy event). The drain starts with the first staged piece (``overlap_drain``), or
   else when the snapshot is complete or the stager has to wait for ring space.
4. **uploader** (optional, ``upload_to``): copies each data file, once it is written and fsynced,
   to the remote directory, while the next file is written.
5. the engine's commit thread (not here) waits for :meth:`SavePipeline.wait_drained`.

Snapshot modes, i.e. when ``save`` returns:

* ``sync`` (default): after the last byte is staged. Nothing the caller does afterwards can reach
  the checkpoint.
* ``overlap``: at once. The tensors an optimizer in the state owns (its parameters and its state:
  only ``optimizer.step()`` changes them) are staged while the training loop runs its next
  forward/backward, and a step pre-hook on each such optimizer blocks ``optimizer.step()`` until
  the snapshot is complete (DCP's async staging has the loop make the same wait by hand). All other
  tensors (buffers, plain tensors) are cloned at the call when they are small (64 MiB in all), or
  else staged before the call returns; plain values and per-rank objects are always captured at
  the call. Changing optimizer-owned tensors in place by other means than ``optimizer.step()``
  before ``handle.wait_snapshot()`` returns is not allowed in this mode.

Failures: the first failure of any stage (with the stage's name) fails the job; the stager stops,
still completes the merge transfers it owes its peers (so they never hang), and the commit
gathers every rank's failure; nothing is committed.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from .hashwrite import GRANULE_BYTES, HashWriter, JobSpec, WriterProcess, stream_layout
from .merging import P2P
from .metadata import CHECKSUM_BLOCK_BYTES, block_size
from .planner import RecvFill, SavePlan, SendOp, WriteChunk
from .resharding import Box
from .staging import CudaStager, PoolAborted, StagingPool, byte_view, copy_bytes
from .storage import Storage

__all__ = ["SaveOptions", "SaveJob", "SavePipeline", "default_pool_cap"]


def default_pool_cap(world_size: int = 1) -> int:
    """Default bound of one staging ring: a quarter of physical memory shared by the ranks of this
    host (``LOCAL_WORLD_SIZE``, else, conservatively, the group's ``world_size``), so that both rings
    of every local rank stay under half of it; at least 64 MiB."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        phys = 16 << 30
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))
    cap = phys // (4 * local)
    return max(64 << 20, cap // GRANULE_BYTES * GRANULE_BYTES)


@dataclass(frozen=True)
class SaveOptions:
    """How saves run (set with ``Engine.configure``; ``UNICKPT_POOL_BYTES`` sets the default bound).

    Attributes:
        pool_bytes: bound of each of the two staging rings, bytes (a multiple of 1 MiB is used;
            at least ``2 * piece_bytes``). None: :func:`default_pool_cap`. A rank's save larger
            than this streams through the ring.
        piece_bytes: the stager's step: it copies at most this much before handing it to the
            drain (and needs this much free ring space to go on).
        segment_bytes: data files are cut at this size (a larger chunk gets a file of its own);
            with ``upload_to`` a smaller size lets uploads overlap writes sooner.
        flat_ranges: ``"store"`` (flat-range shards stored as they are) or ``"merge"`` (merged
            into regular row blocks by point-to-point transfers; :mod:`unickpt.merging`).
        snapshot: ``"sync"`` or ``"overlap"`` (see the module docstring).
        writer: ``"thread"`` (hash and write threads in this process) or ``"process"`` (a worker
            process on shared-memory rings; local storage only, else threads are used).
        direct_io: write local data files of at least 1 MiB with ``O_DIRECT`` (DMA from the ring,
            no copy into the page cache: ``Storage.write_file(direct=True)``; file systems that
            refuse it, such as tmpfs, get buffered writes). On by default: measured here it keeps
            a save's time to durable within 1.2-1.3x of the disk's sequential bandwidth and the
            training loop's step-time interference at 0-4 %, against 1.3-1.8x and 15-25 % for
            page-cache writes (benchmarks/README.md). False: buffered writes with block-wise
            writeback (``_Writeback``).
        overlap_drain: start checksumming and writing with the first staged piece (each stage
            overlapping the others); False: only once the snapshot is complete (or the ring is
            full), so that the drain does not compete with the snapshot for the CPU.
        upload_to: a directory URL; each checkpoint ``path`` is mirrored to
            ``upload_to/<basename(path)>`` and committed there too.
        upload_options: fsspec storage options of ``upload_to``.
        background_nice: niceness of the drain threads / process (0: none).
        write_block: the writer's largest single write, bytes.
        check_replicas: compare the holders' copies of every chunk saved as replicated
            (:mod:`unickpt.replicas`): ``"first"`` (default) a sampled digest on the first save of each
            layout, ``"always"`` every byte on every save (a debug option; ``UNICKPT_CHECK_REPLICAS=always``
            sets it), ``"off"`` never. Different copies raise ReplicaMismatchError on every rank.
    """

    pool_bytes: int | None = None
    piece_bytes: int = 16 << 20
    segment_bytes: int = 1 << 30
    flat_ranges: str = "store"
    snapshot: str = "sync"
    writer: str = "thread"
    direct_io: bool = True
    overlap_drain: bool = True
    upload_to: str | None = None
    upload_options: dict | None = None
    background_nice: int = 0
    write_block: int = 16 << 20
    check_replicas: str | None = None

    def validated(self) -> "SaveOptions":
        """A copy with defaults filled in; raises ValueError for a bad value."""
        opts = self
        if opts.pool_bytes is None and os.environ.get("UNICKPT_POOL_BYTES"):
            opts = replace(opts, pool_bytes=int(os.environ["UNICKPT_POOL_BYTES"]))
        if opts.check_replicas is None:
            opts = replace(opts, check_replicas=os.environ.get("UNICKPT_CHECK_REPLICAS") or "first")
        if opts.check_replicas not in ("first", "always", "off"):
            raise ValueError(f"check_replicas must be 'first', 'always' or 'off', got {opts.check_replicas!r}")
        if opts.flat_ranges not in ("store", "merge"):
            raise ValueError(f"flat_ranges must be 'store' or 'merge', got {opts.flat_ranges!r}")
        if opts.snapshot not in ("sync", "overlap"):
            raise ValueError(f"snapshot must be 'sync' or 'overlap', got {opts.snapshot!r}")
        if opts.writer not in ("thread", "process"):
            raise ValueError(f"writer must be 'thread' or 'process', got {opts.writer!r}")
        if opts.piece_bytes < 4096 or opts.piece_bytes % 4096:
            raise ValueError(f"piece_bytes must be a positive multiple of 4096, got {opts.piece_bytes}")
        if opts.pool_bytes is not None and opts.pool_bytes < 2 * opts.piece_bytes:
            raise ValueError(f"pool_bytes ({opts.pool_bytes}) must be at least 2 * piece_bytes ({opts.piece_bytes})")
        if opts.segment_bytes < 1:
            raise ValueError(f"segment_bytes must be positive, got {opts.segment_bytes}")
        if opts.write_block < 4096:
            raise ValueError(f"write_block must be at least 4096, got {opts.write_block}")
        return opts

    def pool_cap(self, world_size: int = 1) -> int:
        """The bound of one staging ring, bytes (a multiple of the granule)."""
        cap = self.pool_bytes if self.pool_bytes is not None else default_pool_cap(world_size)
        return max(cap // GRANULE_BYTES * GRANULE_BYTES, GRANULE_BYTES, 2 * self.piece_bytes)

    def plan_key(self) -> tuple:
        """The options every rank must share (they shape the plan or the commit)."""
        return (self.flat_ranges, self.segment_bytes, self.upload_to, self.snapshot, self.check_replicas)


@dataclass
class SaveJob:
    """One save on this rank, as the pipeline and the commit thread share it."""

    seq: int  # the save's number, equal on every rank (tags merge transfers)
    path: str
    storage: Storage
    plan: SavePlan | None
    rank: int
    options: SaveOptions
    stats: Any
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)
    pool: StagingPool | None = None
    storage_options: dict | None = None
    guarded: frozenset = frozenset()  # fqns staged in the background (overlap mode)
    cuda_ready: dict = field(default_factory=dict)
    error: str | None = None  # the first stage failure (text with the stage's name)
    plan_error: BaseException | None = None  # planning failed (on every rank alike): nothing was started
    prepared: threading.Event = field(default_factory=threading.Event)  # planned (or failed to)
    released: threading.Event = field(default_factory=threading.Event)  # the caller may go on
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    drained: threading.Event = field(default_factory=threading.Event)  # written, fsynced, uploaded
    digests: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    send_works: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _gate_open: bool = False
    _held: list = field(default_factory=list)
    _backend_done: threading.Event = field(default_factory=threading.Event)
    _uploads_done: threading.Event = field(default_factory=threading.Event)
    t0: float = 0.0  # perf_counter() at the save call
    backend: Any = None
    stream_pos: list = field(default_factory=list)  # stream position of each of this rank's chunks
    cuda_begun: bool = False
    _posted_sends: set = field(default_factory=set)
    _posted_recvs: set = field(default_factory=set)

    @property
    def mine(self) -> list[WriteChunk]:
        assert self.plan is not None
        return self.plan.writes[self.rank]

    def fail(self, text: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = text
        if self.pool is not None:
            self.pool.abort(text)


def _format(stage: str, e: BaseException) -> str:
    return f"{stage}: " + "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _narrow(t: torch.Tensor, view: Box | None) -> torch.Tensor:
    if view is None:
        return t
    for d, (o, n) in enumerate(zip(view.offsets, view.lengths)):
        t = t.narrow(d, o, n)
    return t


class _ThreadBackend:
    """Hash + write threads in this process, reading the rings directly."""

    kind = "thread"

    def __init__(self, pipeline: "SavePipeline", nice: int):
        self._views: dict[int, memoryview] = {}
        p = pipeline
        self.hw = HashWriter(lambda i: self._views[i], Storage, freed=p._on_freed, chunk=p._on_chunk,
                             segment=p._on_segment, done=p._on_done, failed=p._on_failed, nice=nice)

    def attach(self, pool: StagingPool) -> None:
        self._views[pool.index] = pool.memoryview()

    def start_job(self, spec: JobSpec) -> None:
        self.hw.start_job(spec)

    def item(self, job: int, start: int, end: int, chunk: int, wait: Callable | None) -> None:
        self.hw.item(job, start, end, chunk, wait)

    def end_job(self, job: int, error: str | None) -> None:
        self.hw.end_job(job, error)

    @property
    def alive(self) -> bool:
        return True

    def close(self) -> None:
        self.hw.close()


class _ProcessBackend:
    """Hash + write in a worker process (:class:`~unickpt.hashwrite.WriterProcess`); a dispatcher
    thread runs each piece's deferred wait here, then forwards it, keeping the order."""

    kind = "process"

    def __init__(self, pipeline: "SavePipeline", nice: int):
        p = pipeline
        self.proc = WriterProcess(freed=p._on_freed, chunk=p._on_chunk, segment=p._on_segment, done=p._on_done,
                                  failed=p._on_failed, died=p._on_writer_died, nice=nice)
        self._mapped: dict[int, tuple[int, int]] = {}
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._on_failed = p._on_failed
        self._thread = threading.Thread(target=self._dispatch, name="unickpt-dispatch", daemon=True)
        self._thread.start()

    def attach(self, pool: StagingPool) -> None:
        key = (pool.memfd, pool.capacity_bytes)
        if self._mapped.get(pool.index) != key:
            assert pool.memfd is not None
            self.proc.map(pool.index, pool.memfd, pool.capacity_bytes)
            self._mapped[pool.index] = key

    def start_job(self, spec: JobSpec) -> None:
        self._q.put(("start", spec))

    def item(self, job: int, start: int, end: int, chunk: int, wait: Callable | None) -> None:
        self._q.put(("item", job, start, end, chunk, wait))

    def end_job(self, job: int, error: str | None) -> None:
        self._q.put(("end", job, error))

    @property
    def alive(self) -> bool:
        return self.proc.alive

    def _dispatch(self) -> None:
        while True:
            msg = self._q.get()
            if msg is None:
                return
            try:
                if msg[0] == "start":
                    self.proc.start_job(msg[1])
                elif msg[0] == "item":
                    _, job, start, end, chunk, wait = msg
                    if wait is not None:
                        try:
                            wait()
                        except BaseException as e:
                            self._on_failed(job, _format("checksum stage (serialize)", e))
                    self.proc.item(job, start, end, chunk)
                else:
                    self.proc.end_job(msg[1], msg[2])
            except OSError:  # the worker is gone; its reader thread reports it
                pass

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)
        self.proc.close()


class SavePipeline:
    """The stager, drain backend and uploader of one engine (see the module docstring).

    Args:
        p2p: merge transfers (None for a world of one).
        rank: this rank in the group.
    """

    def __init__(self, p2p: P2P | None, rank: int):
        self.p2p, self.rank = p2p, rank
        self._jobs: dict[int, SaveJob] = {}
        self._backend: _ThreadBackend | _ProcessBackend | None = None
        self._backend_key: tuple | None = None
        self._cuda: CudaStager | None = None
        self._stage_q: queue.SimpleQueue = queue.SimpleQueue()
        self._stager = threading.Thread(target=self._stage_loop, name="unickpt-stager", daemon=True)
        self._stager.start()
        self._upload_q: queue.SimpleQueue = queue.SimpleQueue()
        self._uploader = threading.Thread(target=self._upload_loop, name="unickpt-upload", daemon=True)
        self._uploader.start()

    # -- backend ------------------------------------------------------------------------------------
    def backend_for(self, options: SaveOptions, local: bool, busy: bool) -> _ThreadBackend | _ProcessBackend:
        """The drain backend for these options (started on first use; swapped only while idle)."""
        kind = options.writer if local else "thread"
        key = (kind, options.background_nice)
        if self._backend is not None and (self._backend_key == key or busy) and self._backend.alive:
            return self._backend
        if self._backend is not None:
            self._backend.close()
        self._backend = (_ProcessBackend if kind == "process" else _ThreadBackend)(self, options.background_nice)
        self._backend_key = key
        return self._backend

    # -- staging --------------------------------------------------------------------------------------
    def start(self, job: SaveJob, backend: _ThreadBackend | _ProcessBackend) -> None:
        """Register ``job`` with the drain (its pool is reserved and acquired)."""
        assert job.pool is not None
        mine = job.mine
        sizes = [n for _, n in job.plan.segments[self.rank]]
        bases, _ = stream_layout(sizes)
        segs = [(job.storage.join(job.path, rel), bases[i], n) for i, (rel, n) in enumerate(job.plan.segments[self.rank])]
        chunks = [(bases[c.segment] + c.offset, c.nbytes,
                   block_size(c.nbytes) if c.nbytes > CHECKSUM_BLOCK_BYTES else 0) for c in mine]
        job.digests = [None] * len(mine)
        job.timings = {"checksum_s": 0.0, "merge_wait_s": 0.0, "write_s": 0.0, "upload_s": 0.0}
        job.stream_pos = [bases[c.segment] + c.offset for c in mine]
        job._gate_open = job.options.overlap_drain
        backend.attach(job.pool)  # may raise: then nothing is registered
        job.backend = backend
        self._jobs[job.seq] = job
        backend.start_job(JobSpec(job.seq, job.pool.index, job.pool.capacity_bytes, segs, chunks,
                                  direct=job.options.direct_io, write_block=job.options.write_block,
                                  storage_options=job.storage_options))

    def submit(self, job: SaveJob, plan: Callable[[SaveJob], None], prepare: Callable[[SaveJob], None]) -> None:
        """Queue ``job`` for the stager thread, which runs, in save order: ``plan(job)`` (the planning
        collectives; raising fails the save consistently on every rank: :attr:`SaveJob.plan_error`),
        ``prepare(job)`` (pool, drain registration: :meth:`start`; raising fails this rank's part),
        then the staging. :attr:`SaveJob.released` is set once the caller may change what is not
        guarded, :attr:`SaveJob.snapshot_done` once everything is staged."""
        self._stage_q.put((job, plan, prepare))

    def _stage_loop(self) -> None:
        while True:
            got = self._stage_q.get()
            if got is None:
                return
            job, plan, prepare = got
            try:
                self._process(job, plan, prepare)
            except BaseException as e:  # pragma: no cover - a bug: never leave a caller waiting
                job.fail(_format("snapshot stage (internal)", e))
                job.released.set()
                job.snapshot_done.set()
                job.prepared.set()

    def _process(self, job: SaveJob, plan: Callable, prepare: Callable) -> None:
        try:
            plan(job)
        except BaseException as e:
            job.plan_error = e
            job.prepared.set()
            job.released.set()
            job.snapshot_done.set()
            return
        try:
            prepare(job)
        except BaseException as e:
            job.fail(_format("snapshot stage (preparing)", e))
        job.prepared.set()
        if job.backend is None:  # this rank could not start its drain: settle what it owes, report at the commit
            self._settle_transfers(job)
            job.released.set()
            job.snapshot_done.set()
            return
        first, rest = self._items(job)
        self._run(job, first, final=not rest)
        if rest:
            job.released.set()
            self._run(job, rest, final=True)

    def _items(self, job: SaveJob) -> tuple[list, list]:
        """(what must be staged before the caller may go on, the rest)."""
        sends = [("send", s) for s in job.plan.sends[self.rank]]
        chunks = [("chunk", i, c) for i, c in enumerate(job.mine)]
        if not job.guarded:
            return sends + chunks, []
        # the plan put this rank's guarded chunks last: everything before them goes first
        first = next((i for i, c in enumerate(job.mine) if c.fqn in job.guarded), len(job.mine))
        return sends + chunks[:first], chunks[first:]

    def _run(self, job: SaveJob, items: list, final: bool) -> None:
        """Stage ``items``; on the final part, close the job's stream and mark the snapshot done."""
        t0 = time.perf_counter()
        backend = job.backend
        try:
            if job.error is None:
                self._stage_items(job, items, backend)
            if final:
                self._sync_cuda(job)
        except BaseException as e:
            if not isinstance(e, PoolAborted):
                job.fail(_format("snapshot stage (staging copy)", e))
            self._settle_transfers(job)
        job.stats.stage_s += time.perf_counter() - t0
        if final:
            if job.error is not None:
                self._settle_transfers(job)
            self._open_gate(job)
            backend.end_job(job.seq, job.error)
            job.stats.snapshot_s = time.perf_counter() - job.t0
            job.released.set()
            job.snapshot_done.set()

    def _stage_items(self, job: SaveJob, items: list, backend: Any) -> None:
        pool = job.pool
        assert pool is not None
        piece = job.options.piece_bytes
        cuda = self._cuda_for(job)
        sends = [it[1] for it in items if it[0] == "send"]
        if sends:
            self._issue_sends(job, sends, cuda)
        for it in items:
            if it[0] != "chunk":
                continue
            _, ci, chunk = it
            base = job.stream_pos[ci]
            for fill in chunk.fills:
                if job.error is not None:
                    raise PoolAborted(job.error)
                if isinstance(fill, RecvFill):
                    start, end = base + fill.byte_start, base + fill.byte_start + fill.nbytes
                    pool.acquire(end, on_block=lambda: self._open_gate(job))
                    (dst,) = pool.region(start, end)  # receives never straddle the wrap (granule cuts)
                    work = self.p2p.irecv(dst, fill.src, P2P.tag(job.seq, fill.index))  # type: ignore[union-attr]
                    job._posted_recvs.add(fill.index)
                    job.stats.p2p_recvs += 1
                    job.stats.merge_bytes_received += fill.nbytes
                    self._item(job, backend, start, end, ci, work.wait)
                    continue
                src = byte_view(_narrow(job.leaves[chunk.fqn], fill.view))
                on_cuda = src.is_cuda
                done = 0
                while done < fill.nbytes:
                    n = min(piece, fill.nbytes - done)
                    start = base + fill.byte_start + done
                    pool.acquire(start + n, on_block=lambda: self._open_gate(job))
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
                    job.stats.bytes_staged += n
                    self._item(job, backend, start, start + n, ci, wait)
                    done += n

    def _item(self, job: SaveJob, backend: Any, start: int, end: int, ci: int, wait: Callable | None) -> None:
        with job._lock:
            if not job._gate_open:
                job._held.append((start, end, ci, wait))
                return
        backend.item(job.seq, start, end, ci, wait)

    def _open_gate(self, job: SaveJob) -> None:
        """Let the drain start on ``job`` (at the end of the snapshot, or when the ring is full)."""
        with job._lock:
            if job._gate_open:
                return
            job._gate_open = True
            held, job._held = job._held, []
        backend = job.backend
        for start, end, ci, wait in held:
            backend.item(job.seq, start, end, ci, wait)

    def _issue_sends(self, job: SaveJob, sends: list[SendOp], cuda: CudaStager | None) -> None:
        """Snapshot every merge send into the pool's send buffer, then post them all."""
        assert job.pool is not None and self.p2p is not None
        total = sum(s.nbytes for s in sends)
        pin = any(job.leaves[s.fqn].is_cuda for s in sends)
        buf = job.pool.send_buffer(total, pin=pin and torch.cuda.is_available())
        pos, slots = 0, []
        for s in sends:
            src = byte_view(job.leaves[s.fqn])
            dst = buf[pos : pos + s.nbytes]
            if src.is_cuda and cuda is not None:
                stream = cuda.stream_for(src.device)
                with torch.cuda.stream(stream):
                    copy_bytes([dst], src, s.src_byte, s.nbytes, stream)
            else:
                copy_bytes([dst], src, s.src_byte, s.nbytes)
            slots.append((s, dst))
            pos += s.nbytes
        if pin:
            torch.cuda.synchronize()
        for s, dst in slots:
            job.send_works.append(self.p2p.isend(dst, s.dst, P2P.tag(job.seq, s.index)))
            job._posted_sends.add(s.index)
            job.stats.p2p_sends += 1
            job.stats.merge_bytes_sent += s.nbytes

    def _settle_transfers(self, job: SaveJob) -> None:
        """After a failure: post the merge sends and receives this rank still owes (zeros / scratch)
        and wait for them, so that no peer waits forever; peers learn of the failure at the commit.
        Never raises (a transfer that cannot be settled is added to the job's failure)."""
        if self.p2p is None:
            return
        try:
            self._settle(job)
        except BaseException as e:
            job.fail(_format("merge transfers (settling after a failure)", e))

    def _settle(self, job: SaveJob) -> None:
        assert self.p2p is not None
        owed_sends = [s for s in job.plan.sends[self.rank] if s.index not in job._posted_sends]
        owed_recvs = [f for c in job.mine for f in c.fills
                      if isinstance(f, RecvFill) and f.index not in job._posted_recvs]
        if not owed_sends and not owed_recvs:
            return
        scratch = torch.zeros(max([s.nbytes for s in owed_sends] + [f.nbytes for f in owed_recvs]), dtype=torch.uint8)
        works = []
        for s in owed_sends:
            works.append(self.p2p.isend(scratch[: s.nbytes], s.dst, P2P.tag(job.seq, s.index)))
            job._posted_sends.add(s.index)
        recv_scratch = torch.empty_like(scratch)
        for f in owed_recvs:  # one at a time: they share the scratch buffer
            job._posted_recvs.add(f.index)
            self.p2p.irecv(recv_scratch[: f.nbytes], f.src, P2P.tag(job.seq, f.index)).wait()
        for w in works:
            w.wait()

    # -- CUDA ----------------------------------------------------------------------------------------
    def _cuda_for(self, job: SaveJob) -> CudaStager | None:
        if not job.cuda_ready:
            return None
        if self._cuda is None:
            self._cuda = CudaStager()
        if not job.cuda_begun:
            self._cuda.begin(job.cuda_ready)
            job.cuda_begun = True
        return self._cuda

    def _sync_cuda(self, job: SaveJob) -> None:
        """Block until every D2H copy of the job has landed (the snapshot is then complete)."""
        if job.cuda_ready and self._cuda is not None:
            for dev in job.cuda_ready:
                self._cuda.stream_for(dev).synchronize()

    # -- drain callbacks (backend threads) ------------------------------------------------------------
    def _on_freed(self, seq: int, pos: int) -> None:
        job = self._jobs.get(seq)
        if job is not None and job.pool is not None:
            job.pool.freed(pos)

    def _on_chunk(self, seq: int, c: int, digest: str, blocks: tuple, block_bytes: int) -> None:
        self._jobs[seq].digests[c] = (digest, tuple(blocks), block_bytes)

    def _on_segment(self, seq: int, i: int) -> None:
        job = self._jobs[seq]
        if job.options.upload_to is not None:
            self._upload_q.put(("segment", job, i))

    def _on_failed(self, seq: int, text: str) -> None:
        job = self._jobs.get(seq)
        if job is not None:
            job.fail(text)

    def _on_done(self, seq: int, error: str | None, timings: dict) -> None:
        job = self._jobs.pop(seq, None)
        if job is None:
            return
        if error is not None:
            job.fail(error)
        for k in ("checksum_s", "merge_wait_s", "write_s"):
            job.timings[k] = timings.get(k, 0.0)
        job.stats.bytes_written += timings.get("bytes_written", 0)
        job._backend_done.set()
        if job.options.upload_to is not None:
            self._upload_q.put(("end", job, None))
        else:
            job._uploads_done.set()

    def _on_writer_died(self, text: str) -> None:
        for seq in list(self._jobs):
            self._on_failed(seq, text)
            self._on_done(seq, text, {})

    # -- upload -----------------------------------------------------------------------------------------
    def remote_path(self, job: SaveJob) -> str:
        assert job.options.upload_to is not None
        remote = Storage(job.options.upload_to, job.options.upload_options)
        return remote.join(job.options.upload_to, os.path.basename(job.path.rstrip("/")))

    def _upload_loop(self) -> None:
        while True:
            got = self._upload_q.get()
            if got is None:
                return
            kind, job, i = got
            if kind == "end":
                job._uploads_done.set()
                continue
            if job.error is not None:
                continue
            t0 = time.perf_counter()
            try:
                rel = job.plan.segments[self.rank][i][0]
                job.stats.bytes_uploaded += self.upload_file(job, rel)
            except BaseException as e:
                job.fail(_format("upload stage", e))
            job.timings["upload_s"] += time.perf_counter() - t0

    def upload_file(self, job: SaveJob, rel: str) -> int:
        """Copy ``<path>/<rel>`` to the remote checkpoint directory; returns bytes copied."""
        remote = Storage(job.options.upload_to, job.options.upload_options)  # type: ignore[arg-type]
        rdir = self.remote_path(job)
        dst = remote.join(rdir, *rel.split("/"))
        remote.makedirs(remote.join(rdir, *rel.split("/")[:-1]))
        src = job.storage.join(job.path, *rel.split("/"))
        size = job.storage.size(src)
        block = 8 << 20

        def chunks():  # fresh buffers: a remote write_file may keep them all until it ends
            off = 0
            while off < size:
                n = min(block, size - off)
                buf = bytearray(n)
                job.storage.read_into(src, [(off, n)], memoryview(buf), base=off)
                yield buf
                off += n

        return remote.write_file(dst, chunks())

    def wait_drained(self, job: SaveJob) -> None:
        """Commit thread: block until the job's bytes are written, fsynced and uploaded and its merge
        sends have completed; then the pool is free."""
        job._backend_done.wait()
        job._uploads_done.wait()
        for w in job.send_works:
            try:
                w.wait()
            except Exception as e:  # a peer died: the commit gather will report it too
                job.fail(_format("merge send", e))
        job.send_works = []
        job.drained.set()

    def close(self) -> None:
        self._stage_q.put(None)
        self._upload_q.put(None)
        self._stager.join(timeout=30)
        self._uploader.join(timeout=30)
        if self._backend is not None:
            self._backend.close()
            self._backend = None
