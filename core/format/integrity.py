"""Checksums (xxh3-64, via xxhash): per chunk, and per block of a large chunk, so that a partial
read (resharding) is verified by reading only the blocks it touches.

A chunk of at most :data:`CHECKSUM_BLOCK_BYTES` has one checksum over its bytes. A larger chunk has
one checksum per block of :func:`block_size` bytes (the last may be short), and its chunk checksum
is the checksum of the block checksums joined by commas. :func:`chunk_checksums` computes them at
once, :class:`ChunkHasher` from pieces of any size (the save's drain); both give the same result.
Imports no torch (the writer process uses it).
"""
from __future__ import annotations

from typing import Any

import xxhash

__all__ = ["CHECKSUM_BLOCK_BYTES", "MAX_BLOCKS_PER_CHUNK", "checksum", "block_size", "chunk_checksums",
           "ChunkHasher"]

CHECKSUM_BLOCK_BYTES = 1 << 20
"""Chunks larger than this get one checksum per block (at least this many bytes, and large enough that
a chunk has at most ``MAX_BLOCKS_PER_CHUNK`` blocks), so that a partial read (resharding) is verified
by reading only the blocks it touches, while metadata stays small."""
MAX_BLOCKS_PER_CHUNK = 32
"""32, not 64: at 10,000 ranks of a 405B model with AdamW, block checksums were 84 % of a 55-64 MB
metadata.json (benchmarks/plan_sim.py); 32 brings it to 34-37 MB, and a partial read still reads at
most two blocks (1/16 of a chunk) beyond what it needs. Readers use each chunk's stored block size."""


def checksum(buf: Any) -> str:
    """``"xxh3_64:<16 hex digits>"`` of a bytes-like object."""
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(buf)


def block_size(nbytes: int) -> int:
    """Checksum block size for a chunk of ``nbytes``: ``CHECKSUM_BLOCK_BYTES``, doubled until the
    chunk has at most ``MAX_BLOCKS_PER_CHUNK`` blocks."""
    b = CHECKSUM_BLOCK_BYTES
    while -(-nbytes // b) > MAX_BLOCKS_PER_CHUNK:
        b *= 2
    return b


def chunk_checksums(buf: memoryview, block_bytes: int | None = None) -> tuple[str, tuple[str, ...], int]:
    """``(checksum, block checksums, block size)`` of a chunk's bytes (see the module docstring);
    ``(checksum, (), 0)`` for a chunk of at most ``CHECKSUM_BLOCK_BYTES``."""
    if block_bytes is None:
        block_bytes = block_size(buf.nbytes)
    if buf.nbytes <= CHECKSUM_BLOCK_BYTES:
        return checksum(buf), (), 0
    blocks = tuple(checksum(buf[i : i + block_bytes]) for i in range(0, buf.nbytes, block_bytes))
    return checksum(",".join(blocks).encode()), blocks, block_bytes


class ChunkHasher:
    """Streaming form of :func:`chunk_checksums`: feed a chunk's bytes in pieces of any size.

    ``block_bytes`` is the chunk's checksum block size as :func:`block_size` gives it, or 0 for a
    chunk small enough to have a single checksum. xxh3's streaming digest equals its one-shot digest,
    so where the pieces are cut does not matter.
    """

    def __init__(self, nbytes: int, block_bytes: int):
        self.nbytes, self.block_bytes = nbytes, block_bytes
        self.fed = 0
        self._h = xxhash.xxh3_64()
        self._in_block = 0
        self._blocks: list[str] = []

    def update(self, buf: memoryview) -> None:
        n = buf.nbytes
        if self.fed + n > self.nbytes:
            raise ValueError(f"chunk of {self.nbytes} bytes fed {self.fed + n} bytes")
        if not self.block_bytes:
            self._h.update(buf)
        else:
            pos = 0
            while pos < n:
                take = min(n - pos, self.block_bytes - self._in_block)
                self._h.update(buf[pos : pos + take])
                self._in_block += take
                pos += take
                if self._in_block == self.block_bytes:
                    self._blocks.append("xxh3_64:" + self._h.hexdigest())
                    self._h.reset()
                    self._in_block = 0
        self.fed += n

    def finish(self) -> tuple[str, tuple[str, ...], int]:
        """``(checksum, block checksums, block size)``; raises ValueError if not all bytes were fed."""
        if self.fed != self.nbytes:
            raise ValueError(f"chunk of {self.nbytes} bytes finished after {self.fed} bytes")
        if not self.block_bytes:
            return "xxh3_64:" + self._h.hexdigest(), (), 0
        if self._in_block:
            self._blocks.append("xxh3_64:" + self._h.hexdigest())
        blocks = tuple(self._blocks)
        return checksum(",".join(blocks).encode()), blocks, self.block_bytes
