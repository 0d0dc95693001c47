"""What a rank's load targets need of the stored chunks, as pure geometry (no I/O, no tensors of
the caller): :class:`ChunkTable` numbers every stored chunk alike on every rank; :func:`chunk_overlaps`
finds the stored pieces a target box overlaps; :func:`chunk_ranges` / :func:`split_needs` /
:func:`spec_needs` turn overlaps into merged byte ranges of a chunk (widened to whole checksum blocks
with ``verify``, so that every byte used is checked). The loader records these per target
(:class:`unickpt.loading.targets.TargetReads`); the read plan (:mod:`.read_plan`) decides who reads
which of them job-wide.
"""
from __future__ import annotations

import bisect
from typing import Protocol

import torch

from ..format.dtypes import str_to_dtype
from ..format.metadata import CheckpointMetadata, ChunkMeta, split_block_bytes
from ..geometry import Box, ChunkIndex, EvenSplit, FlatRange, ContiguousBox, SplitIndex, byte_runs, chunk_pieces, intersect

__all__ = ["ChunkTable", "RankNeeds", "Ranges", "split_needs", "chunk_overlaps", "chunk_ranges", "spec_needs",
           "piece_runs", "merge_byte_ranges", "widen_to_blocks"]

Ranges = list[tuple[int, int]]  # (start, length) in bytes, relative to the chunk's first byte


class RankNeeds(Protocol):
    """What one rank needs for its load targets (:class:`unickpt.loading.targets.TargetReads` is one):
    ``ranges``: chunk id -> merged byte ranges; ``splits``: stored fqn -> the even split of the group
    this rank's target of it is its part of (those needs every rank can compute, :func:`split_needs`)."""

    ranges: dict[int, Ranges]
    splits: dict[str, EvenSplit]


class ChunkTable:
    """Every stored chunk numbered the same way on every rank: ids in (fqn, chunk) order. A split
    tensor (format v2) has one id per part (empty trailing parts included), found by arithmetic: the
    table costs O(tensors + explicit chunks), never O(ranks x tensors). Files, offsets and checksums
    of split parts are read from the index files only for the parts this rank reads
    (:func:`unickpt.loading.targets.resolve_parts`, into :attr:`resolved`)."""

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
        self._indexes: dict[str, ChunkIndex | SplitIndex] = {}
        self.resolved: dict[int, ChunkMeta] = {}  # split parts whose index records were read

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

    def itemsize(self, fqn: str) -> int:
        """Bytes per element of the stored tensor ``fqn``."""
        return self._dtypes[fqn].itemsize

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
        """Chunk ``cid`` with its file, offset and checksums (a split part: once its index record was read
        into :attr:`resolved`; KeyError before)."""
        fqn, k = self.locate(cid)
        t = self.meta.tensors[fqn]
        return t.explicit[k] if t.split is None else self.resolved[cid]


def split_needs(table: ChunkTable, fqn: str, cid: int, split: EvenSplit, verify: bool,
                only: int | None = None) -> dict[int, list[tuple[int, int]]]:
    """``{rank: byte ranges}`` of stored chunk ``cid`` (of tensor ``fqn``) that the ranks of a load
    need when rank ``j``'s target is part ``j`` of ``split`` (every rank's target of ``fqn`` is its
    part: a load into FSDP2 / ``Shard(dim)`` over the group); ``only``: that rank's alone. Ranges are
    merged and, with ``verify``, widened to checksum blocks: what
    :meth:`unickpt.loading.targets.TargetReads.add` records.
    Costs O(ranks needing the chunk), so a rank plans the reads of the chunks it needs without any
    rank listing its needs."""
    t = table.meta.tensors[fqn]
    shape, isz = t.shape, table.itemsize(fqn)
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
            ranges = merge_byte_ranges(runs)
            out[j] = widen_to_blocks(ranges, nbytes, block) if verify else ranges
    return out


def chunk_overlaps(table: ChunkTable, source: str, boxes: list[Box]) -> dict[int, list[tuple[int, ContiguousBox, Box]]]:
    """Chunk id -> ``(target index, stored piece, intersection)`` of every stored piece of ``source``
    that the target ``boxes`` overlap, in storage order (piece offset, then target)."""
    by_chunk: dict[int, list] = {}
    index, base = table.index(source), table.base[source]
    for t, tbox in enumerate(boxes):
        for i, piece, inter in index.overlapping(tbox):
            by_chunk.setdefault(base + i, []).append((piece.elem_offset, t, piece, inter))
    return {cid: [(t, p, inter) for _, t, p, inter in sorted(found, key=lambda x: x[:2])]
            for cid, found in by_chunk.items()}


def chunk_ranges(table: ChunkTable, source: str, cid: int, found: list[tuple[int, ContiguousBox, Box]], split: EvenSplit | None,
                 rank: int, verify: bool) -> list[tuple[int, int]]:
    """The merged byte ranges of chunk ``cid`` (of ``source``) holding ``found`` (its
    :func:`chunk_overlaps` entries), widened to checksum blocks with ``verify``; ``split``: the rule
    this rank's needs follow (then every rank computes the same ranges for this rank), or None."""
    if split is not None:  # exactly what every other rank computes for this rank
        return split_needs(table, source, cid, split, verify, only=rank)[rank]
    ranges = merge_byte_ranges(piece_runs([(p, inter) for _, p, inter in found], table.itemsize(source)))
    return widen_to_blocks(ranges, table.byte_length(cid), table.block_bytes(cid)) if verify else ranges


def spec_needs(table: ChunkTable, source: str, spec: Box | FlatRange | None, rank: int, world: int,
               verify: bool) -> tuple[dict[int, list[tuple[int, int]]], EvenSplit | None]:
    """What :meth:`unickpt.loading.targets.TargetReads.add` records for a target holding ``spec`` of
    ``source`` (None: nothing), without a tensor: ``({chunk id: byte ranges}, the split it is this rank's part of or
    None)``. Used by the planner simulation (benchmarks/plan_sim.py)."""
    shape = table.meta.tensors[source].shape
    split = EvenSplit.detect(shape, spec, rank, world)
    if spec is None:
        return {}, split
    boxes = [spec] if isinstance(spec, Box) else [p.box for p in chunk_pieces(spec, shape)]
    found = chunk_overlaps(table, source, boxes)
    return {cid: chunk_ranges(table, source, cid, found[cid], split, rank, verify) for cid in sorted(found)}, split


def piece_runs(found: list[tuple[ContiguousBox, Box]], isz: int) -> list[tuple[int, int]]:
    """Chunk-relative byte runs ``(start, length)`` holding the intersections ``found``
    (``(piece, intersection)`` pairs of one chunk), unmerged."""
    return [(p.elem_offset * isz + s, n) for p, inter in found for s, n in byte_runs(p.box, inter, isz)]


def merge_byte_ranges(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
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
    return merge_byte_ranges([(s // b * b, min(-(-(s + n) // b) * b, nbytes) - s // b * b) for s, n in ranges])
