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

This module is the pure geometry (:func:`merge_ranges`; unit-testable, no process group). The save
plan (:mod:`unickpt.plan.save_plan`) turns it into sends and receives; the transfers run in the save
pipeline (:mod:`unickpt.saving.pipeline`) over :class:`unickpt.dist.p2p.P2P`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..geometry import Box, FlatRange, chunk_pieces

__all__ = ["MergedChunk", "merge_ranges", "row_level"]


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
