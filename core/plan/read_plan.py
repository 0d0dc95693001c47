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

Replicas (HSDP, data parallel) share one needs dict; they are planned as one group, so the plan
costs O(distinct needs), not O(ranks x chunks). Chunks whose needs every rank can compute (a load
into an even split of the group, :func:`unickpt.plan.needs.split_needs`) are planned chunk by
chunk by the ranks that need them (:func:`chunk_segments`), with no job-wide list at all.

The load's side of it, also pure: what a rank sends (:func:`needs_doc`, compact JSON; ranks with equal
:func:`needs_signature` send one), and its part of the plan from every rank's docs (:func:`plan_reads`).
"""
from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from typing import Iterable

from .._util import gc_paused
from ..geometry import EvenSplit
from .balance import LeastLoaded
from .needs import ChunkTable, RankNeeds, Ranges, split_needs

__all__ = ["Segment", "make_read_plan", "chunk_segments", "segments_of", "batches", "needs_doc", "needs_signature",
           "plan_reads"]


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
    non-overlapping ranges (as :func:`unickpt.plan.needs.merge_byte_ranges` returns); ranks whose
    needs are one dict object (replicas) are planned as one group, sharing one ``needers`` tuple.
    Cost: O(n log n) in the ranges of the distinct dicts, plus, per cut position, the groups needing it."""
    with gc_paused():
        return _make_read_plan(needs)


def _groups(needs: list[dict[int, Ranges]]) -> list[tuple[tuple[int, ...], dict[int, Ranges]]]:
    members: dict[int, list[int]] = {}
    first: dict[int, dict] = {}
    for rank, d in enumerate(needs):
        members.setdefault(id(d), []).append(rank)
        first.setdefault(id(d), d)
    return [(tuple(rs), first[k]) for k, rs in members.items()]


def _pieces(cid: int, holders: dict[int, Ranges], ranks: dict[int, tuple[int, ...]], union: dict) -> list[tuple]:
    """``(chunk id, start, length, needers)`` cutting chunk ``cid`` where the set of needers changes.
    ``holders``: group -> its ranges; ``ranks``: group -> its ranks; ``union``: a cache of needer tuples."""
    same: dict[tuple, list[int]] = {}
    keys: dict[int, tuple] = {}  # groups with identical needs often share one list (see loading)
    for g, rs in holders.items():
        k = keys.get(id(rs))
        if k is None:
            k = keys[id(rs)] = tuple(rs)
        same.setdefault(k, []).append(g)

    def needers(gs: Iterable[int]) -> tuple[int, ...]:
        key = frozenset(gs)
        got = union.get(key)
        if got is None:
            got = union[key] = ranks[next(iter(key))] if len(key) == 1 else tuple(sorted(r for g in key for r in ranks[g]))
        return got

    if len(same) == 1:  # one needer, or replicas needing the same ranges: no cuts between them
        (shared, gs), = same.items()
        who = needers(gs)
        return [(cid, a, n, who) for a, n in shared if n > 0]
    # sweep over the range boundaries, keeping the set of groups whose ranges cover the position:
    # O(boundaries x needers per position), not O(boundaries x holders)
    events: dict[int, list[tuple[int, int]]] = {}
    for g, rs in holders.items():
        for a, n in rs:
            if n > 0:
                events.setdefault(a, []).append((1, g))
                events.setdefault(a + n, []).append((0, g))
    cuts = sorted(events)
    active: set[int] = set()
    out = []
    for a, b in zip(cuts, cuts[1:] + [None]):
        for kind, g in sorted(events[a]):  # ends before starts at one position
            if kind:
                active.add(g)
            else:
                active.discard(g)
        if active and b is not None:
            out.append((cid, a, b - a, needers(active)))
    return out


def _merged(pieces: list[tuple], reader_of: list[int], first_id: int = 0) -> list[Segment]:
    segments: list[Segment] = []
    for i, (cid, start, length, who) in enumerate(pieces):
        last = segments[-1] if segments else None
        if (last is not None and last.chunk_id == cid and last.start + last.length == start
                and last.reader == reader_of[i] and last.needers == who):
            segments[-1] = Segment(last.seg_id, cid, last.start, last.length + length, last.reader, who)
        else:
            segments.append(Segment(first_id + len(segments), cid, start, length, reader_of[i], who))
    return segments


def _make_read_plan(needs: list[dict[int, Ranges]]) -> list[Segment]:
    groups = _groups(needs)
    ranks = {g: rs for g, (rs, _) in enumerate(groups)}
    by_chunk: dict[int, dict[int, Ranges]] = {}
    for g, (_, group_needs) in enumerate(groups):
        for cid, ranges in group_needs.items():
            if ranges:
                by_chunk.setdefault(cid, {})[g] = ranges
    pieces = []  # (chunk id, start, length, needers)
    union: dict = {}
    for cid in sorted(by_chunk):
        pieces += _pieces(cid, by_chunk[cid], ranks, union)
    load: dict[int, int] = {}
    reader_of = [0] * len(pieces)
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
    return _merged(pieces, reader_of)


def chunk_segments(cid: int, needs: dict[int, Ranges]) -> list[Segment]:
    """The segments of one chunk from every needer's ranges (``needs[rank]``), planned by that chunk
    alone: any rank that knows them gets the same segments. A segment one rank needs is its to read;
    a shared one is read by its needers in turn (``needers[(cid + i) % n]`` for the ``i``-th piece), so
    the bytes of boundary blocks spread without a job-wide balance. ``seg_id`` numbers the chunk's
    segments from 0."""
    pieces = _pieces(cid, needs, {r: (r,) for r in needs}, {})
    return _merged(pieces, [who[0] if len(who) == 1 else who[(cid + i) % len(who)]
                            for i, (_, _, _, who) in enumerate(pieces)])


def segments_of(rank: int, segments: list[Segment]) -> list[Segment]:
    """The segments ``rank`` reads or needs, in order (what its reads and transfers involve)."""
    sets: dict[int, bool] = {}
    out = []
    for s in segments:
        if s.reader == rank:
            out.append(s)
            continue
        hit = sets.get(id(s.needers))
        if hit is None:
            hit = sets[id(s.needers)] = rank in s.needers
        if hit:
            out.append(s)
    return out


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


def needs_doc(need: RankNeeds, table: ChunkTable, verify: bool) -> bytes:
    """What a rank sends to the read plan: its listed needs ``{"n": [[chunk id, ranges]]}``, its
    split targets ``{"s": {stored fqn: [dim, parts]}}`` (their needs are implied) and whether its
    ranges are widened to checksum blocks (``"v"``), as compact JSON."""
    listed = [(cid, rs) for cid, rs in need.ranges.items() if table.locate(cid)[0] not in need.splits]
    return json.dumps({"n": listed, "s": {f: [sp.dim, sp.parts] for f, sp in need.splits.items()}, "v": verify},
                      separators=(",", ":")).encode()


def plan_reads(me: int, table: ChunkTable, firsts: list[int], docs: dict[int, dict],
               my_ranges: dict[int, Ranges]) -> list[Segment]:
    """Rank ``me``'s part of the zero-redundancy read plan (the segments it reads or needs, sorted by
    chunk id and start), from every rank's needs: rank ``r``'s are ``docs[firsts[r]]`` (a
    :func:`needs_doc`; ranks sharing a doc are planned as one group). A split every rank with a
    non-empty part declared (:func:`_agreed_splits`) is planned chunk by chunk for the chunks ``me``
    needs (``my_ranges``), O(its chunks x their needers); a split only some ranks declared is listed
    for them (O(ranks) for that tensor). Deterministic: every rank derives consistent parts of one
    plan. Costs O(listed needs of the distinct docs + this rank's chunks of split targets)."""
    splits = _agreed_splits(table, docs, firsts)
    decoded = {f: {int(cid): list(map(tuple, rs)) for cid, rs in doc["n"]} for f, doc in docs.items()}
    per_rank: list[dict] = []
    for r, f in enumerate(firsts):  # listed needs, plus the needs of splits not every rank declared
        extra = [(fqn, sp) for fqn, sp in docs[f]["s"].items() if fqn not in splits]
        if not extra:
            per_rank.append(decoded[f])  # ranks sharing a doc share one dict: planned as one group
            continue
        own = dict(decoded[f])
        for fqn, (dim, parts) in extra:
            split = EvenSplit(int(dim), int(parts))
            for k in _chunks_of(table, fqn, split, r):
                cid = table.base[fqn] + k
                own[cid] = split_needs(table, fqn, cid, split, docs[f]["v"], only=r)[r]
        per_rank.append(own)
    plan = segments_of(me, make_read_plan(per_rank))
    if splits:
        verify = docs[firsts[me]]["v"]  # the same on every rank (or nothing is agreed)
        for cid in sorted(my_ranges):  # the chunks of split targets this rank needs, planned chunk by chunk
            fqn = table.locate(cid)[0]
            agreed = splits.get(fqn)
            if agreed is not None:
                plan += segments_of(me, chunk_segments(cid, split_needs(table, fqn, cid, agreed, verify)))
        plan.sort(key=lambda s: (s.chunk_id, s.start))
    return plan


def _agreed_splits(table: ChunkTable, docs: dict[int, dict], firsts: list[int]) -> dict[str, EvenSplit]:
    """The stored fqns whose targets are their ranks' parts of one split of the group: every rank
    whose part is not empty declared it (the others need nothing of it) and no rank lists needs of
    it. Costs O(docs x their entries)."""
    members: dict[int, list[int]] = {}
    for r, f in enumerate(firsts):
        members.setdefault(f, []).append(r)
    declared: dict[str, list[tuple[EvenSplit, int]]] = {}
    listed: set[str] = set()
    for f, doc in docs.items():
        for fqn, (d, p) in doc["s"].items():
            declared.setdefault(fqn, []).append((EvenSplit(int(d), int(p)), f))
        listed.update(table.locate(int(cid))[0] for cid, _ in doc["n"])
    out: dict[str, EvenSplit] = {}
    if len({bool(doc["v"]) for doc in docs.values()}) > 1:  # ranks widen differently: list every need
        return out
    for fqn, decl in declared.items():
        split = decl[0][0]
        if fqn in listed or split.parts != len(firsts) or any(s != split for s, _ in decl):
            continue
        m = split.nonempty(table.meta.tensors[fqn].shape)
        if sum(bisect.bisect_left(members[f], m) for _, f in decl) == m:
            out[fqn] = split
    return out


def _chunk_count(table: ChunkTable, fqn: str) -> int:
    """How many chunks the stored tensor ``fqn`` has (a split one: its parts, empty ones included)."""
    t = table.meta.tensors[fqn]
    return t.split.parts if t.split is not None else len(t.explicit)


def _chunks_of(table: ChunkTable, fqn: str, split: EvenSplit, rank: int) -> list[int]:
    """Numbers of ``fqn``'s stored chunks that part ``rank`` of ``split`` overlaps."""
    box = split.part(table.meta.tensors[fqn].shape, rank)
    return [] if box is None else sorted({k for k, _, _ in table.index(fqn).overlapping(box)})


def needs_signature(need: RankNeeds, table: ChunkTable, verify: bool) -> str:
    """Digest of this rank's needs and the chunks involved (ids and sizes, not their files or
    checksums), so that later checkpoints of the same layout reuse the read plan. A target that is
    its rank's part of a split counts as the rule alone: every rank of an FSDP2 load has one digest."""
    items = [(cid, table.byte_length(cid), tuple(rs)) for cid, rs in sorted(need.ranges.items())
             if table.locate(cid)[0] not in need.splits]
    splits = [(f, _chunk_count(table, f), table.meta.tensors[f].split, s.dim, s.parts)
              for f, s in sorted(need.splits.items())]
    return hashlib.blake2b(repr((items, splits, verify)).encode(), digest_size=16).hexdigest()
