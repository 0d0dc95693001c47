"""A rank's data files as one byte *stream*: where each file and chunk sits in it.

A save's data files (*segments*) are laid out one after another: segment ``i`` holds ``size`` bytes
and starts at stream position ``base`` (a multiple of :data:`GRANULE_BYTES`); chunk ``c`` occupies
stream bytes ``[start, start + nbytes)`` inside one segment, packed exactly as in the data file. The
staging ring keeps stream byte ``p`` at ring offset ``p % capacity`` (:mod:`unickpt.saving.staging`), so
a segment's bytes are contiguous in the ring up to one wrap, and the drain writes them in order
(:mod:`unickpt.saving.drain`). Pure; imports no torch (the writer process uses it).
"""
from __future__ import annotations

__all__ = ["GRANULE_BYTES", "stream_layout"]

GRANULE_BYTES = 1 << 20
"""Segment bases and merge transfers are cut at multiples of this many stream bytes, and ring
capacities are multiples of it, so a transfer never straddles the ring's wrap."""


def stream_layout(sizes: list[int]) -> tuple[list[int], int]:
    """``(bases, length)``: the stream position of each segment of ``sizes`` bytes (granule multiples,
    in order) and the stream length (the end of the last segment)."""
    bases, pos = [], 0
    for n in sizes:
        bases.append(pos)
        pos += max(1, -(-n // GRANULE_BYTES)) * GRANULE_BYTES
    return bases, (bases[-1] + sizes[-1]) if sizes else 0
