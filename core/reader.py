"""Reading tensors back: every target shard gets exactly the stored bytes it overlaps.

For one tensor, each stored chunk that overlaps the rank's target shard is read once: only the byte
runs that hold overlapping elements (adjacent runs merged; ``pread`` locally, ranged reads on
fsspec stores), into one buffer per chunk, from which each overlap is copied into the caller's
tensor in place, with no dtype conversion.

With ``verify=True`` (the default) every byte used is checked: runs are widened to whole checksum
blocks (a chunk of at most 4 MiB is one block, so it is read whole; larger chunks have 4 MiB
blocks) and each block read is compared with its stored checksum. ``verify=False`` reads exactly
the bytes needed and checks nothing.
"""
from __future__ import annotations

import torch

from .codec import str_to_dtype
from .errors import IntegrityError
from .metadata import ChunkMeta, TensorMeta, checksum
from .resharding import Box, FlatRange, Piece, byte_runs, chunk_pieces, intersect, row_major_strides
from .state import TensorLeaf
from .storage import Storage

__all__ = ["LoadStats", "load_tensor"]


class LoadStats:
    """Per-rank counters of one load: ``bytes_read`` from storage, ``reads`` (ranged requests) and
    ``blocks_verified`` (whole small chunks or 4 MiB blocks of large ones checked against checksums)."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.reads = 0
        self.blocks_verified = 0

    def as_dict(self) -> dict:
        return {"bytes_read": self.bytes_read, "reads": self.reads, "blocks_verified": self.blocks_verified}


def _targets(leaf: TensorLeaf) -> list[tuple[Box, torch.Tensor]]:
    """(global box, tensor view with that box's shape) for each storage-contiguous piece of the target."""
    if isinstance(leaf.spec, Box):
        return [(leaf.spec, leaf.local)] if leaf.spec.numel else []
    flat = leaf.local.view(-1)  # flat targets must be contiguous (checked by the caller)
    return [(p.box, flat[p.elem_offset : p.elem_offset + p.box.numel].view(p.box.lengths))
            for p in chunk_pieces(leaf.spec, leaf.global_shape)]


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, length in sorted(runs):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            end = max(merged[-1][0] + merged[-1][1], start + length)
            merged[-1] = (merged[-1][0], end - merged[-1][0])
        else:
            merged.append((start, length))
    return merged


def _narrow(t: torch.Tensor, outer: Box, inner: Box) -> torch.Tensor:
    for d, (o, io, il) in enumerate(zip(outer.offsets, inner.offsets, inner.lengths)):
        t = t.narrow(d, io - o, il)
    return t


def load_tensor(storage: Storage, ckpt_path: str, leaf: TensorLeaf, meta: TensorMeta, stats: LoadStats,
                verify: bool = True) -> None:
    """Fill ``leaf.local`` from the stored chunks of ``meta``. Raises IntegrityError on corrupt data."""
    dtype = str_to_dtype(meta.dtype)
    isz = dtype.itemsize
    local = leaf.local
    staging = None
    if isinstance(leaf.spec, FlatRange) and not local.is_contiguous():
        staging = torch.empty(local.shape, dtype=local.dtype)
        leaf = TensorLeaf(leaf.fqn, leaf.dtype, leaf.global_shape, staging, leaf.spec)
    targets = _targets(leaf)
    filled = 0
    for chunk in meta.chunks:
        overlaps: list[tuple[Piece, Box, Box, torch.Tensor]] = []
        for piece in chunk_pieces(chunk.spec, meta.shape):
            for tbox, tview in targets:
                inter = intersect(tbox, piece.box)
                if inter is not None:
                    overlaps.append((piece, inter, tbox, tview))
        if overlaps:
            filled += _read_chunk(storage, ckpt_path, chunk, overlaps, dtype, isz, stats, verify)
    want = leaf.spec.numel
    if filled != want:
        raise IntegrityError(f"{leaf.fqn!r}: stored chunks cover {filled} of the {want} elements this rank needs")
    if staging is not None:
        with torch.no_grad():
            local.copy_(staging)


def _widen_to_blocks(runs: list[tuple[int, int]], chunk: ChunkMeta) -> list[tuple[int, int]]:
    """Runs widened to whole checksum blocks (the whole chunk if it has no blocks)."""
    if not chunk.block_checksums:
        return [(0, chunk.byte_length)]
    b = chunk.block_bytes
    return _merge([(s // b * b, min(-(-(s + n) // b) * b, chunk.byte_length) - s // b * b) for s, n in runs])


def _verify(buf: torch.Tensor, lo: int, runs: list[tuple[int, int]], chunk: ChunkMeta, path: str) -> int:
    """Compare every block inside ``runs`` with its checksum; returns the number of blocks checked."""
    data = memoryview(buf.numpy())
    if not chunk.block_checksums:
        spans = [(0, chunk.byte_length, chunk.checksum)]
    else:
        b = chunk.block_bytes
        spans = [(i * b, min(b, chunk.byte_length - i * b), chunk.block_checksums[i])
                 for s, n in runs for i in range(s // b, -(-(s + n) // b))]
    for start, length, want in spans:
        got = checksum(data[start - lo : start - lo + length])
        if got != want:
            raise IntegrityError(
                f"{path}: bytes [{chunk.byte_offset + start}, {chunk.byte_offset + start + length}) of chunk "
                f"{chunk.spec} have checksum {got}, metadata says {want} (the file is corrupt)"
            )
    return len(spans)


def _read_chunk(storage: Storage, ckpt_path: str, chunk: ChunkMeta, overlaps: list, dtype: torch.dtype, isz: int,
                stats: LoadStats, verify: bool) -> int:
    runs = []
    for piece, inter, _, _ in overlaps:
        runs += [(piece.elem_offset * isz + s, n) for s, n in byte_runs(piece.box, inter, isz)]
    runs = _merge(runs)
    if verify:
        runs = _widen_to_blocks(runs, chunk)
    lo, hi = runs[0][0], runs[-1][0] + runs[-1][1]
    if hi > chunk.byte_length:
        raise IntegrityError(f"{chunk.file}: chunk {chunk.spec} has {chunk.byte_length} bytes, needs {hi}")
    buf = torch.empty(hi - lo, dtype=torch.uint8)
    path = storage.join(ckpt_path, chunk.file)
    try:
        storage.read_into(path, [(chunk.byte_offset + s, n) for s, n in runs], memoryview(buf.numpy()),
                          base=chunk.byte_offset + lo)
    except EOFError as e:
        raise IntegrityError(f"truncated checkpoint file: {e}") from e
    except FileNotFoundError as e:
        raise IntegrityError(f"checkpoint data file {path!r} is missing (the checkpoint is damaged)") from e
    stats.bytes_read += sum(n for _, n in runs)
    stats.reads += len(runs)
    if verify:
        stats.blocks_verified += _verify(buf, lo, runs, chunk, path)
    typed = buf.view(dtype)
    base_elem = lo // isz
    filled = 0
    with torch.no_grad():
        for piece, inter, tbox, tview in overlaps:
            strides = row_major_strides(piece.box.lengths)
            first = piece.elem_offset + sum((o - po) * s for o, po, s in zip(inter.offsets, piece.box.offsets, strides))
            src = typed.as_strided(inter.lengths, strides, first - base_elem)
            _narrow(tview, tbox, inter).copy_(src)
            filled += inter.numel
    return filled
