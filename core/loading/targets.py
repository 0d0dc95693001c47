"""What this rank's targets need from storage: per stored chunk, the overlaps with the caller's
tensors and the byte ranges holding them (adjacent runs merged; with ``verify`` widened to whole
checksum blocks, so that every byte used is checked), and which chunks can be read straight into the
caller's memory. Built on the caller's thread before anything is read; the read plan
(:mod:`unickpt.plan.read_plan`) decides who reads which of these ranges job-wide.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..format.dtypes import str_to_dtype
from ..format.metadata import CheckpointMetadata, ChunkMeta
from ..geometry import Box, ChunkIndex, FlatRange, Piece, byte_runs, chunk_pieces
from ..state.flat import TensorLeaf

__all__ = ["ChunkTable", "Overlap", "TargetReads", "merge_ranges", "piece_runs", "widen_to_blocks", "narrowed",
           "target_views"]


class ChunkTable:
    """Every stored chunk numbered the same way on every rank: ids in (fqn, chunk) order."""

    def __init__(self, meta: CheckpointMetadata):
        self.chunks: list[tuple[ChunkMeta, torch.dtype]] = []
        self.fqns: list[str] = []  # the stored tensor of each chunk id
        self.by_fqn: dict[str, list[tuple[int, ChunkMeta]]] = {}
        for fqn in sorted(meta.tensors):
            t = meta.tensors[fqn]
            dtype = str_to_dtype(t.dtype)
            self.by_fqn[fqn] = []
            for c in t.chunks:
                self.by_fqn[fqn].append((len(self.chunks), c))
                self.chunks.append((c, dtype))
                self.fqns.append(fqn)


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
    """Everything this rank needs from storage: per chunk id, its overlaps and byte ranges."""

    overlaps: dict[int, list[Overlap]] = field(default_factory=dict)
    ranges: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)  # fqn -> elements to fill
    direct: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk id -> the target's own bytes
    fixups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (staging, caller's tensor)

    def add(self, leaf: TensorLeaf, shape: tuple[int, ...], chunks: list[tuple[int, ChunkMeta]], isz: int,
            verify: bool) -> None:
        """Record what ``leaf`` needs from ``chunks`` (``(chunk id, chunk)`` of its stored tensor)."""
        if isinstance(leaf.spec, FlatRange) and not leaf.local.is_contiguous():
            staging = torch.empty(leaf.local.shape, dtype=leaf.local.dtype)
            self.fixups.append((staging, leaf.local))
            leaf = TensorLeaf(leaf.fqn, leaf.dtype, leaf.global_shape, staging, leaf.spec)
        self.expected[leaf.fqn] = leaf.spec.numel
        targets = target_views(leaf)
        by_chunk: dict[int, list] = {}  # chunk index -> (piece offset, target index, Overlap)
        index = ChunkIndex(shape, [c.spec for _, c in chunks])
        for t, (tbox, view) in enumerate(targets):
            for i, piece, inter in index.overlapping(tbox):
                by_chunk.setdefault(i, []).append((piece.elem_offset, t, Overlap(piece, inter, tbox, view, leaf.fqn)))
        for i in sorted(by_chunk):
            cid, chunk = chunks[i]
            found = [o for _, _, o in sorted(by_chunk[i], key=lambda x: x[:2])]
            runs = piece_runs([(o.piece, o.inter) for o in found], isz)
            if cid not in self.overlaps and len(found) == 1:
                self._maybe_direct(cid, chunk, found[0], isz)
            else:
                self.direct.pop(cid, None)  # a second target for this chunk: read into a buffer
            self.overlaps.setdefault(cid, []).extend(found)
            ranges = merge_ranges(self.ranges.get(cid, []) + runs)
            self.ranges[cid] = widen_to_blocks(ranges, chunk) if verify else ranges


    def _maybe_direct(self, cid: int, chunk: ChunkMeta, o: Overlap, isz: int) -> None:
        """When the target needs the whole chunk and its memory for it is one contiguous CPU run,
        read (or receive) straight into the caller's tensor: no buffer, no copy."""
        if o.piece.elem_offset != 0 or o.inter != o.piece.box or o.piece.box.numel * isz != chunk.byte_length:
            return
        dst = narrowed(o.target, o.tbox, o.inter)
        if dst.device.type == "cpu" and dst.is_contiguous() and not dst.is_conj() and not dst.is_neg():
            self.direct[cid] = dst.reshape(-1).view(torch.uint8)


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


def widen_to_blocks(ranges: list[tuple[int, int]], chunk: ChunkMeta) -> list[tuple[int, int]]:
    """Ranges widened to whole checksum blocks (the whole chunk if it has no blocks)."""
    if not chunk.block_checksums:
        return [(0, chunk.byte_length)]
    b = chunk.block_bytes
    return merge_ranges([(s // b * b, min(-(-(s + n) // b) * b, chunk.byte_length) - s // b * b) for s, n in ranges])
