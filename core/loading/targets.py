"""What this rank's targets need from storage (:class:`TargetReads`): per stored chunk, the overlaps
with views of the caller's tensors and the byte ranges holding them (the pure geometry:
:mod:`unickpt.plan.needs`), and which chunks can be read straight into the caller's memory; and the
index records of the split parts this rank reads (:func:`resolve_parts`, the one read here). Built
on the caller's thread before anything is read; the read plan (:mod:`unickpt.plan.read_plan`)
decides who reads which of these ranges job-wide.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from ..format.index import IndexReader
from ..format.metadata import split_chunk
from ..geometry import Box, EvenSplit, FlatRange, ContiguousBox, chunk_pieces, intersect
from ..plan.needs import ChunkTable, Ranges, chunk_overlaps, chunk_ranges, merge_byte_ranges
from ..state.flat import TensorLeaf
from ..storage.base import StorageBackend

__all__ = ["Overlap", "TargetReads", "resolve_parts", "narrowed", "target_views"]


@dataclass
class Overlap:
    """Elements ``inter`` (a global box) of a stored piece, to be copied into ``target`` (a view of the
    caller's tensor whose global box is ``tbox``)."""

    piece: ContiguousBox
    inter: Box
    tbox: Box
    target: torch.Tensor
    fqn: str


@dataclass
class TargetReads:
    """Everything this rank needs from storage: per chunk id, its overlaps and byte ranges.

    ``splits``: stored fqn -> the split this rank's target of it is its part of (``rank``, ``world``:
    this rank in the load's group). Every rank can compute such needs of any rank
    (:func:`unickpt.plan.needs.split_needs`), so only the rule travels in the read plan's gather."""

    rank: int = 0
    world: int = 1
    overlaps: dict[int, list[Overlap]] = field(default_factory=dict)
    ranges: dict[int, Ranges] = field(default_factory=dict)
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
        isz = table.itemsize(source)
        found = chunk_overlaps(table, source, [tbox for tbox, _ in targets])
        for cid in sorted(found):
            overlaps = [Overlap(piece, inter, targets[t][0], targets[t][1], fqn) for t, piece, inter in found[cid]]
            if cid not in self.overlaps and len(overlaps) == 1:
                self._maybe_direct(cid, table.byte_length(cid), overlaps[0], isz)
            else:
                self.direct.pop(cid, None)  # a second target for this chunk: read into a buffer
            self.overlaps.setdefault(cid, []).extend(overlaps)
            ranges = chunk_ranges(table, source, cid, found[cid], split, self.rank, verify)
            self.ranges[cid] = merge_byte_ranges(self.ranges[cid] + ranges) if cid in self.ranges else ranges

    def _maybe_direct(self, cid: int, nbytes: int, o: Overlap, isz: int) -> None:
        """When the target needs the whole chunk and its memory for it is one contiguous CPU run,
        read (or receive) straight into the caller's tensor: no buffer, no copy."""
        if o.piece.elem_offset != 0 or o.inter != o.piece.box or o.piece.box.numel * isz != nbytes:
            return
        dst = narrowed(o.target, o.tbox, o.inter)
        if dst.device.type == "cpu" and dst.is_contiguous() and not dst.is_conj() and not dst.is_neg():
            self.direct[cid] = dst.reshape(-1).view(torch.uint8)


def resolve_parts(table: ChunkTable, storage: StorageBackend, path: str, cids: Iterable[int]) -> int:
    """Read the index records of the split parts among ``cids`` not yet in ``table.resolved`` (format
    v2): per writer, one ranged read of its records, one of their block checksums. Returns the index
    files read.
    Raises IntegrityError for a missing or corrupt index file."""
    by_writer: dict[int, dict[int, list[int]]] = {}  # writer -> slot -> chunk ids
    for cid in cids:
        if cid in table.resolved:
            continue
        fqn, k = table.locate(cid)
        t = table.meta.tensors[fqn]
        if t.split is not None:
            by_writer.setdefault(k, {}).setdefault(t.slot, []).append(cid)
    reader = IndexReader(storage, path, prefix=table.meta.index.get("prefix", ""),
                         slots=table.meta.index.get("slots"))
    for writer, slots in sorted(by_writer.items()):
        records = reader.records(writer, sorted(slots))
        for slot, ids in slots.items():
            for cid in ids:
                fqn, k = table.locate(cid)
                table.resolved[cid] = split_chunk(table.meta.tensors[fqn], k, records[slot], table.meta.index)
    return len(by_writer)


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
