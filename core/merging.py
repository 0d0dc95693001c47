"""Asynchronous tensor merging: irregular shards (flat ranges) -> regular boxes, by point-to-point transfers.

Frameworks that flatten parameters (FSDP1 flat params, DeepSpeed ZeRO partitions, Megatron's
distributed optimizer) give each rank a contiguous range ``[a, b)`` of a tensor's row-major
flattened elements, cutting rows anywhere. Stored as they are, such chunks are flat ranges (format
v1 allows it; no communication). Merged, each writer stores whole *rows* instead: with row size
``R = prod(shape[k:])``, the writer of ``[a, b)`` stores elements ``[ceil(a/R) R, ceil(b/R) R)``,
i.e. regular boxes, and gets the tail ``[b, ceil(b/R) R)`` (fewer than ``R`` elements) from the
writer of the next range. ``k >= 1`` is the outermost level whose rows are no longer than the
shortest range, so every range owns at least one row start and the regions tile the tensor; with
``k = 1`` (the usual case) each writer stores one box of whole rows. This is ByteCheckpoint's
"irregular tensor merging" (NSDI '25, section 4.2), which it does with all-gathers; here only the
missing row tails move, point to point.

Runtime (:class:`P2P`): the sends are issued first, at stage time, from a snapshot copy (a send
buffer outside the staging ring, so no send ever waits for ring space); each receive is issued
into the ring when the stager reaches its bytes, and its wait is deferred to the hasher, just
before the merged chunk is checksummed and written. Since every rank posts all its sends before
it can block, every receive is eventually matched and no rank waits on another in a cycle.
Transfers use a private gloo group; tags carry the save's sequence number, so two saves in
flight never match each other's messages.

Pure geometry (:func:`merge_ranges`) is separate from the runtime, and unit-testable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .resharding import Box, FlatRange, chunk_pieces

__all__ = ["MergedChunk", "merge_ranges", "row_level", "P2P", "TAG_BITS"]

TAG_BITS = 20  # transfers per save < 2**20; the save's sequence number goes above them


@dataclass(frozen=True)
class MergedChunk:
    """A regular chunk a writer stores after merging: ``spec`` (a box), ``nbytes`` bytes, made of
    ``parts``: ``(byte offset in the chunk, nbytes, source rank, byte offset in the source's shard)``
    in order; parts whose source is ``writer`` are local copies, the others are received."""

    writer: int
    spec: Box
    nbytes: int
    parts: tuple[tuple[int, int, int, int], ...]


def row_level(shape: tuple[int, ...], shortest: int) -> int:
    """The outermost ``k >= 1`` with ``prod(shape[k:]) <= shortest`` (``len(shape)`` if none)."""
    for k in range(1, len(shape) + 1):
        if math.prod(shape[k:]) <= shortest:
            return k
    return len(shape)


def merge_ranges(shape: tuple[int, ...], itemsize: int, ranges: list[tuple[int, int, int]]) -> list[MergedChunk]:
    """Merge the flat ranges ``[(start, length, writer)]`` of one tensor (they tile it exactly) into
    regular chunks. Returns them in flat order. Raises ValueError when the ranges do not tile the
    tensor."""
    total = math.prod(shape)
    ranges = sorted((s, n, w) for s, n, w in ranges if n > 0)
    pos = 0
    for s, n, _ in ranges:
        if s != pos:
            raise ValueError(f"flat ranges leave a gap or overlap at element {pos} (next starts at {s})")
        pos = s + n
    if pos != total:
        raise ValueError(f"flat ranges cover {pos} of {total} elements")
    if not shape:  # a 0-d tensor: one element, one range
        (s, n, w), = ranges
        return [MergedChunk(w, Box((), ()), itemsize, ((0, itemsize, w, 0),))]
    k = row_level(shape, min(n for _, n, _ in ranges))
    row = math.prod(shape[k:])
    out = []
    for i, (a, n, w) in enumerate(ranges):
        lo, hi = -(-a // row) * row, -(-(a + n) // row) * row
        for piece in chunk_pieces(FlatRange(lo, hi - lo), shape):
            s = lo + piece.elem_offset
            e = s + piece.box.numel
            parts = []
            for b_start, b_len, src in ranges[i:]:  # sources of [s, e): this range, then the next ones
                if b_start >= e:
                    break
                x, y = max(s, b_start), min(e, b_start + b_len)
                if y > x:
                    parts.append(((x - s) * itemsize, (y - x) * itemsize, src, (x - b_start) * itemsize))
            out.append(MergedChunk(w, piece.box, piece.box.numel * itemsize, tuple(parts)))
    return out


class P2P:
    """Point-to-point byte transfers for merging, on a private gloo group (none for a world of one).

    Args:
        group: the process group (its ranks in group order are ``ranks``).
        ranks: global rank of each group rank.
    """

    def __init__(self, group: Any, ranks: list[int]):
        self.group, self.ranks = group, ranks

    @staticmethod
    def tag(seq: int, index: int) -> int:
        if index >= 1 << TAG_BITS:
            raise ValueError(f"too many merge transfers in one save ({index})")
        return ((seq % 2048) << TAG_BITS) | index

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Any:
        import torch.distributed as dist

        return dist.isend(buf, dst=self.ranks[dst], group=self.group, tag=tag)

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        import torch.distributed as dist

        return dist.irecv(buf, src=self.ranks[src], group=self.group, tag=tag)
