"""``diff_checkpoints``: which tensors and values differ between two checkpoints, tensor by tensor
(one tensor in memory at a time per unickpt checkpoint), for checking a resume or a conversion
(either side may be a checkpoint of another format)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import CheckpointNotFoundError, FormatVersionError, UnickptError
from ..format.dtypes import dtype_to_str
from ..format.metadata import CheckpointMetadata
from ..state.flat import flatten, saved_leaves
from .reader import CheckpointReader

__all__ = ["Difference", "diff_checkpoints", "open_checkpoint", "read_full_tensor"]


@dataclass(frozen=True)
class Difference:
    """One differing key: ``kind`` is missing_in_a / missing_in_b / dtype / shape / values / object.

    For ``values``: ``max_abs_diff`` (max |a - b| over the differing elements: exact for integer
    dtypes, float64 otherwise; None when the dtype has no float conversion or a NaN is involved),
    ``elements_differ`` (elements whose bits differ) and
    ``first_index`` (index of the first one, row-major).
    """

    key: str
    kind: str
    detail: str
    max_abs_diff: float | None = None
    elements_differ: int | None = None
    first_index: list[int] | None = None


def read_full_tensor(path: str, fqn: str, meta: CheckpointMetadata | None = None,
                     storage_options: dict | None = None) -> torch.Tensor:
    """The whole (unsharded) tensor ``fqn`` of checkpoint ``path``, read in this process only
    (``meta`` is ignored; kept for callers of the earlier signature)."""
    return CheckpointReader(path, storage_options).read(fqn)


def _differing(xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """Boolean mask over the row-major flattened tensors: elements whose bit patterns differ (so
    NaNs with equal bits are equal and -0.0 differs from 0.0)."""
    ba, bb = xa.reshape(-1).view(torch.uint8), xb.reshape(-1).view(torch.uint8)
    return (ba != bb).view(-1, xa.element_size()).any(dim=1)


def _first_difference(xa: torch.Tensor, xb: torch.Tensor) -> tuple[int, list[int]]:
    """(number of differing elements, index of the first one), comparing bit patterns."""
    neq = _differing(xa, xb)
    n = int(neq.sum().item())
    first = int(neq.nonzero()[0, 0].item()) if n else 0
    return n, [int(i) for i in torch.unravel_index(torch.tensor(first), xa.shape)] if xa.dim() else []


def _max_abs_diff(xa: torch.Tensor, xb: torch.Tensor) -> float | int:
    """max |a - b| over the elements whose bits differ (equal NaNs do not poison it). Integer
    tensors give an exact Python int (float64 would round 2**62 + 1 to 2**62 and call it 0);
    floating and complex tensors a float64 (nan when a NaN or an inf - inf is involved)."""
    neq = _differing(xa, xb)
    a, b = xa.reshape(-1)[neq], xb.reshape(-1)[neq]
    if a.dtype == torch.bool or a.is_floating_point() or a.is_complex():
        wide = torch.complex128 if a.is_complex() else torch.float64
        return (a.to(wide) - b.to(wide)).abs().max().item()
    import numpy as np  # integers: unsigned 64-bit arithmetic is exact for |a - b| < 2**64

    x, y = a.numpy(), b.numpy()
    if x.itemsize < 8:
        x, y = x.astype(np.int64), y.astype(np.int64)
    hi, lo = np.maximum(x, y), np.minimum(x, y)
    return int((hi - lo).view(np.uint64).max())


class _StateSource:
    """A checkpoint of another format (see :mod:`unickpt.tools.importers`), read whole, seen as a
    :class:`CheckpointReader`: the fqns and plain values are those a save of it would produce."""

    def __init__(self, path: str, allow_pickle: bool):
        from .importers import read_source

        flat = flatten(read_source(path, allow_pickle=allow_pickle), for_load=False, allow_pickle=True)
        self._tensors = {fqn: leaf.local for fqn, leaf in flat.tensors.items()}
        self._objects = saved_leaves(flat.skeleton)[2]

    def keys(self) -> list[str]:
        return sorted(self._tensors)

    def dtype(self, fqn: str) -> torch.dtype:
        return self._tensors[fqn].dtype

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self._tensors[fqn].shape)

    def nbytes(self, fqn: str) -> int:
        return self._tensors[fqn].numel() * self._tensors[fqn].element_size()

    def read(self, fqn: str) -> torch.Tensor:
        return self._tensors[fqn].contiguous()

    def objects(self) -> dict[str, Any]:
        return self._objects


def open_checkpoint(path: str, storage_options: dict | None = None, *,
                    allow_pickle: bool = False) -> CheckpointReader | _StateSource:
    """A unickpt checkpoint as a :class:`CheckpointReader`; else, when ``path`` is a local
    checkpoint of a format :func:`unickpt.tools.importers.detect_source` knows (torch, safetensors, HF,
    DCP, Megatron, DeepSpeed), that checkpoint read whole into memory. Raises the unickpt reader's
    error (e.g. CheckpointNotFoundError) when it is neither."""
    try:
        return CheckpointReader(path, storage_options)
    except (CheckpointNotFoundError, FormatVersionError, NotADirectoryError) as e:
        from .importers import detect_source

        try:
            detect_source(path)
        except UnickptError:
            raise e from None
        return _StateSource(path, allow_pickle)


def diff_checkpoints(a: str, b: str, *, atol: float = 0.0, storage_options: dict | None = None,
                     allow_pickle: bool = False, progress: Callable[[int, int], None] | None = None) -> list[Difference]:
    """Compare two checkpoints key by key: tensors (presence, dtype, shape, values) and plain values.

    ``a`` and ``b`` are unickpt checkpoints or, to check a conversion, checkpoints of another
    format (see :func:`open_checkpoint`; reading some of them needs ``allow_pickle``). Values are
    compared bitwise (NaNs with equal bits are equal) unless ``atol`` > 0 (then ``max |a - b| <= atol``
    over the differing elements passes; exact for integers, float64 otherwise); every differing
    tensor reports its max abs diff, the number of differing
    elements and the first differing index. One tensor per unickpt checkpoint is in memory at a
    time; ``progress(done, total)`` is called with the bytes (of ``a``) compared so far.

    Returns the tensors missing in ``b``, those missing in ``a`` (each by key), then the
    differences of common keys in key order, then those of plain values; an empty list means
    identical. Raises the readers' errors (CheckpointNotFoundError, IntegrityError, ...).
    """
    ra = open_checkpoint(a, storage_options, allow_pickle=allow_pickle)
    rb = open_checkpoint(b, storage_options, allow_pickle=allow_pickle)
    keys_a, keys_b = set(ra.keys()), set(rb.keys())
    out = [Difference(k, "missing_in_b", "tensor") for k in sorted(keys_a - keys_b)]
    out += [Difference(k, "missing_in_a", "tensor") for k in sorted(keys_b - keys_a)]
    common = sorted(keys_a & keys_b)
    total = sum(ra.nbytes(k) for k in common)
    done = 0
    for key in common:
        if ra.dtype(key) != rb.dtype(key):
            out.append(Difference(key, "dtype", f"{dtype_to_str(ra.dtype(key))} vs {dtype_to_str(rb.dtype(key))}"))
            continue
        if ra.shape(key) != rb.shape(key):
            out.append(Difference(key, "shape", f"{list(ra.shape(key))} vs {list(rb.shape(key))}"))
            continue
        xa, xb = ra.read(key), rb.read(key)
        done += ra.nbytes(key)
        if progress:
            progress(done, total)
        if xa.numel() == 0:
            continue
        n, first = _first_difference(xa, xb)
        if n == 0:
            continue
        try:
            diff = _max_abs_diff(xa, xb)
        except (RuntimeError, TypeError):  # dtypes without a float conversion
            diff = float("nan")
        if not (atol > 0 and diff <= atol):
            shown = str(diff) if isinstance(diff, int) else f"{diff:.6g}"
            detail = (f"max |a-b| = {shown}, {n} of {xa.numel()} elements differ, "
                      f"first at {first}: {_item(xa, first)} vs {_item(xb, first)}")
            out.append(Difference(key, "values", detail, None if math.isnan(diff) else diff, n, first))
    obj_a, obj_b = ra.objects(), rb.objects()
    for key in sorted(set(obj_a) | set(obj_b)):
        if obj_a.get(key) != obj_b.get(key):
            kind = "missing_in_b" if key not in obj_b else "missing_in_a" if key not in obj_a else "object"
            out.append(Difference(key, kind, f"{str(obj_a.get(key))[:60]} vs {str(obj_b.get(key))[:60]}"))
    return out


def _item(x: torch.Tensor, index: list[int]) -> str:
    """The element at ``index``; its raw bits in hex for dtypes torch cannot turn into a Python
    number (``float4_e2m1fn_x2``)."""
    v = x[tuple(index)] if index else x
    try:
        return repr(v.item())
    except (RuntimeError, TypeError):
        return "0x" + bytes(v.reshape(1).view(torch.uint8).tolist()[::-1]).hex()
