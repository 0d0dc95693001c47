"""What this rank's targets need from storage: per stored chunk, the overlaps with the caller's
tensors and the byte ranges holding them (adjacent runs merged; with ``verify`` widened to whole
checksum blocks, so that every byte used is checked), and which chunks can be read straight into the
caller's memory. Built on the caller's thread before anything is read; the read plan
(:mod:`unickpt.plan.read_plan`) decides who reads which of these ranges job-wide.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.dtypes import str_to_dtype
from ..format.index import IndexReader
from ..format.metadata import CheckpointMetadata, ChunkMeta, split_block_bytes, split_chunk
from ..geometry import Box, ChunkIndex, EvenSplit, FlatRange, Piece, SplitIndex, byte_runs, chunk_pieces, intersect
from ..state.flat import TensorLeaf

__all__ = ["ChunkTable", "Overlap", "TargetReads", "merge_ranges", "piece_runs", "widen_to_blocks", "narrowed",
           "target_views", "split_needs", "chunk_overlaps", "spec_needs"]


class ChunkTable:
    """Every stored chunk numbered the same way on every rank: ids in (fqn, chunk) order. A split
    tensor (format v2) has one id per part (empty trailing parts included), found by arithmetic: the
    table costs O(tensors + explicit chunks), never O(ranks x tensors). Files, offsets and checksums
    of split parts are read from the index files only for the parts this rank reads
    (:meth:`resolve`)."""

    def __init__(self, meta: CheckpointMetadata):
        self.meta = meta
        self.fqns = sorted(meta.tensors)
        self.base: dict[str, int] = {}
        self._starts: list[int] = []
        self._dtypes: dict[str, torch.dtype] = {}
        n = 0
        for fqn in self.fqns:
            t = meta.tensors[fqn]
            self.base[fqn] = n
            self._starts.append(n)
            self._dtypes[fqn] = str_to_dtype(t.dtype)
            n += t.split.parts if t.split is not None else len(t.explicit)
        self.size = n
        self._indexes: dict[str, Any] = {}
        self.resolved: dict[int, ChunkMeta] = {}

    def locate(self, cid: int) -> tuple[str, int]:
        """``(fqn, chunk number within the tensor)`` of chunk id ``cid``."""
        i = bisect.bisect_right(self._starts, cid) - 1
        fqn = self.fqns[i]
        return fqn, cid - self._starts[i]

    def index(self, fqn: str) -> ChunkIndex | SplitIndex:
        """The overlap index of ``fqn``'s chunks (results name chunks by their number in the tensor)."""
        got = self._indexes.get(fqn)
        if got is None:
            t = self.meta.tensors[fqn]
            got = self._indexes[fqn] = (SplitIndex(t.shape, t.split) if t.split is not None
                                        else ChunkIndex(t.shape, [c.spec for c in t.explicit]))
        return got

    def dtype(self, cid: int) -> torch.dtype:
        return self._dtypes[self.locate(cid)[0]]

    def spec(self, cid: int) -> Box | FlatRange:
        fqn, k = self.locate(cid)
        t = self.meta.tensors[fqn]
        if t.split is None:
            return t.explicit[k].spec
        box = t.split.part(t.shape, k)
        if box is None:
            raise KeyError(f"{fqn!r}: part {k} of {t.split} is empty")
        return box

    def byte_length(self, cid: int) -> int:
        fqn, k = self.locate(cid)
        t = self.meta.tensors[fqn]
        if t.split is None:
            return t.explicit[k].byte_length
        box = t.split.part(t.shape, k)
        return 0 if box is None else box.numel * self._dtypes[fqn].itemsize

    def block_bytes(self, cid: int) -> int:
        """The checksum block size of chunk ``cid`` (0: one checksum for the whole chunk)."""
        fqn, k = self.locate(cid)
        t = self.meta.tensors[fqn]
        if t.split is None:
            c = t.explicit[k]
            return c.block_bytes if c.block_checksums else 0
        idx = self.meta.index
        return split_block_bytes(self.byte_length(cid), int(idx["block_bytes"]), int(idx["max_blocks"]))

    def chunk(self, cid: int) -> ChunkMeta:
        """Chunk ``cid`` with its file, offset and checksums (a split part: once :meth:`resolve` read it)."""
        fqn, k = self.locate(cid)
        t = self.meta.tensors[fqn]
        return t.explicit[k] if t.split is None else self.resolved[cid]

    def resolve(self, storage: Any, path: str, cids: Any) -> int:
        """Read the index records of the split parts among ``cids`` not yet known: per writer, one
        ranged read of its records, one of their block checksums. Returns the index files read.
        Raises IntegrityError for a missing or corrupt index file."""
        by_writer: dict[int, dict[int, list[int]]] = {}  # writer -> slot -> chunk ids
        for cid in cids:
            if cid in self.resolved:
                continue
            fqn, k = self.locate(cid)
            t = self.meta.tensors[fqn]
            if t.split is not None:
                by_writer.setdefault(k, {}).setdefault(t.slot, []).append(cid)
        reader = IndexReader(storage, path, prefix=self.meta.index.get("prefix", ""),
                             slots=self.meta.index.get("slots"))
        for writer, slots in sorted(by_writer.items()):
            records = reader.records(writer, sorted(slots))
            for slot, ids in slots.items():
                for cid in ids:
                    fqn, k = self.locate(cid)
                    self.resolved[cid] = split_chunk(self.meta.tensors[fqn], k, records[slot], self.meta.index)
        return len(by_writer)


def split_needs(table: ChunkTable, fqn: str, cid: int, split: EvenSplit, verify: bool,
                only: int | None = None) -> dict[int, list[tuple[int, int]]]:
    """``{rank: byte ranges}`` of stored chunk ``cid`` (of tensor ``fqn``) that the ranks of a load
    need when rank ``j``'s target is part ``j`` of ``split`` (every rank's target of ``fqn`` is its
    part: a load into FSDP2 / ``Shard(dim)`` over the group); ``only``: that rank's alone. Ranges are
    merged and, with ``verify``, widened to checksum blocks: what :meth:`TargetReads.add` records.
    Costs O(ranks needing the chunk), so a rank plans the reads of the chunks it needs without any
    rank listing its needs."""
    t = table.meta.tensors[fqn]
    shape, isz = t.shape, table._dtypes[fqn].itemsize
    pieces = chunk_pieces(table.spec(cid), shape)
    if not pieces:
        return {}
    d = split.dim
    lo = min(p.box.offsets[d] for p in pieces)
    hi = max(p.box.offsets[d] + p.box.lengths[d] for p in pieces)
    nbytes, block = table.byte_length(cid), table.block_bytes(cid)
    out = {}
    ranks = split.parts_between(shape, lo, hi) if only is None else [only]
    for j in ranks:
        target = split.part(shape, j)
        if target is None:
            continue
        runs = [(p.elem_offset * isz + s, n) for p in pieces for inter in (intersect(target, p.box),)
                if inter is not None for s, n in byte_runs(p.box, inter, isz)]
        if runs:
            ranges = merge_ranges(runs)
            out[j] = widen_to_blocks(ranges, nbytes, block) if verify else ranges
    return out


@dataclass
class Overlap:
    """Elements ``inter`` (a global box) of a stored piece, to be copied into ``target`` (a view of the
    caller's tensor whose global box is ``tbox``)."""

    piece: Piece
    inter: Box
    tbox: Box
    target: torch.Tensor
    fqn: str


@dataclass
class TargetReads:
    """Everything this rank needs from storage: per chunk id, its overlaps and byte ranges.

    ``splits``: stored fqn -> the split this rank's target of it is its part of (``rank``, ``world``:
    this rank in the load's group). Every rank can compute such needs of any rank
    (:func:`split_needs`), so only the rule travels in the read plan's gather."""

    rank: int = 0
    world: int = 1
    overlaps: dict[int, list[Overlap]] = field(default_factory=dict)
    ranges: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)  # fqn -> elements to fill
    direct: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk id -> the target's own bytes
    fixups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (staging, caller's tensor)
    splits: dict[str, EvenSplit] = field(default_factory=dict)
    _sources: dict[str, int] = field(default_factory=dict)  # stored fqn -> target leaves reading it

    def add(self, leaf: TensorLeaf, table: ChunkTable, source: str, verify: bool) -> None:
        """Record what ``leaf`` needs from the stored tensor ``source`` (its fqn, or its alias's target)."""
        leaf = self._staged(leaf)
        self.expected[leaf.fqn] = leaf.spec.numel
        split = EvenSplit.detect(leaf.global_shape, leaf.spec if leaf.spec.numel else None, self.rank, self.world)
        self._sources[source] = self._sources.get(source, 0) + 1
        if split is not None and self._sources[source] == 1:
            self.splits[source] = split
        else:
            split = None
            self.splits.pop(source, None)  # a second target reads it too: its needs are listed
        self._add_views(leaf.fqn, target_views(leaf), table, source, split, verify)

    def add_pieces(self, leaf: TensorLeaf, pieces: list[tuple[Box, str, tuple[int, ...]]], table: ChunkTable,
                   verify: bool) -> None:
        """Record what ``leaf`` needs when its tensor is made of pieces of stored tensors (a
        cross-framework load, :mod:`.convert`): each ``(region, stored fqn, offsets)`` says that the
        target's elements ``region`` are the stored tensor's at ``offsets``. This rank's shard is
        intersected with every region and only the stored byte ranges of the intersections are
        needed, so resharding and mapping compose (no rank reads a whole tensor for its shard). Such
        needs are always listed in the read plan's gather (never implied by a split rule)."""
        leaf = self._staged(leaf)
        self.expected[leaf.fqn] = leaf.spec.numel
        views = target_views(leaf)
        for region, source, offsets in pieces:
            moved = []
            for tbox, view in views:
                inter = intersect(tbox, region)
                if inter is None:
                    continue
                at = tuple(i - r + o for i, r, o in zip(inter.offsets, region.offsets, offsets))
                moved.append((Box(at, inter.lengths), narrowed(view, tbox, inter)))
            if moved:
                self._sources[source] = self._sources.get(source, 0) + 2
                self.splits.pop(source, None)
                self._add_views(leaf.fqn, moved, table, source, None, verify)

    def _staged(self, leaf: TensorLeaf) -> TensorLeaf:
        """A flat-range target that is not contiguous is filled through a contiguous staging copy."""
        if isinstance(leaf.spec, FlatRange) and not leaf.local.is_contiguous():
            staging = torch.empty(leaf.local.shape, dtype=leaf.local.dtype)
            self.fixups.append((staging, leaf.local))
            leaf = TensorLeaf(leaf.fqn, leaf.dtype, leaf.global_shape, staging, leaf.spec)
        return leaf

    def _add_views(self, fqn: str, targets: list[tuple[Box, torch.Tensor]], table: ChunkTable, source: str,
                   split: EvenSplit | None, verify: bool) -> None:
        """``targets``: ``(box of the stored tensor ``source``, view of the caller's memory with that
        box's shape)``; ``split``: the rule this rank's needs of ``source`` follow, or None."""
        isz = table._dtypes[source].itemsize
        found = chunk_overlaps(table, source, [tbox for tbox, _ in targets])
        for cid in sorted(found):
            overlaps = [Overlap(piece, inter, targets[t][0], targets[t][1], fqn) for t, piece, inter in found[cid]]
            if cid not in self.overlaps and len(overlaps) == 1:
                self._maybe_direct(cid, table.byte_length(cid), overlaps[0], isz)
            else:
                self.direct.pop(cid, None)  # a second target for this chunk: read into a buffer
            self.overlaps.setdefault(cid, []).extend(overlaps)
            ranges = _ranges(table, source, cid, found[cid], split, self.rank, verify)
            self.ranges[cid] = merge_ranges(self.ranges[cid] + ranges) if cid in self.ranges else ranges

    def _maybe_direct(self, cid: int, nbytes: int, o: Overlap, isz: int) -> None:
        """When the target needs the whole chunk and its memory for it is one contiguous CPU run,
        read (or receive) straight into the caller's tensor: no buffer, no copy."""
        if o.piece.elem_offset != 0 or o.inter != o.piece.box or o.piece.box.numel * isz != nbytes:
            return
        dst = narrowed(o.target, o.tbox, o.inter)
        if dst.device.type == "cpu" and dst.is_contiguous() and not dst.is_conj() and not dst.is_neg():
            self.direct[cid] = dst.reshape(-1).view(torch.uint8)


def chunk_overlaps(table: ChunkTable, source: str, boxes: list[Box]) -> dict[int, list[tuple[int, Piece, Box]]]:
    """Chunk id -> ``(target index, stored piece, intersection)`` of every stored piece of ``source``
    that the target ``boxes`` overlap, in storage order (piece offset, then target)."""
    by_chunk: dict[int, list] = {}
    index, base = table.index(source), table.base[source]
    for t, tbox in enumerate(boxes):
        for i, piece, inter in index.overlapping(tbox):
            by_chunk.setdefault(base + i, []).append((piece.elem_offset, t, piece, inter))
    return {cid: [(t, p, inter) for _, t, p, inter in sorted(found, key=lambda x: x[:2])]
            for cid, found in by_chunk.items()}


def _ranges(table: ChunkTable, source: str, cid: int, found: list, split: EvenSplit | None, rank: int,
            verify: bool) -> list[tuple[int, int]]:
    if split is not None:  # exactly what every other rank computes for this rank
        return split_needs(table, source, cid, split, verify, only=rank)[rank]
    ranges = merge_ranges(piece_runs([(p, inter) for _, p, inter in found], table._dtypes[source].itemsize))
    return widen_to_blocks(ranges, table.byte_length(cid), table.block_bytes(cid)) if verify else ranges


def spec_needs(table: ChunkTable, source: str, spec: Box | FlatRange | None, rank: int, world: int,
               verify: bool) -> tuple[dict[int, list[tuple[int, int]]], EvenSplit | None]:
    """What :meth:`TargetReads.add` records for a target holding ``spec`` of ``source`` (None:
    nothing), without a tensor: ``({chunk id: byte ranges}, the split it is this rank's part of or
    None)``. Used by the planner simulation (benchmarks/plan_sim.py)."""
    shape = table.meta.tensors[source].shape
    split = EvenSplit.detect(shape, spec, rank, world)
    if spec is None:
        return {}, split
    boxes = [spec] if isinstance(spec, Box) else [p.box for p in chunk_pieces(spec, shape)]
    found = chunk_overlaps(table, source, boxes)
    return {cid: _ranges(table, source, cid, found[cid], split, rank, verify) for cid in sorted(found)}, split


def piece_runs(found: list[tuple[Piece, Box]], isz: int) -> list[tuple[int, int]]:
    """Chunk-relative byte runs ``(start, length)`` holding the intersections ``found``
    (``(piece, intersection)`` pairs of one chunk), unmerged."""
    return [(p.elem_offset * isz + s, n) for p, inter in found for s, n in byte_runs(p.box, inter, isz)]


def narrowed(target: torch.Tensor, tbox: Box, inter: Box) -> torch.Tensor:
    for d, (t0, i0, n) in enumerate(zip(tbox.offsets, inter.offsets, inter.lengths)):
        target = target.narrow(d, i0 - t0, n)
    return target


def target_views(leaf: TensorLeaf) -> list[tuple[Box, torch.Tensor]]:
    """(global box, tensor view with that box's shape) for each storage-contiguous piece of the target."""
    if isinstance(leaf.spec, Box):
        return [(leaf.spec, leaf.local)] if leaf.spec.numel else []
    flat = leaf.local.view(-1)
    return [(p.box, flat[p.elem_offset : p.elem_offset + p.box.numel].view(p.box.lengths))
            for p in chunk_pieces(leaf.spec, leaf.global_shape)]


def merge_ranges(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping ``(start, length)`` ranges covering the same bytes (touching ones joined)."""
    merged: list[tuple[int, int]] = []
    for start, length in sorted(runs):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            end = max(merged[-1][0] + merged[-1][1], start + length)
            merged[-1] = (merged[-1][0], end - merged[-1][0])
        else:
            merged.append((start, length))
    return merged


def widen_to_blocks(ranges: list[tuple[int, int]], nbytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """Ranges of a chunk of ``nbytes`` widened to whole checksum blocks of ``block_bytes`` (the whole
    chunk if it has one checksum: ``block_bytes`` 0)."""
    if not block_bytes:
        return [(0, nbytes)]
    b = block_bytes
    return merge_ranges([(s // b * b, min(-(-(s + n) // b) * b, nbytes) - s // b * b) for s, n in ranges])
