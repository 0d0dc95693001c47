"""Staging: the snapshot copy into bounded, reused host memory (the only part of a save that blocks).

A :class:`StagingPool` owns one host buffer used as a *ring* over a save's byte stream (see
:mod:`unickpt.plan.stream`: stream byte ``p`` lives at ring offset ``p % capacity``). The buffer is
kept across saves, so only the first save pays for page faults (copies into fresh memory are
several times slower than into touched memory), and it is reallocated only when a save needs a
larger one than it has, never beyond the configured bound. It is pinned when CUDA tensors are
staged (D2H copies are then DMA on a side stream), and lives in a ``memfd`` when a writer process
must see it. A state larger than the ring streams through it: :meth:`StagingPool.acquire` blocks
the stager until the writer has freed the space (``pool_bytes`` bounds the memory, not the state).

A ring's first use (the first save of a run, and the first save that finds the other ring still
draining) pays for the page faults: the kernel zeroes every new page before a copy can land in it,
which makes a copy into fresh memory several times slower than into resident memory (the ``first``
records of ``benchmarks/results/save_load.json``: ``stages_max_s[0].stage_s`` of a run's first save
against its second). :meth:`StagingPool.prefault` has a helper thread fault the ring in ahead of the
stager, on another core where there is one.

The engine keeps two pools (ping-pong): a save stages into a free one while the previous save
drains the other.

Copies are byte copies (:func:`byte_view`, :func:`row_major_views`), so a chunk can start at any
byte of the stream (chunks are packed in the data files as format v1 has them) and a copy can be
cut at any byte (where the ring wraps, or where a piece ends).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from typing import Callable

import torch

from .._util import host_bytes
from ..geometry import FlatRange, chunk_pieces
from ..options import SaveOptions
from ..plan.stream import GRANULE_BYTES
from ..storage.local import DIRECT_ALIGN

__all__ = ["StagingPool", "PoolAborted", "byte_view", "row_major_views", "copy_bytes", "CudaStager",
           "default_ring_bytes", "ring_capacity"]


def default_ring_bytes(world_size: int = 1, local_world_size: int | None = None) -> int:
    """Default bound of one staging ring: a quarter of physical memory shared by the ranks of this
    host (``local_world_size``, from ``LOCAL_WORLD_SIZE``; else, conservatively, the group's
    ``world_size``), so that both rings of every local rank stay under half of it; at least 64 MiB."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        phys = 16 << 30
    local = max(1, local_world_size or world_size)
    cap = phys // (4 * local)
    return max(64 << 20, cap // GRANULE_BYTES * GRANULE_BYTES)


def ring_capacity(options: SaveOptions, world_size: int = 1, local_world_size: int | None = None) -> int:
    """The bound of one staging ring for ``options``, bytes (a multiple of the granule, at least two pieces)."""
    cap = options.pool_bytes if options.pool_bytes is not None else default_ring_bytes(world_size, local_world_size)
    return max(cap // GRANULE_BYTES * GRANULE_BYTES, GRANULE_BYTES, 2 * options.piece_bytes)


class PoolAborted(RuntimeError):
    """Raised to a stager waiting for ring space when the save it stages for has failed."""


class StagingPool:
    """A reusable, bounded staging ring. One save at a time owns it (``released`` is set while
    none does); within a save, one thread stages (:meth:`acquire`, :meth:`region`) and the drain
    frees (:meth:`freed`).

    Attributes:
        index: 0 or 1 (its place in the ping-pong pair).
        allocations: how many times the buffer has been (re)allocated; constant across saves that
            fit the current buffer.
    """

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._tensor: torch.Tensor | None = None  # the ring: aligned uint8 view
        self._keep: object = None  # what owns the memory (a tensor, or an mmap of a memfd)
        self.memfd: int | None = None
        self.pinned = False
        self.shared = False
        self.allocations = 0
        self.released = threading.Event()
        self.released.set()
        self._cond = threading.Condition()
        self._free = 0  # stream bytes before this position no longer need the ring
        self._abort: str | None = None
        self.wait_s = 0.0  # time the current save's stager spent waiting for ring space
        self._send: torch.Tensor | None = None
        self._registered = False
        self.file: str | None = None  # the data file this ring is (in-place staging), while mapped
        self._fresh = False  # allocated and not yet faulted in
        self._prefaulter: threading.Thread | None = None
        self._stop_prefault = threading.Event()

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._tensor is None else self._tensor.numel()

    # -- memory ------------------------------------------------------------------------------------
    def reserve(self, nbytes: int, *, pin: bool = False, shared: bool = False, limit: int | None = None) -> bool:
        """Make the ring at least ``nbytes`` (rounded up to a granule) with the required kind of memory,
        and no larger than ``limit`` (the configured bound; a ring kept from a save under a larger bound
        is replaced). Returns True if it had to (re)allocate."""
        want = max(GRANULE_BYTES, -(-nbytes // GRANULE_BYTES) * GRANULE_BYTES)
        have = self.capacity_bytes
        if (self._tensor is not None and have >= want and (limit is None or have <= max(limit, want))
                and (self.pinned or not pin) and self.shared == shared):
            return False
        self._release_memory()
        if shared:
            fd = os.memfd_create(f"unickpt-staging-{self.index}", getattr(os, "MFD_CLOEXEC", 0))
            os.ftruncate(fd, want)
            mm = mmap.mmap(fd, want)
            t = torch.frombuffer(mm, dtype=torch.uint8)
            if pin:
                _cuda_host_register(t)
                self._registered = True
            self.memfd, self._keep, self._tensor = fd, mm, t
        else:
            # No zero-fill: the first copy faults the pages in (filling first would write them
            # twice); every later save copies into memory that is already resident. Pinned by
            # cudaHostRegister of exactly this range, not ``pin_memory=True``: torch's caching host
            # allocator rounds each block up to a power of two (a 17 GB ring would pin 32 GiB) and
            # keeps freed blocks pinned in its cache (a ring grown from 16 to 32 GiB would hold 48).
            raw = torch.empty(want + DIRECT_ALIGN, dtype=torch.uint8)
            skip = (-raw.data_ptr()) % DIRECT_ALIGN  # direct I/O wants aligned buffers
            self._keep, self._tensor = raw, raw[skip : skip + want]
            if pin:
                _cuda_host_register(self._tensor)
                self._registered = True
        self.pinned, self.shared = pin, shared
        self.allocations += 1
        self._fresh = not self._registered  # cudaHostRegister faulted every page in already
        return True

    def reserve_file(self, path: str, nbytes: int) -> bool:
        """In-place staging (``SaveOptions.in_place``): make the ring the file ``path`` (created if
        absent; a recycled file keeps its pages), at least ``nbytes`` long (rounded up to a granule,
        allocated with ``posix_fallocate``: a full tmpfs raises OSError ENOSPC here, never SIGBUS in
        a copy), mapped shared and prefaulted. Returns True (a new mapping). The save's drain then
        only checksums; :meth:`release_file` unmaps it once the save is over."""
        want = max(GRANULE_BYTES, -(-nbytes // GRANULE_BYTES) * GRANULE_BYTES)
        self._release_memory()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            st = os.fstat(fd)
            if st.st_size != want:
                os.ftruncate(fd, want)
            if st.st_blocks * 512 < want:  # a recycled file of this size has its pages already
                os.posix_fallocate(fd, 0, want)
            mm = mmap.mmap(fd, want, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._keep, self._tensor = mm, torch.frombuffer(mm, dtype=torch.uint8)
        self.pinned, self.shared, self.file = False, False, path
        self.allocations += 1
        return True

    def release_file(self) -> None:
        """Drop the mapping of an in-place ring (the file is the checkpoint's now)."""
        if self.file is not None:
            self._release_memory()

    def prefault(self, nbytes: int) -> bool:
        """A freshly allocated ring: fault in its first ``nbytes`` from a helper thread while the stager
        copies into it, from :data:`PREFAULT_AHEAD_BYTES` on (the stager faults the start itself). The
        kernel zeroes each new page before a copy can land in it; done on another core, the stager's
        copies find the pages resident. ``MADV_POPULATE_WRITE`` only faults pages in, it never writes
        to them, so it can run beside the copies; without it (Linux < 5.14) nothing is done. Returns
        True if the helper started."""
        if not self._fresh or self._tensor is None:
            return False
        self._fresh = False
        end = min(nbytes, self.capacity_bytes)
        if end <= PREFAULT_AHEAD_BYTES or _madvise is None:
            return False
        self._stop_prefault.clear()
        self._prefaulter = threading.Thread(target=self._populate, args=(self._tensor.data_ptr(), end),
                                            name=f"unickpt-prefault-{self.index}", daemon=True)
        self._prefaulter.start()
        return True

    def _populate(self, base: int, end: int) -> None:
        step, madvise = PREFAULT_STEP_BYTES, _madvise
        if madvise is None:
            return
        for off in range(PREFAULT_AHEAD_BYTES, end, step):
            if self._stop_prefault.is_set():
                return
            if madvise(base + off, min(step, end - off), MADV_POPULATE_WRITE) != 0:
                return  # EINVAL: not supported here; ENOMEM etc.: leave the rest to the stager

    def _release_memory(self) -> None:
        if self._prefaulter is not None:  # never advise memory that is being unmapped
            self._stop_prefault.set()
            self._prefaulter.join()
            self._prefaulter = None
        self.file = None
        if self._registered and self._tensor is not None:
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            self._registered = False
        self._tensor = self._keep = None
        if self.memfd is not None:
            os.close(self.memfd)
            self.memfd = None

    def memoryview(self) -> memoryview:
        """The ring's bytes (for the hasher and writer)."""
        assert self._tensor is not None
        return host_bytes(self._tensor)

    def send_buffer(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        """A reusable buffer of at least ``nbytes`` for merge transfers (outside the ring: sends must
        not wait for ring space, see :mod:`unickpt.dist.p2p`)."""
        if self._send is None or self._send.numel() < nbytes or (pin and not self._send.is_pinned()):
            self._send = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        return self._send

    # -- the ring ------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a save: the whole ring is free."""
        with self._cond:
            self._free, self._abort, self.wait_s = 0, None, 0.0

    def acquire(self, end: int, on_block: Callable[[], None] | None = None) -> None:
        """Block until stream bytes before ``end`` fit in the ring (``end - freed <= capacity``).
        ``on_block`` runs once before the first wait. Raises PoolAborted if the save failed."""
        cap = self.capacity_bytes
        with self._cond:
            if end - self._free <= cap and self._abort is None:
                return
            if self._abort is None and on_block is not None:
                on_block()
            t0 = time.perf_counter()
            while end - self._free > cap and self._abort is None:
                self._cond.wait(1.0)
            self.wait_s += time.perf_counter() - t0
            if self._abort is not None:
                raise PoolAborted(self._abort)

    def freed(self, pos: int) -> None:
        """The drain no longer needs stream bytes before ``pos``."""
        with self._cond:
            if pos > self._free:
                self._free = pos
                self._cond.notify_all()

    def abort(self, why: str) -> None:
        """Fail the current save: a waiting stager gets PoolAborted."""
        with self._cond:
            self._abort = why
            self._cond.notify_all()

    def region(self, start: int, end: int) -> list[torch.Tensor]:
        """``uint8`` views of the ring holding stream bytes ``[start, end)`` (two where it wraps)."""
        assert self._tensor is not None
        cap = self._tensor.numel()
        if end <= start:
            return []
        a, b = start % cap, end % cap or cap
        if a < b:
            return [self._tensor[a:b]]
        return [self._tensor[a:cap], self._tensor[:b]]

    def close(self) -> None:
        self._release_memory()
        self._send = None


MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without writing to them
PREFAULT_AHEAD_BYTES = 64 << 20
PREFAULT_STEP_BYTES = 32 << 20


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - not a POSIX libc
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise() if sys.platform.startswith("linux") else None


def _cuda_host_register(t: torch.Tensor) -> None:
    """Pin existing host memory (a staging ring) for DMA; raises RuntimeError if CUDA refuses."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the {t.numel()}-byte staging ring failed (error {int(err)})")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a ``uint8`` tensor (same memory where possible), whose row-major bytes are
    ``t``'s row-major element bytes. Conjugate / negative views are resolved (a copy), as saving
    stores their values."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.dtype == torch.uint8:
        return t
    if t.dim() == 0 or t.stride(-1) != 1:
        t = t.unsqueeze(-1)  # a trailing dim of 1 element, stride 1: every element's bytes in a row
    return t.view(torch.uint8)


def row_major_views(t: torch.Tensor, start: int, n: int) -> list[torch.Tensor]:
    """Views of ``t`` covering its row-major elements ``[start, start + n)`` in order (at most
    ``2 * ndim - 1`` boxes; one slice when ``t`` is contiguous)."""
    if n <= 0:
        return []
    if t.is_contiguous():
        return [t.reshape(-1)[start : start + n]]
    out = []
    for piece in chunk_pieces(FlatRange(start, n), tuple(t.shape)):
        v = t
        for d, (o, length) in enumerate(zip(piece.box.offsets, piece.box.lengths)):
            v = v.narrow(d, o, length)
        out.append(v)
    return out


def copy_bytes(dst: list[torch.Tensor], src: torch.Tensor, start: int, n: int,
               stream: "torch.cuda.Stream | None" = None) -> None:
    """Copy bytes ``[start, start + n)`` of ``src`` (a :func:`byte_view`) into the ``uint8`` tensors
    ``dst`` (their sizes add up to ``n``), cutting wherever they are cut.

    Contiguous host-to-host runs use ``memmove`` (about 10.7 GB/s on one core here, against 6.5 GB/s
    for ``Tensor.copy_``; ctypes releases the GIL for it); anything else, and every device copy
    (issued on ``stream``, non-blocking), uses ``copy_``."""
    pos = start
    for d in dst:
        k = d.numel()
        off = 0
        for v in row_major_views(src, pos, k):
            m = v.numel()
            if stream is None and not v.is_cuda and v.is_contiguous():
                ctypes.memmove(d.data_ptr() + off, v.data_ptr(), m)
            else:
                d[off : off + m].view(v.shape).copy_(v, non_blocking=stream is not None)
            off += m
        pos += k
    assert pos == start + n


class CudaStager:
    """Device-to-host copies on a side stream (one per device), ordered after the work the caller
    has queued so far, with an event per piece that the hasher waits on before reading it.

    ``torch.cuda`` calls are only made when CUDA is available; a CPU-only build never constructs
    this class with CUDA sources.
    """

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def stream_for(self, device: torch.device) -> "torch.cuda.Stream":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(idx)
        if s is None:
            s = self._streams[idx] = torch.cuda.Stream(device=idx)
        return s

    @staticmethod
    def mark_ready(devices: set) -> dict:
        """Caller's thread, at save time: an event on each device's current stream (the state as the
        caller has it now); side-stream copies wait for it."""
        out = {}
        for dev in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            out[dev] = ev
        return out

    def begin(self, ready: dict) -> None:
        for dev, ev in ready.items():
            self.stream_for(dev).wait_event(ev)

    def record(self, device: torch.device) -> "torch.cuda.Event":
        ev = torch.cuda.Event()
        ev.record(self.stream_for(device))
        return ev
