"""Pure chunk geometry: boxes, flat ranges, their intersection and the byte runs to read.

A tensor of global shape ``S`` is stored as *chunks*. A chunk is either an N-d box
(``offsets``, ``lengths``) whose elements are stored row-major, or a contiguous range of the
row-major flattened tensor (an *irregular* or *flat* shard, as FSDP1 flat parameters, DeepSpeed
ZeRO partitions and Megatron's distributed optimizer produce). Any flat range decomposes into at
most ``2 * ndim - 1`` boxes (*pieces*), each contiguous in storage, so all resharding reduces to
box-box intersection (ByteCheckpoint's load-time resharding, NSDI '25, reduces to
it the same way). No process group, no I/O, no torch: everything here is unit-testable, and every
layer uses it (the state's shards, the format's chunks, the save and read plans, the load's copies).
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

__all__ = [
    "Box",
    "FlatRange",
    "ChunkSpec",
    "EvenSplit",
    "SplitIndex",
    "ChunkIndex",
    "ContiguousBox",
    "chunk_pieces",
    "chunk_numel",
    "intersect",
    "row_major_strides",
    "byte_runs",
    "spec_to_json",
    "spec_from_json",
    "check_exact_cover",
]


@dataclass(frozen=True)
class Box:
    """An N-d box of a global tensor: element ``offsets`` and ``lengths`` per dimension."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


@dataclass(frozen=True)
class FlatRange:
    """Elements ``[start, start + length)`` of the row-major flattened global tensor."""

    start: int
    length: int

    @property
    def numel(self) -> int:
        return self.length


ChunkSpec = Box | FlatRange


@dataclass(frozen=True)
class EvenSplit:
    """A tensor cut into ``parts`` along ``dim`` the way ``torch.chunk`` cuts it (FSDP2's and
    DTensor ``Shard(dim)``'s semantics): with ``step = ceil(n / parts)`` for ``n = shape[dim]``, part
    ``k`` holds indices ``[k * step, min((k + 1) * step, n))`` of that dim and every other dim whole;
    trailing parts may be empty. Part ``k`` belongs to group rank ``k`` (format v2: its writer).
    One rule stands for ``parts`` chunks: a layout of ranks x tensors shards is described in
    O(tensors)."""

    dim: int
    parts: int

    def step(self, shape: Sequence[int]) -> int:
        """Indices of ``dim`` per (non-trailing) part."""
        return max(1, -(-shape[self.dim] // self.parts))

    def bounds(self, shape: Sequence[int], k: int) -> tuple[int, int]:
        """``(lo, hi)``: the indices of ``dim`` part ``k`` holds (``lo == hi``: empty)."""
        n, step = shape[self.dim], self.step(shape)
        lo = min(k * step, n)
        return lo, min(lo + step, n)

    def part(self, shape: Sequence[int], k: int) -> Box | None:
        """The box of part ``k`` (None when it is empty)."""
        lo, hi = self.bounds(shape, k)
        if hi <= lo or 0 in shape:
            return None
        d = self.dim
        return Box((0,) * d + (lo,) + (0,) * (len(shape) - d - 1), tuple(shape[:d]) + (hi - lo,) + tuple(shape[d + 1:]))

    def nonempty(self, shape: Sequence[int]) -> int:
        """How many parts are not empty (they are the first ones)."""
        return 0 if 0 in shape else -(-shape[self.dim] // self.step(shape))

    def parts_between(self, shape: Sequence[int], lo: int, hi: int) -> range:
        """The non-empty parts holding any index of ``[lo, hi)`` along ``dim``."""
        if hi <= lo:
            return range(0)
        step = self.step(shape)
        return range(lo // step, min(self.nonempty(shape), -(-hi // step)))

    @staticmethod
    def detect(shape: Sequence[int], spec: "ChunkSpec | None", rank: int, world: int) -> "EvenSplit | None":
        """The split along the first dim for which ``spec`` is exactly part ``rank`` of
        ``EvenSplit(dim, world)`` (a non-empty box), or None (also for ``spec`` None, ``world < 2``,
        0-d and empty tensors, flat ranges). Every rank of an FSDP2 / ``Shard(dim)`` layout over the
        whole group finds the same rule (a rank whose part is empty holds nothing and declares
        nothing), so their local plans are equal (the basis of format v2's compact metadata).
        Returns one object per value."""
        if spec is None or world < 2 or not shape or 0 in shape or isinstance(spec, FlatRange):
            return None
        for d in range(len(shape)):
            split = EvenSplit.of(d, world)
            if split.part(shape, rank) == spec:
                return split
        return None

    @staticmethod
    def of(dim: int, parts: int) -> "EvenSplit":
        """``EvenSplit(dim, parts)``, one object per value (planners compare them by identity first)."""
        split = _SPLITS.get((dim, parts))
        if split is None:
            split = _SPLITS[(dim, parts)] = EvenSplit(dim, parts)
        return split


_SPLITS: dict[tuple[int, int], EvenSplit] = {}


class SplitIndex:
    """:class:`ChunkIndex` for a tensor stored as the parts of an :class:`EvenSplit`: the parts a
    box overlaps by arithmetic, O(parts found); results name parts by their number."""

    def __init__(self, global_shape: Sequence[int], split: EvenSplit):
        self.shape, self.split = tuple(global_shape), split

    def overlapping(self, box: Box) -> list[tuple[int, "ContiguousBox", Box]]:
        d = self.split.dim
        out = []
        for k in self.split.parts_between(self.shape, box.offsets[d], box.offsets[d] + box.lengths[d]):
            part = self.split.part(self.shape, k)
            inter = intersect(box, part) if part is not None else None
            if part is not None and inter is not None:
                out.append((k, ContiguousBox(part, 0), inter))
        return out


@dataclass(frozen=True)
class ContiguousBox:
    """A box that is contiguous (row-major) in a chunk's storage, starting at element ``elem_offset``."""

    box: Box
    elem_offset: int


def chunk_numel(spec: ChunkSpec) -> int:
    return spec.numel


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _flat_boxes(shape: tuple[int, ...], start: int, end: int, dim: int, prefix: tuple[int, ...]) -> Iterator[Box]:
    """Boxes (in row-major order) covering flat elements ``[start, end)`` of the sub-tensor at ``prefix``."""
    if start >= end:
        return
    rest = shape[dim + 1 :]
    if dim == len(shape) - 1:
        yield Box(prefix + (start,), (1,) * len(prefix) + (end - start,))
        return
    inner = math.prod(rest)
    first, last = start // inner, (end - 1) // inner
    if first == last:
        yield from _flat_boxes(shape, start - first * inner, end - first * inner, dim + 1, prefix + (first,))
        return
    if start % inner:
        yield from _flat_boxes(shape, start % inner, inner, dim + 1, prefix + (first,))
        first += 1
    full_last = last if end % inner == 0 else last - 1
    if first <= full_last:
        yield Box(prefix + (first,) + (0,) * len(rest), (1,) * len(prefix) + (full_last - first + 1,) + rest)
    if end % inner:
        yield from _flat_boxes(shape, 0, end % inner, dim + 1, prefix + (last,))


def chunk_pieces(spec: ChunkSpec, global_shape: Sequence[int]) -> list[ContiguousBox]:
    """Split a chunk into storage-contiguous boxes.

    A box chunk is one piece. A flat range of a tensor with ``ndim`` dims gives at most
    ``2 * ndim - 1`` pieces; their ``elem_offset`` is the element offset inside the chunk.
    A 0-d tensor is the box ``((), ())``. Empty chunks give no pieces.
    """
    shape = tuple(global_shape)
    if isinstance(spec, Box):
        return [ContiguousBox(spec, 0)] if spec.numel > 0 else []
    if spec.length <= 0:
        return []
    if not shape:
        return [ContiguousBox(Box((), ()), 0)]
    pieces, off = [], 0
    for box in _flat_boxes(shape, spec.start, spec.start + spec.length, 0, ()):
        pieces.append(ContiguousBox(box, off))
        off += box.numel
    return pieces


class ChunkIndex:
    """The storage-contiguous pieces (:func:`chunk_pieces`) of one tensor's chunks, sorted by their
    first index along dim 0, so that finding the pieces a box overlaps costs O(log n + k) for the
    usual layouts (chunks cut along dim 0, flat ranges) instead of a scan of every chunk; chunks
    that all span dim 0 (cut along an inner dim only) are scanned, k of them. Building costs
    O(n log n) for ``n`` pieces.

    Args:
        global_shape: the tensor's shape.
        specs: its chunks; results name them by their index in this list.
    """

    def __init__(self, global_shape: Sequence[int], specs: Sequence[ChunkSpec]):
        self.shape = tuple(global_shape)
        items = []
        for i, spec in enumerate(specs):
            for p in chunk_pieces(spec, self.shape):
                lo = p.box.offsets[0] if self.shape else 0
                items.append((lo, lo + (p.box.lengths[0] if self.shape else 1), i, p))
        items.sort(key=lambda x: (x[0], x[2], x[3].elem_offset))
        self._items = items
        self._starts = [x[0] for x in items]
        self._reach, top = [], -1  # the largest end among items[:j + 1]
        for x in items:
            top = max(top, x[1])
            self._reach.append(top)

    def overlapping(self, box: Box) -> list[tuple[int, ContiguousBox, Box]]:
        """``(chunk index, piece, intersection)`` for every piece that overlaps ``box`` (a box of the
        global tensor), ordered by chunk index, then position in the chunk."""
        if not self.shape:
            return [(i, p, p.box) for _, _, i, p in self._items]
        lo, hi = box.offsets[0], box.offsets[0] + box.lengths[0]
        j = bisect.bisect_left(self._starts, hi) - 1
        out = []
        while j >= 0 and self._reach[j] > lo:
            _, _, i, p = self._items[j]
            inter = intersect(box, p.box)
            if inter is not None:
                out.append((i, p, inter))
            j -= 1
        out.sort(key=lambda x: (x[0], x[1].elem_offset))
        return out


def intersect(a: Box, b: Box) -> Box | None:
    """The box where ``a`` and ``b`` overlap, or None if they do not (or the overlap is empty)."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return Box(tuple(offs), tuple(lens))


def byte_runs(piece: Box, sub: Box, itemsize: int) -> list[tuple[int, int]]:
    """Byte runs ``(start, length)`` (relative to the piece's first byte) holding ``sub``.

    ``piece`` is stored row-major; ``sub`` is a box inside it (global coordinates). Adjacent runs
    are merged, so a sub-box that spans whole trailing dimensions is a single run.
    """
    nd = len(piece.lengths)
    if nd == 0:
        return [(0, itemsize)]
    rel = [o - po for o, po in zip(sub.offsets, piece.offsets)]
    strides = row_major_strides(piece.lengths)
    # k: the outermost dim from which the sub-box is contiguous (all dims after k are full).
    k = nd - 1
    while k > 0 and sub.lengths[k] == piece.lengths[k]:
        k -= 1
    run_elems = sub.lengths[k] * strides[k]
    runs: list[tuple[int, int]] = []
    for idx in itertools.product(*(range(rel[d], rel[d] + sub.lengths[d]) for d in range(k))):
        start = sum(i * s for i, s in zip(idx, strides)) + rel[k] * strides[k]
        start_b, len_b = start * itemsize, run_elems * itemsize
        if runs and runs[-1][0] + runs[-1][1] == start_b:
            runs[-1] = (runs[-1][0], runs[-1][1] + len_b)
        else:
            runs.append((start_b, len_b))
    return runs


def spec_to_json(spec: ChunkSpec) -> dict:
    if isinstance(spec, Box):
        return {"offsets": list(spec.offsets), "lengths": list(spec.lengths)}
    return {"flat_start": spec.start, "flat_length": spec.length}


def spec_from_json(d: dict) -> ChunkSpec:
    if "flat_start" in d:
        return FlatRange(int(d["flat_start"]), int(d["flat_length"]))
    return Box(tuple(int(x) for x in d["offsets"]), tuple(int(x) for x in d["lengths"]))


def check_exact_cover(fqn: str, global_shape: Sequence[int], specs: Sequence[ChunkSpec], *,
                      partial: bool = False) -> None:
    """Raise ValueError unless ``specs`` tile the global tensor exactly (no gap, no overlap); with
    ``partial`` a gap is allowed (a part of a job-wide state: one rank's shards)."""
    shape = tuple(global_shape)
    total = math.prod(shape)
    for spec in specs:
        if isinstance(spec, Box):
            if len(spec.offsets) != len(shape) or any(
                o < 0 or l < 0 or o + l > n for o, l, n in zip(spec.offsets, spec.lengths, shape)
            ):
                raise ValueError(f"{fqn!r}: chunk {spec} lies outside the global shape {list(shape)}")
        elif spec.start < 0 or spec.length < 0 or spec.start + spec.length > total:
            raise ValueError(f"{fqn!r}: chunk {spec} lies outside the {total} elements of shape {list(shape)}")
    covered = sum(s.numel for s in specs)
    pieces = [p.box for s in specs for p in chunk_pieces(s, shape)]
    pieces.sort(key=lambda b: b.offsets)
    for i, a in enumerate(pieces):
        for b in pieces[i + 1 :]:
            if shape and b.offsets[0] >= a.offsets[0] + a.lengths[0]:
                break
            if intersect(a, b) is not None:
                raise ValueError(f"{fqn!r}: stored chunks overlap ({a} and {b}); replicas must have identical boxes")
    if covered != total and not partial:
        raise ValueError(
            f"{fqn!r}: the ranks' shards cover {covered} of {total} elements of shape {list(shape)}; "
            "every element must be held by at least one rank"
        )
