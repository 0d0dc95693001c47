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

from dataclasses import dataclass

from .._util import gc_paused
from .balance import LeastLoaded

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


def make_read_plan(needs: list[dict[int, Ranges]]) -> list[Segment]:
    """Segments for all chunks, ordered by (chunk id, start). ``needs[rank][chunk_id]`` are sorted,
    non-overlapping ranges (as :func:`unickpt.reader.merge_ranges` returns). Cost: O(n log n) in
    the number of ranges plus, per cut position, the ranks needing it."""
    with gc_paused():
        return _make_read_plan(needs)


def _make_read_plan(needs: list[dict[int, Ranges]]) -> list[Segment]:
    by_chunk: dict[int, dict[int, Ranges]] = {}
    for rank, rank_needs in enumerate(needs):
        for cid, ranges in rank_needs.items():
            if ranges:
                by_chunk.setdefault(cid, {})[rank] = ranges
    pieces = []  # (chunk id, start, length, needers)
    for cid in sorted(by_chunk):
        holders = by_chunk[cid]
        same: dict[tuple, list[int]] = {}
        keys: dict[int, tuple] = {}  # ranks with identical needs often share one list (see loading)
        for r, rs in holders.items():
            k = keys.get(id(rs))
            if k is None:
                k = keys[id(rs)] = tuple(rs)
            same.setdefault(k, []).append(r)
        if len(same) == 1:  # one needer, or replicas needing the same ranges: no cuts between them
            (rs, who), = same.items()
            pieces += [(cid, a, n, tuple(who)) for a, n in rs if n > 0]
            continue
        # sweep over the range boundaries, keeping the set of ranks whose ranges cover the position:
        # O(boundaries x needers per position), not O(boundaries x holders)
        events: dict[int, list[tuple[int, int]]] = {}
        for r, rs in holders.items():
            for a, n in rs:
                if n > 0:
                    events.setdefault(a, []).append((1, r))
                    events.setdefault(a + n, []).append((0, r))
        cuts = sorted(events)
        active: set[int] = set()
        for a, b in zip(cuts, cuts[1:] + [None]):
            for kind, r in sorted(events[a]):  # ends before starts at one position
                if kind:
                    active.add(r)
                else:
                    active.discard(r)
            if active and b is not None:
                pieces.append((cid, a, b - a, tuple(sorted(active))))
    load: dict[int, int] = {}
    reader_of: dict[int, int] = {}
    pickers: dict[tuple[int, ...], LeastLoaded] = {}
    # segments only one rank needs are that rank's to read: count them first, then balance the shared
    # ones, each to min(needers, key=(bytes so far, rank)) (a heap per needer set: O(log n), same choice)
    for i in sorted(range(len(pieces)), key=lambda i: (len(pieces[i][3]) > 1, -pieces[i][2], i)):
        who = pieces[i][3]
        if len(who) == 1:
            reader = who[0]
            load[reader] = load.get(reader, 0) + pieces[i][2]
        else:
            picker = pickers.get(who)
            if picker is None:
                picker = pickers[who] = LeastLoaded(who, load)
            reader = picker.pop_min()
            load[reader] = load.get(reader, 0) + pieces[i][2]
            picker.refresh(reader)
        reader_of[i] = reader
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
