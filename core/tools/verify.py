"""``verify_checkpoint``: read every stored byte of a checkpoint and check it against the metadata."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import IntegrityError
from ..loading.checks import read_committed
from ..loading.reads import read_ranges, verify_ranges
from ..storage import open_storage

__all__ = ["Problem", "verify_checkpoint"]


@dataclass(frozen=True)
class Problem:
    """One defect: the file, the tensor (or object) it belongs to, and what is wrong."""

    file: str
    key: str
    error: str


def verify_checkpoint(path: str, storage_options: dict | None = None,
                      max_buffer_bytes: int = 64 << 20,
                      progress: Callable[[int, int], None] | None = None) -> tuple[list[Problem], int]:
    """Check every chunk's bytes (checksums, lengths), the index files of split tensors (format v2)
    and every per-rank object file of ``path``.

    Reads chunk by chunk, in pieces of at most ``max_buffer_bytes`` (whole checksum blocks).
    Returns ``(problems, bytes checked)``; an empty list means the checkpoint is intact. Raises
    CheckpointNotFoundError / FormatVersionError / IntegrityError when the metadata itself is
    missing or unreadable. ``progress(done, total)`` is called with the chunk bytes checked so far
    (of all chunks' bytes) after each piece.
    """
    storage = open_storage(path, storage_options)
    meta = read_committed(storage, path)
    problems: list[Problem] = []
    checked = 0
    total = sum(t.nbytes for t in meta.tensors.values())
    done = 0
    for fqn in sorted(meta.tensors):
        try:
            chunks = meta.tensors[fqn].chunks  # a split tensor's come from the index files
        except IntegrityError as e:
            problems.append(Problem("index", fqn, str(e)))
            done += meta.tensors[fqn].nbytes
            continue
        for chunk in chunks:
            file = storage.join(path, chunk.file)
            step = chunk.block_bytes * max(1, max_buffer_bytes // chunk.block_bytes) if chunk.block_checksums \
                else chunk.byte_length
            try:
                for start in range(0, chunk.byte_length, max(step, 1)):
                    span = [(start, min(step, chunk.byte_length - start))]
                    buf = torch.empty(span[0][1], dtype=torch.uint8)
                    checked += read_ranges(storage, file, chunk, span, buf, start)
                    verify_ranges(buf, start, span, chunk, file)
                    if progress:
                        progress(done + start + span[0][1], total)
            except IntegrityError as e:
                problems.append(Problem(chunk.file, fqn, str(e)))
            done += chunk.byte_length
    for rel in meta.per_rank.get("files", []):
        if rel is None:
            continue
        try:
            data = storage.read_bytes(storage.join(path, rel))
            checked += len(data)
            missing = set(meta.per_rank.get("fqns", [])) - set(json.loads(data))
            if missing:
                problems.append(Problem(rel, ", ".join(sorted(missing)), "per-rank entries missing from the file"))
        except (OSError, ValueError) as e:
            problems.append(Problem(rel, "per-rank state", f"{type(e).__name__}: {e}"))
    return problems, checked
