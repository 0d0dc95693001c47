"""``CheckpointReader``: a committed checkpoint read tensor by tensor in one process, without a
process group (the tools' view: export, diff, inspection).

Every chunk is read whole and, unless ``verify=False``, checked against its checksum (or checksum
blocks) before use. At most one tensor plus one chunk buffer is in memory at a time; a chunk that
is a contiguous run of the tensor (a flat range, or a box whose trailing dimensions are full) is
read straight into the tensor, with no buffer.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from ..errors import IntegrityError, StateMismatchError
from ..format.dtypes import str_to_dtype
from ..format.metadata import ChunkMeta, CheckpointMetadata, TensorMeta
from ..loading.checks import read_committed
from ..geometry import Box, ChunkIndex, FlatRange, row_major_strides
from ..loading.reads import read_ranges, verify_ranges
from ..state import codec
from ..state.flat import saved_leaves
from ..storage import open_storage

__all__ = ["CheckpointReader"]


def _contiguous_start(spec: Box, shape: tuple[int, ...]) -> int | None:
    """Element offset of ``spec`` in the row-major tensor of ``shape`` when the box is one
    contiguous run there (every dimension after the first one longer than 1 is full), else None."""
    dims = [d for d, n in enumerate(spec.lengths) if n != 1]
    if dims and any(spec.lengths[d] != shape[d] for d in range(dims[0] + 1, len(shape))):
        return None
    return sum(o * s for o, s in zip(spec.offsets, row_major_strides(shape)))


class CheckpointReader:
    """Read the committed checkpoint at ``path`` (local path or fsspec URL) in this process only.

    Args:
        path: the checkpoint directory (``step_<N>``, not a root).
        storage_options: passed to fsspec.
        verify: check each chunk's bytes against its xxh3-64 checksum(s) before use.

    Raises CheckpointNotFoundError (no ``metadata.json``), FormatVersionError, IntegrityError
    (malformed metadata) on construction.
    """

    def __init__(self, path: str, storage_options: dict | None = None, *, verify: bool = True):
        self.path = str(path)
        self.storage = open_storage(self.path, storage_options)
        self.meta: CheckpointMetadata = read_committed(self.storage, self.path)  # a root: names its newest step
        self.verify = verify
        self._last_chunk: tuple[Any, torch.Tensor | None] = (None, None)

    def keys(self) -> list[str]:
        """Every tensor fqn, tied ones (aliases) included, sorted."""
        return sorted(set(self.meta.tensors) | set(self.meta.aliases))

    def tensor_meta(self, fqn: str) -> TensorMeta:
        """dtype, global shape and chunks of ``fqn`` (an alias resolves to its target). Raises
        StateMismatchError naming ``fqn`` when the checkpoint has no such tensor."""
        source = self.meta.aliases.get(fqn, fqn)
        if source not in self.meta.tensors:
            raise StateMismatchError(f"{fqn!r} is not a tensor of the checkpoint {self.path}")
        return self.meta.tensors[source]

    def dtype(self, fqn: str) -> torch.dtype:
        return str_to_dtype(self.tensor_meta(fqn).dtype)

    def shape(self, fqn: str) -> tuple[int, ...]:
        """The global shape of ``fqn``."""
        return tuple(self.tensor_meta(fqn).shape)

    def nbytes(self, fqn: str) -> int:
        """Stored bytes of ``fqn`` (elements x itemsize)."""
        return self.tensor_meta(fqn).nbytes

    def read(self, fqn: str) -> torch.Tensor:
        """The whole (unsharded) tensor ``fqn``: a new contiguous CPU tensor of the stored dtype and
        global shape. Raises IntegrityError for a missing, short or corrupt data file."""
        t = self.tensor_meta(fqn)
        try:
            return self._read(t)
        except IntegrityError as e:  # name the tensor: the reader's message names only the file
            raise IntegrityError(f"tensor {fqn!r}: {e}") from e

    def _read(self, t: TensorMeta) -> torch.Tensor:
        shape = tuple(t.shape)
        out = torch.empty(shape, dtype=str_to_dtype(t.dtype))
        flat_bytes = out.reshape(-1).view(torch.uint8)
        isz = out.element_size()
        for chunk in t.chunks:
            if chunk.byte_length == 0:
                continue
            spec = chunk.spec
            start = spec.start if isinstance(spec, FlatRange) else _contiguous_start(spec, shape)
            if start is not None:
                self._read_chunk(chunk, flat_bytes[start * isz : start * isz + chunk.byte_length])
                continue
            assert isinstance(spec, Box)  # a flat range always has a start
            buf = torch.empty(chunk.byte_length, dtype=torch.uint8)
            self._read_chunk(chunk, buf)
            box = tuple(slice(o, o + n) for o, n in zip(spec.offsets, spec.lengths))
            out[box].copy_(buf.view(out.dtype).view(spec.lengths))
        return out

    def _read_chunk(self, chunk: ChunkMeta, buf: torch.Tensor) -> None:
        file = self.storage.join(self.path, chunk.file)
        span = [(0, chunk.byte_length)]
        read_ranges(self.storage, file, chunk, span, buf, 0)
        if self.verify:
            verify_ranges(buf, 0, span, chunk, file)

    def read_box(self, fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
        """The box ``(offsets, lengths)`` of tensor ``fqn``: a new CPU tensor of the stored dtype, read from
        the chunks that overlap it only (each read whole and verified). Raises IntegrityError when the
        stored chunks do not cover the box."""
        t = self.tensor_meta(fqn)
        box = Box(tuple(offsets), tuple(lengths))
        out = torch.empty(box.lengths, dtype=str_to_dtype(t.dtype))
        index = ChunkIndex(tuple(t.shape), [c.spec for c in t.chunks])
        found = index.overlapping(box)
        filled = 0
        for i, piece, inter in found:
            chunk = t.chunks[i]
            key = (chunk.file, chunk.byte_offset, chunk.byte_length)
            if self._last_chunk[0] != key:  # one chunk buffer at a time, kept for the next box (q, k, v of one qkv)
                buf = torch.empty(chunk.byte_length, dtype=torch.uint8)
                try:
                    self._read_chunk(chunk, buf)
                except IntegrityError as e:
                    raise IntegrityError(f"tensor {fqn!r}: {e}") from e
                self._last_chunk = (key, buf)
            chunk_bytes = self._last_chunk[1]
            assert chunk_bytes is not None  # set with the key above
            isz = out.element_size()
            src = chunk_bytes[piece.elem_offset * isz: (piece.elem_offset + piece.box.numel) * isz]
            src = src.view(out.dtype).view(piece.box.lengths)
            src = src[tuple(slice(a - b, a - b + n) for a, b, n in zip(inter.offsets, piece.box.offsets, inter.lengths))]
            dst = out[tuple(slice(a - b, a - b + n) for a, b, n in zip(inter.offsets, box.offsets, inter.lengths))]
            dst.copy_(src)
            filled += inter.numel
        if filled != box.numel:
            raise IntegrityError(f"tensor {fqn!r}: stored chunks cover {filled} of the {box.numel} elements of {box}")
        return out

    def read_resolved(self, res: Any) -> torch.Tensor:
        """A tensor assembled from the pieces of a :class:`~unickpt.plan.mapping.Resolved` whose sources
        are this checkpoint's fqns (renamed, split, fused, permuted tensors), one stored box at a time."""
        out = torch.empty(res.shape, dtype=str_to_dtype(res.dtype))
        for p in res.pieces:
            region = tuple(slice(o, o + n) for o, n in zip(p.region.offsets, p.region.lengths))
            out[region] = self.read_box(p.source, p.offsets, p.region.lengths)
        return out

    def items(self, keys: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(fqn, tensor)`` for ``keys`` (default: all), one tensor in memory at a time."""
        for fqn in self.keys() if keys is None else keys:
            yield fqn, self.read(fqn)

    def objects(self) -> dict[str, Any]:
        """Plain (non-tensor) values of the state, still encoded as tagged JSON (decoding
        ``__pickle__`` values would need ``allow_pickle``): ``{fqn: encoded value}``."""
        return saved_leaves(self.meta.state_tree)[2]

    def decoded_objects(self, *, allow_pickle: bool = False) -> dict[str, Any]:
        """Plain values decoded; raises UnsafeObjectError for a pickled one unless ``allow_pickle``."""
        return {k: codec.decode(v, allow_pickle=allow_pickle, key=k) for k, v in self.objects().items()}
