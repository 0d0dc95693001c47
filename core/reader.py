"""This rank's side of a load: which stored bytes its target shards overlap, reading and verifying
byte ranges, and copying them into the caller's tensors in place (no dtype conversion).

Per stored chunk, a rank needs only the byte runs holding elements that overlap its target shard
(adjacent runs merged). With ``verify=True`` (the default) every byte used is checked: runs are
widened to whole checksum blocks (a chunk of at most 1 MiB is one block, so it is read whole; larger
chunks have blocks of at least 1 MiB, at most 32 per chunk) and each block read is compared with its stored checksum. ``verify=False``
reads exactly the bytes needed and checks nothing. Who reads which range is decided job-wide by
:mod:`unickpt.read_plan`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import IntegrityError
from .metadata import ChunkMeta, checksum
from .resharding import Box, ChunkIndex, FlatRange, Piece, byte_runs, chunk_pieces, row_major_strides
from .state import TensorLeaf
from .storage import Storage

__all__ = ["LoadStats", "Overlap", "TargetReads", "merge_ranges", "piece_runs", "widen_to_blocks", "verify_ranges",
           "read_ranges", "copy_overlaps"]


@dataclass
class LoadStats:
    """Per-rank counters (bytes) and timings (seconds) of one load."""

    bytes_read: int = 0  # tensor bytes read from storage by this rank
    storage_bytes_read: int = 0  # everything this rank read, as counted by the storage layer
    reads: int = 0  # ranged read requests
    blocks_verified: int = 0  # small chunks, or blocks of large ones, checked against checksums
    bytes_received: int = 0  # over the process group, read by other ranks
    bytes_sent: int = 0
    plan_cache_hit: bool = False
    redistributed: bool = False  # read once job-wide and redistributed (see loading._should_redistribute)
    rounds: int = 0  # read/exchange rounds (bounded read buffer)
    peak_buffer_bytes: int = 0
    plan_s: float = 0.0
    read_s: float = 0.0  # reads and exchange, overlapped
    copy_s: float = 0.0
    total_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


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
        targets = _target_views(leaf)
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
        dst = _narrowed(o.target, o.tbox, o.inter)
        if dst.device.type == "cpu" and dst.is_contiguous() and not dst.is_conj() and not dst.is_neg():
            self.direct[cid] = dst.reshape(-1).view(torch.uint8)


def piece_runs(found: list[tuple[Piece, Box]], isz: int) -> list[tuple[int, int]]:
    """Chunk-relative byte runs ``(start, length)`` holding the intersections ``found``
    (``(piece, intersection)`` pairs of one chunk), unmerged."""
    return [(p.elem_offset * isz + s, n) for p, inter in found for s, n in byte_runs(p.box, inter, isz)]


def _narrowed(target: torch.Tensor, tbox: Box, inter: Box) -> torch.Tensor:
    for d, (t0, i0, n) in enumerate(zip(tbox.offsets, inter.offsets, inter.lengths)):
        target = target.narrow(d, i0 - t0, n)
    return target


def _target_views(leaf: TensorLeaf) -> list[tuple[Box, torch.Tensor]]:
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


def verify_ranges(buf: torch.Tensor, lo: int, ranges: list[tuple[int, int]], chunk: ChunkMeta, path: str) -> int:
    """Compare every checksum block inside ``ranges`` (block-aligned) with the metadata; ``buf[i]``
    holds chunk byte ``lo + i``. Returns the number of blocks checked. Raises IntegrityError."""
    data = memoryview(buf.numpy())
    if not chunk.block_checksums:
        spans = [(0, chunk.byte_length, chunk.checksum)]
    else:
        b = chunk.block_bytes
        spans = [(i * b, min(b, chunk.byte_length - i * b), chunk.block_checksums[i])
                 for s, n in ranges for i in range(s // b, -(-(s + n) // b))]
    for start, length, want in spans:
        got = checksum(data[start - lo : start - lo + length])
        if got != want:
            raise IntegrityError(
                f"{path}: bytes [{chunk.byte_offset + start}, {chunk.byte_offset + start + length}) of chunk "
                f"{chunk.spec} have checksum {got}, metadata says {want} (the file is corrupt)"
            )
    return len(spans)


def read_ranges(storage: Storage, path: str, chunk: ChunkMeta, ranges: list[tuple[int, int]], buf: torch.Tensor,
                lo: int) -> int:
    """Read chunk-relative ``ranges`` of ``chunk`` (in file ``path``) into ``buf`` (``buf[i]`` = chunk byte
    ``lo + i``). Returns bytes read. Raises IntegrityError for a missing, short or out-of-range file."""
    hi = max(s + n for s, n in ranges)
    if hi > chunk.byte_length:
        raise IntegrityError(f"{chunk.file}: chunk {chunk.spec} has {chunk.byte_length} bytes, needs {hi}")
    try:
        storage.read_into(path, [(chunk.byte_offset + s, n) for s, n in ranges], memoryview(buf.numpy()),
                          base=chunk.byte_offset + lo)
    except EOFError as e:
        raise IntegrityError(f"truncated checkpoint file: {e}") from e
    except FileNotFoundError as e:
        raise IntegrityError(f"checkpoint data file {path!r} is missing (the checkpoint is damaged)") from e
    return sum(n for _, n in ranges)


def copy_overlaps(buf: torch.Tensor, lo: int, overlaps: list[Overlap], dtype: torch.dtype) -> int:
    """Copy each overlap from ``buf`` (chunk bytes from ``lo``) into its target view; returns elements copied."""
    isz = dtype.itemsize
    typed = buf.view(dtype)
    base_elem = lo // isz
    filled = 0
    with torch.no_grad():
        for o in overlaps:
            strides = row_major_strides(o.piece.box.lengths)
            first = o.piece.elem_offset + sum((a - p) * s for a, p, s in zip(o.inter.offsets, o.piece.box.offsets, strides))
            src = typed.as_strided(o.inter.lengths, strides, first - base_elem)
            _narrowed(o.target, o.tbox, o.inter).copy_(src)
            filled += o.inter.numel
    return filled
