"""Reading stored byte ranges, verifying them against their checksum blocks, and copying them into
the caller's tensors in place (no dtype conversion). Runs on the read threads of a load
(:mod:`unickpt.loading.exchange`) and in the tools (:mod:`unickpt.tools.reader`).
"""
from __future__ import annotations

from typing import Any

import torch

from .._util import host_bytes
from ..errors import IntegrityError
from ..format.integrity import checksum
from ..format.metadata import ChunkMeta
from ..geometry import row_major_strides
from ..storage.base import StorageBackend
from .targets import Overlap, narrowed

__all__ = ["verify_ranges", "read_ranges", "copy_overlaps"]


def verify_ranges(buf: torch.Tensor, lo: int, ranges: list[tuple[int, int]], chunk: ChunkMeta, path: str) -> int:
    """Compare every checksum block inside ``ranges`` (block-aligned) with the metadata; ``buf[i]``
    holds chunk byte ``lo + i``. Returns the number of blocks checked. Raises IntegrityError."""
    data = host_bytes(buf)
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


def read_ranges(storage: StorageBackend, path: str, chunk: ChunkMeta, ranges: list[tuple[int, int]], buf: torch.Tensor,
                lo: int) -> int:
    """Read chunk-relative ``ranges`` of ``chunk`` (in file ``path``) into ``buf`` (``buf[i]`` = chunk byte
    ``lo + i``). Returns bytes read. Raises IntegrityError for a missing, short or out-of-range file
    (a short one: naming the file, its length and the length needed, before any byte is read from
    a local file)."""
    hi = max(s + n for s, n in ranges)
    if hi > chunk.byte_length:
        raise IntegrityError(f"{chunk.file}: chunk {chunk.spec} has {chunk.byte_length} bytes, needs {hi}")
    try:
        storage.read_into(path, [(chunk.byte_offset + s, n) for s, n in ranges], host_bytes(buf),
                          base=chunk.byte_offset + lo)
    except EOFError as e:  # the backend names the file, its length and the length needed
        raise IntegrityError(f"truncated checkpoint file: {e}; chunk {chunk.spec} of {chunk.file} is bytes "
                             f"[{chunk.byte_offset}, {chunk.byte_offset + chunk.byte_length}) of it") from e
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
            narrowed(o.target, o.tbox, o.inter).copy_(src)
            filled += o.inter.numel
    return filled
