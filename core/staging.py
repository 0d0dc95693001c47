"""Staging: the snapshot copy into pre-allocated host memory, the only part of a save that blocks.

A :class:`StagingPool` owns one flat ``uint8`` host buffer, kept across saves so that only the first
save pays for page faults (copies into fresh memory are several times slower), and pinned when CUDA tensors are staged (so D2H copies are
DMA, not pageable). It is reused across saves and grows only when a save needs more. The engine
keeps two pools (ping-pong): a save stages into a free one while the previous save drains the
other.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

__all__ = ["StagingPool", "StagedChunk", "ALIGN_BYTES"]

ALIGN_BYTES = 64  # every staged chunk starts on a cache line (and any dtype's alignment)


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass
class StagedChunk:
    """A staged chunk: bytes ``[offset, offset + nbytes)`` of its pool's buffer."""

    index: int  # position in the writer's chunk list
    offset: int
    nbytes: int


class StagingPool:
    """A reusable host buffer. Not thread-safe: the engine hands a pool to one save at a time.

    ``released`` is set while no save owns the pool.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self.pinned = False
        self.released = threading.Event()
        self.released.set()

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def _reserve(self, nbytes: int, pin: bool) -> None:
        if self._buf is not None and self._buf.numel() >= nbytes and (self.pinned or not pin):
            return
        self._buf = None
        size = max(_align(nbytes), ALIGN_BYTES)
        # No zero-fill: the first copy faults the pages in (filling first would write them twice);
        # every later save copies into memory that is already resident.
        self._buf, self.pinned = torch.empty(size, dtype=torch.uint8, pin_memory=pin), pin

    def view(self, staged: StagedChunk) -> torch.Tensor:
        """The staged bytes as a ``uint8`` tensor (shares memory with the pool)."""
        assert self._buf is not None
        return self._buf[staged.offset : staged.offset + staged.nbytes]

    def stage(self, tensors: list[torch.Tensor]) -> list[StagedChunk]:
        """Copy each tensor's elements (row-major; a non-contiguous view copies only its elements)
        into the pool and return where each landed. CUDA copies are issued non-blocking on the
        current stream and synchronised before returning, so the snapshot is complete.
        """
        layout, total = [], 0
        for i, t in enumerate(tensors):
            nbytes = t.numel() * t.element_size()
            layout.append(StagedChunk(i, total, nbytes))
            total += _align(nbytes)
        on_cuda = any(t.is_cuda for t in tensors)
        self._reserve(total, pin=on_cuda and torch.cuda.is_available())
        with torch.no_grad():
            for t, s in zip(tensors, layout):
                if s.nbytes == 0:
                    continue
                dst = self.view(s).view(t.dtype).view(t.shape)
                dst.copy_(t, non_blocking=t.is_cuda)
        if on_cuda:
            torch.cuda.synchronize()
        return layout
