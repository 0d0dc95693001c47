"""Zero-redundancy read planning: every stored byte a job needs is read from storage by one rank.

Each rank states, per stored chunk, the byte ranges it needs (already widened to checksum blocks when
verifying). :func:`make_read_plan` cuts each chunk at every range boundary of every rank into
*segments* with a constant set of ranks needing them, gives each segment to one of those ranks (the
reader: a sole needer reads its own; shared segments, largest first, go to the needer with the fewest
bytes assigned so far), and merges adjacent
segments with the same reader and the same needers. Readers send each segment to the other ranks
that need it (see :mod:`unickpt.loading`), so storage traffic for state that every rank needs falls
from ``ranks x bytes`` to ``bytes`` (ByteCheckpoint, NSDI '25, section on load-time redistribution).
Pure functions: deterministic, so every rank computes the same plan from the same gathered needs.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["Segment", "make_read_plan", "batches"]

Ranges = list[tuple[int, int]]  # (start, length) in bytes, relative to the chunk's first byte


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, start + length)`` of chunk ``chunk_id``, read by ``reader``, needed by ``needers``."""

    seg_id: int
    chunk_id: int
    start: int
    length: int
    reader: int
    needers: tuple[int, ...]


def _covered(ranges: Ranges, starts: list[int], a: int) -> bool:
    i = bisect.bisect_right(starts, a) - 1
    return i >= 0 and ranges[i][0] + ranges[i][1] > a


def make_read_plan(needs: list[dict[int, Ranges]]) -> list[Segment]:
    """Segments for all chunks, ordered by (chunk id, start). ``needs[rank][chunk_id]`` are sorted,
    non-overlapping ranges (as :func:`unickpt.reader.merge_ranges` returns)."""
    by_chunk: dict[int, dict[int, Ranges]] = {}
    for rank, rank_needs in enumerate(needs):
        for cid, ranges in rank_needs.items():
            if ranges:
                by_chunk.setdefault(cid, {})[rank] = ranges
    pieces = []  # (chunk id, start, length, needers)
    for cid in sorted(by_chunk):
        holders = by_chunk[cid]
        starts = {r: [s for s, _ in rs] for r, rs in holders.items()}
        cuts = sorted({x for rs in holders.values() for s, n in rs for x in (s, s + n)})
        for a, b in zip(cuts, cuts[1:]):
            who = tuple(r for r in sorted(holders) if _covered(holders[r], starts[r], a))
            if who:
                pieces.append((cid, a, b - a, who))
    load: dict[int, int] = {}
    reader_of: dict[int, int] = {}
    # segments only one rank needs are that rank's to read: count them first, then balance the shared ones
    for i in sorted(range(len(pieces)), key=lambda i: (len(pieces[i][3]) > 1, -pieces[i][2], i)):
        who = pieces[i][3]
        reader = min(who, key=lambda r: (load.get(r, 0), r))
        reader_of[i] = reader
        load[reader] = load.get(reader, 0) + pieces[i][2]
    segments: list[Segment] = []
    for i, (cid, start, length, who) in enumerate(pieces):
        last = segments[-1] if segments else None
        if (last is not None and last.chunk_id == cid and last.start + last.length == start
                and last.reader == reader_of[i] and last.needers == who):
            segments[-1] = Segment(last.seg_id, cid, last.start, last.length + length, last.reader, who)
        else:
            segments.append(Segment(len(segments), cid, start, length, reader_of[i], who))
    return segments


def batches(segments: list[Segment], chunk_bytes: dict[int, int], budget_bytes: int) -> list[list[Segment]]:
    """Split segments into rounds of whole chunks whose stored sizes add up to at most
    ``budget_bytes`` (a chunk larger than the budget is a round of its own), which bounds the read
    buffer every rank holds at once."""
    rounds: list[list[Segment]] = []
    used, current_chunk = budget_bytes + 1, None
    for seg in segments:
        if seg.chunk_id != current_chunk:
            size = chunk_bytes[seg.chunk_id]
            if used + size > budget_bytes:
                rounds.append([])
                used = 0
            used += size
            current_chunk = seg.chunk_id
        rounds[-1].append(seg)
    return rounds
