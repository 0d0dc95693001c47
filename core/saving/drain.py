"""Hash and write staged bytes: the draining half of the save pipeline. Imports no torch.

A save job's data files are one byte stream (:mod:`unickpt.plan.stream`), held in a staging ring
(:mod:`unickpt.saving.staging`: stream byte ``p`` at ring offset ``p % capacity``). The save thread
fills stream ranges in increasing order and publishes them as *items* ``(start, end, chunk)``; the
two threads of :class:`HashWriter` drain them, overlapping:

* **hasher** (the "serialize" stage): per item, first the item's deferred wait (a merge receive,
  a CUDA copy event), then the bytes go into the chunk's streaming checksum
  (:class:`~unickpt.format.integrity.ChunkHasher`, identical to ``chunk_checksums``); then the position up
  to which bytes are ready is published;
* **writer**: writes each segment's ready bytes in order, fsyncs the segment, and frees ring space
  up to what it wrote. Data files go through ``StorageBackend.write_file`` fed by a generator (any
  backend; buffered local writes, whose writeback is started block by block, see
  :class:`_Writeback`), or, with ``direct=True`` on a local path and at least
  :data:`DIRECT_MIN_BYTES`, through ``write_file(direct=True)`` (``O_DIRECT``: no page-cache copy;
  falls back when the file system refuses).

The same class runs in the training process (:class:`ThreadDrain`, ``writer="thread"``) or in a
worker process (:mod:`unickpt.saving.writer_process`, ``writer="process"``), which maps the staging
ring as shared memory (``memfd``) and talks to the parent over a Unix socket.
Results come back through callbacks: ``freed(job, pos)``, ``chunk(job, c, digest, blocks,
block_bytes)``, ``segment(job, i)``, ``failed(job, error_text)`` (at once) and ``done(job,
error_text_or_None, timings)`` (at the end).
"""
from __future__ import annotations

import mmap
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

from ..format.integrity import ChunkHasher
from ..storage import open_storage
from ..storage.base import StorageBackend
from ..storage.local import DIRECT_ALIGN

__all__ = ["HashWriter", "JobSpec", "DIRECT_MIN_BYTES", "DrainEvents", "ThreadDrain"]

DIRECT_MIN_BYTES = 1 << 20
"""Data files smaller than this are written buffered even with ``direct=True``: below it direct I/O
saves no measurable copy time, and the buffered path through ``Storage`` serves small files."""


@dataclass
class JobSpec:
    """What the drain threads need to know about one save (picklable: it goes to the writer process).

    ``segments``: ``[(path, stream base, size)]`` in stream order; ``chunks``: ``[(stream start,
    nbytes, checksum block bytes or 0)]`` in stream order; ``pool``: which staging ring;
    ``capacity``: its size in bytes; ``heads``: segment -> bytes written before its staged bytes (a
    safetensors header, a multiple of ``DIRECT_ALIGN`` long: the file is ``head + size`` bytes).
    """

    job: int
    pool: int
    capacity: int
    segments: list[tuple[str, int, int]]
    chunks: list[tuple[int, int, int]]  # (stream position, bytes, checksum block bytes or 0)
    direct: bool = False
    write_block: int = 16 << 20
    storage_options: dict | None = None
    in_place: bool = False  # the ring is the (one) data file: nothing to write, only its length to set
    heads: dict[int, bytes] = field(default_factory=dict)


@dataclass
class _JobState:
    spec: JobSpec
    cond: threading.Condition = field(default_factory=threading.Condition)
    ready: int = 0  # stream bytes before this position are hashed and may be written
    items_done: bool = False
    error: str | None = None
    hashers: dict = field(default_factory=dict)
    timings: dict = field(default_factory=lambda: {"checksum_s": 0.0, "merge_wait_s": 0.0, "write_s": 0.0,
                                                   "bytes_written": 0})


class _Staged(NamedTuple):
    """The hasher's work item: stream bytes ``[start, end)`` of chunk ``chunk`` of job ``job`` are
    staged once ``wait()`` (if any) returns."""

    job: int
    start: int
    end: int
    chunk: int
    wait: Callable[[], object] | None


class _End(NamedTuple):
    """The hasher's last item of job ``job`` (``error``: a stage's failure text, or None)."""

    job: int
    error: str | None


def _set_nice(nice: int) -> None:
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:  # pragma: no cover - not permitted: run at normal priority
            pass


def _format(stage: str, e: BaseException) -> str:
    return f"{stage}: " + "".join(traceback.format_exception(type(e), e, e.__traceback__))


class HashWriter:
    """The hasher and writer threads, serving save jobs in the order they were started.

    Args:
        ring: ``ring(pool) -> memoryview`` of that staging ring's bytes.
        storage: ``storage(path, storage_options)`` opens a backend (default :func:`unickpt.storage.open_storage`).
        freed, chunk, segment, done, failed: callbacks (see the module docstring), called from the
            threads; ``failed(job, text)`` comes as soon as a stage fails (so the stager can stop),
            ``done`` once the job is over.
        nice: niceness added to both threads (Linux per-thread ``setpriority``), so that the
            training loop's threads win the CPU when they compete.
    """

    def __init__(self, ring: Callable[[int], memoryview], storage: Callable[..., StorageBackend] = open_storage, *, freed: Callable,
                 chunk: Callable, segment: Callable, done: Callable, failed: Callable, nice: int = 0):
        self._ring, self._storage = ring, storage
        self._freed, self._chunk, self._segment, self._done, self._failed = freed, chunk, segment, done, failed
        self._nice = nice
        self._jobs: dict[int, _JobState] = {}
        self._hash_q: queue.SimpleQueue = queue.SimpleQueue()
        self._write_q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._hash_loop, name="unickpt-hash", daemon=True),
                         threading.Thread(target=self._write_loop, name="unickpt-write", daemon=True)]
        for t in self._threads:
            t.start()

    # -- producer side (the stager) -------------------------------------------------------------
    def start_job(self, spec: JobSpec) -> None:
        state = _JobState(spec)
        self._jobs[spec.job] = state
        self._write_q.put(state)

    def item(self, job: int, start: int, end: int, chunk: int, wait: Callable[[], None] | None = None) -> None:
        """Stream bytes ``[start, end)`` of chunk ``chunk`` are staged (once ``wait()`` returns)."""
        self._hash_q.put(_Staged(job, start, end, chunk, wait))

    def end_job(self, job: int, error: str | None = None) -> None:
        """No more items for ``job``; ``error`` (a stage's failure text) fails it."""
        self._hash_q.put(_End(job, error))

    def close(self) -> None:
        self._hash_q.put(None)
        self._write_q.put(None)
        for t in self._threads:
            t.join(timeout=60)

    def _fail(self, state: _JobState, text: str) -> None:
        with state.cond:
            first = state.error is None
            if first:
                state.error = text
            state.cond.notify_all()
        if first:
            self._failed(state.spec.job, text)
            self._freed(state.spec.job, 1 << 62)  # nothing of a failed job is needed any more

    # -- hasher -----------------------------------------------------------------------------------
    def _hash_loop(self) -> None:
        _set_nice(self._nice)
        while True:
            msg = self._hash_q.get()
            if msg is None:
                return
            state = self._jobs[msg.job]
            if isinstance(msg, _End):
                if msg.error is not None:
                    self._fail(state, msg.error)
                elif state.error is None and state.hashers:
                    self._fail(state, f"checksum stage: chunk(s) {sorted(state.hashers)} were not fully staged")
                with state.cond:
                    state.items_done = True
                    state.cond.notify_all()
                continue
            _, start, end, c, wait = msg
            try:
                if wait is not None:
                    t0 = time.perf_counter()
                    wait()
                    state.timings["merge_wait_s"] += time.perf_counter() - t0
                if state.error is None:
                    t0 = time.perf_counter()
                    self._hash(state, start, end, c)
                    state.timings["checksum_s"] += time.perf_counter() - t0
            except BaseException as e:
                self._fail(state, _format("checksum stage (serialize)", e))
            with state.cond:
                state.ready = max(state.ready, end)
                state.cond.notify_all()

    def _hash(self, state: _JobState, start: int, end: int, c: int) -> None:
        spec = state.spec
        _, cbytes, block_bytes = spec.chunks[c]
        h = state.hashers.get(c)
        if h is None:
            h = state.hashers[c] = ChunkHasher(cbytes, block_bytes)
        for view in _ring_views(self._ring(spec.pool), spec.capacity, start, end):
            h.update(view)
        if h.fed == cbytes:
            digest, blocks, bb = h.finish()
            del state.hashers[c]
            self._chunk(spec.job, c, digest, blocks, bb)

    # -- writer -----------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        _set_nice(self._nice)
        while True:
            state = self._write_q.get()
            if state is None:
                return
            spec = state.spec
            for i, (path, base, size) in enumerate(spec.segments):
                if state.error is not None:
                    break
                t0 = time.perf_counter()
                try:
                    head = spec.heads.get(i, b"")
                    if spec.in_place:
                        self._finish_in_place(state, path, base, size)
                    elif spec.direct and size >= DIRECT_MIN_BYTES and self._storage(path, spec.storage_options).is_local:
                        self._write_direct(state, path, base, size, head)
                    else:
                        self._write_storage(state, path, base, size, head)
                except _Abort:
                    break
                except BaseException as e:
                    self._fail(state, _format("write stage", e))
                    break
                state.timings["write_s"] += time.perf_counter() - t0
                self._segment(spec.job, i)
            with state.cond:  # the stager's end marker may still report an error
                while not state.items_done:
                    state.cond.wait()
            self._freed(spec.job, 1 << 62)
            del self._jobs[spec.job]
            self._done(spec.job, state.error, dict(state.timings))

    def _wait_ready(self, state: _JobState, want: int) -> int:
        """Block until stream bytes before ``want`` are ready; returns the ready position.
        Raises _Abort when the job failed, RuntimeError when the stager ended short of ``want``."""
        with state.cond:
            while state.ready < want and state.error is None and not state.items_done:
                state.cond.wait()
            if state.error is not None:
                raise _Abort()
            if state.ready < want:
                raise RuntimeError(f"the stager ended at stream byte {state.ready}, before byte {want}")
            return state.ready

    def _blocks(self, state: _JobState, base: int, size: int, align: int) -> Iterator[tuple[int, int]]:
        """``(stream start, stream end)`` of successive write blocks of one segment, as they become
        ready: up to ``write_block`` bytes each, every one but the last ending on an ``align``
        boundary relative to ``base``."""
        # at most half the ring: the stager (pieces of at most half the ring) can always fill a block
        block = max(align, min(state.spec.write_block, state.spec.capacity // 2) // align * align)
        pos, end = base, base + size
        while pos < end:
            ready = self._wait_ready(state, min(end, pos + block))
            stop = min(end, ready, pos + block)
            if stop < end:
                stop = base + (stop - base) // align * align
            yield pos, stop
            pos = stop

    def _write_storage(self, state: _JobState, path: str, base: int, size: int, head: bytes = b"") -> None:
        spec = state.spec
        ring = self._ring(spec.pool)
        storage = self._storage(path, spec.storage_options)
        # A local write_file writes each buffer before asking for the next, so ring views can be
        # freed on the next request. A remote one may hold all buffers until the upload ends (to
        # retry it): it gets copies, so the ring is free at once (memory: one segment).
        own = not storage.is_local
        wb = _Writeback(storage.strip(path)) if storage.is_local else None

        def gen() -> Iterator[Any]:
            if head:
                yield head
            for start, stop in self._blocks(state, base, size, 1):
                for v in _ring_views(ring, spec.capacity, start, stop):
                    yield bytes(v) if own else v
                self._freed(spec.job, stop)
                if wb is not None:
                    wb.written(len(head) + start - base, stop - start)

        try:
            storage.write_file(path, gen())
        finally:
            if wb is not None:
                wb.close()
        state.timings["bytes_written"] += len(head) + size

    def _finish_in_place(self, state: _JobState, path: str, base: int, size: int) -> None:
        """In-place staging: the staged bytes are the file already; once they are all checksummed,
        cut the file to its length (the ring is rounded up to a granule)."""
        self._wait_ready(state, base + size)
        storage = self._storage(path, state.spec.storage_options)
        os.truncate(storage.strip(path), size)
        state.timings["bytes_written"] += size

    def _write_direct(self, state: _JobState, path: str, base: int, size: int, head: bytes = b"") -> None:
        spec = state.spec
        ring = self._ring(spec.pool)
        end = base + size
        padded_end = base + -(-size // DIRECT_ALIGN) * DIRECT_ALIGN  # the tail block, rounded up

        def gen() -> Iterator[Any]:
            if head:  # DIRECT_ALIGN long; an anonymous mapping is page-aligned, as O_DIRECT wants
                aligned = mmap.mmap(-1, len(head))
                aligned[:] = head
                yield memoryview(aligned)
            for start, stop in self._blocks(state, base, size, DIRECT_ALIGN):
                yield from _ring_views(ring, spec.capacity, start, padded_end if stop == end else stop)
                self._freed(spec.job, stop)

        self._storage(path, spec.storage_options).write_file(path, gen(), direct=True, size=len(head) + size)
        state.timings["bytes_written"] += len(head) + size


class _Writeback:
    """Writeback of a local file block by block as it is written (Linux ``sync_file_range``, through
    a read-only descriptor of its own): each block's writeback starts as soon as it is written
    (``SYNC_FILE_RANGE_WRITE``), and the writer waits for the previous block's to finish before
    going on, so at most two blocks are dirty at a time and the final fsync finds almost nothing
    left. Buffered writes + fsync then run at the device's rate instead of in one burst at the end
    (measured here, 1 GB saves: 0.5-0.6 s, as with O_DIRECT, against 0.8-1.5 s without). The
    technique is RocksDB's ``bytes_per_sync``. A no-op where unavailable."""

    _fn: Any = None
    WAIT_BEFORE, WRITE, WAIT_AFTER = 1, 2, 4

    def __init__(self, path: str):
        self.path, self.fd = path, None  # type: tuple[str, int | None]
        self._prev: tuple[int, int] | None = None
        if _Writeback._fn is None:
            _Writeback._fn = False
            if sys.platform.startswith("linux"):
                try:
                    import ctypes

                    fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
                    _Writeback._fn = fn
                except (OSError, AttributeError):  # pragma: no cover
                    pass

    def written(self, offset: int, nbytes: int) -> None:
        """Bytes ``[offset, offset + nbytes)`` of the file were just written."""
        if not self._fn or nbytes <= 0:
            return
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                return
        if self._prev is not None:
            self._fn(self.fd, self._prev[0], self._prev[1], self.WAIT_BEFORE | self.WRITE | self.WAIT_AFTER)
        self._fn(self.fd, offset, nbytes, self.WRITE)
        self._prev = (offset, nbytes)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Abort(Exception):
    """The job failed elsewhere: stop writing it."""


def _ring_views(ring: memoryview, capacity: int, start: int, end: int) -> list[memoryview]:
    """The ring bytes of stream range ``[start, end)``: one view, or two where it wraps."""
    if end <= start:
        return []
    a, b = start % capacity, end % capacity or capacity
    if end - start > capacity:
        raise ValueError(f"stream range of {end - start} bytes exceeds the ring's {capacity}")
    if a < b:
        return [ring[a:b]]
    return [ring[a:capacity], ring[0:b]]


# -- the two forms of the drain, as the save pipeline drives them --------------------------------------
class DrainEvents:
    """The callbacks of a drain (called from its threads): see the module docstring. ``died(text)``
    comes once if a writer process dies."""

    def on_freed(self, job: int, pos: int) -> None: ...
    def on_chunk(self, job: int, c: int, digest: str, blocks: tuple, block_bytes: int) -> None: ...
    def on_segment(self, job: int, i: int) -> None: ...
    def on_done(self, job: int, error: str | None, timings: dict) -> None: ...
    def on_failed(self, job: int, text: str) -> None: ...
    def on_died(self, text: str) -> None: ...


class ThreadDrain:
    """Hash + write threads in this process, reading the rings directly (``writer="thread"``)."""

    kind = "thread"

    def __init__(self, events: DrainEvents, nice: int):
        self._views: dict[int, memoryview] = {}
        e = events
        self.hw = HashWriter(lambda i: self._views[i], open_storage, freed=e.on_freed, chunk=e.on_chunk,
                             segment=e.on_segment, done=e.on_done, failed=e.on_failed, nice=nice)

    def attach(self, pool: Any) -> None:
        """Make the staging ring ``pool`` (a :class:`~unickpt.saving.staging.StagingPool`) readable."""
        self._views[pool.index] = pool.memoryview()

    def detach(self, pool: Any) -> None:
        """Forget the ring ``pool`` (an in-place ring about to be unmapped)."""
        self._views.pop(pool.index, None)

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
