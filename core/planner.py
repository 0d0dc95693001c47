"""Save planning: who writes which chunk, where, and from which bytes. Pure functions, testable
without a process group.

Each rank describes what it holds in a compact :class:`LocalPlan`; every rank gathers all of them
and runs :func:`make_global_plan`, which is deterministic, so all ranks reach the same plan with
one collective. Replicas (the same fqn and the same box or flat range on several ranks: data
parallel copies, replicated tensors, DTensor ``Replicate`` dims) are written once; each unique chunk
goes to the holder with the fewest bytes assigned so far (largest chunks first), which balances
replicated bytes over their holders instead of piling them on rank 0 (the imbalance reported in
pytorch/pytorch#125740). Chunks with a single holder are counted first, and replicated boxes of
at least :data:`SPLIT_MIN_BYTES` are split into blocks across their holders (along the outermost
dimension long enough to give every holder a part).

:func:`make_save_plan` turns the global plan into what each rank executes (:class:`SavePlan`): its
chunks in file order (data files ``data/<rank>_<n>.bin`` of at most ``segment_bytes``, chunks packed
back to back as format v1 stores them), where each chunk's bytes come from (:class:`LocalFill`,
or :class:`RecvFill` for merged flat ranges, see :mod:`unickpt.merging`), and the matching sends.
The engine caches it per layout.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .codec import dtype_to_str, str_to_dtype
from .errors import StateMismatchError
from .hashwrite import GRANULE_BYTES, stream_layout
from .merging import P2P, merge_ranges
from .resharding import Box, ChunkSpec, FlatRange, check_exact_cover
from .state import FlatState

__all__ = ["LocalPlan", "PlannedChunk", "GlobalPlan", "make_local_plan", "make_global_plan", "SPLIT_MIN_BYTES",
           "LocalFill", "RecvFill", "SendOp", "WriteChunk", "SavePlan", "make_save_plan"]

SPLIT_MIN_BYTES = 1 << 20
"""A replicated box of at least this many bytes is split along dim 0 into one part per holder, so
that one large replicated tensor does not make a single rank write much more than the others."""


def _spec_key(spec: ChunkSpec) -> tuple:
    return (0, spec.offsets, spec.lengths) if isinstance(spec, Box) else (1, (spec.start,), (spec.length,))


def _split_replica(spec: ChunkSpec, nbytes: int, holders: int) -> list[tuple[int, ChunkSpec]]:
    """``[(bytes, part)]``: the chunk whole, or, when it is a large replicated box, split into
    ``holders`` blocks along its outermost dimension of length >= ``holders`` (or its longest one)."""
    if not isinstance(spec, Box) or not spec.lengths or nbytes < SPLIT_MIN_BYTES or max(spec.lengths) < 2:
        return [(nbytes, spec)]
    dim = next((d for d, n in enumerate(spec.lengths) if n >= holders),
               max(range(len(spec.lengths)), key=lambda d: spec.lengths[d]))
    length = spec.lengths[dim]
    parts = min(holders, length)
    slab_bytes = nbytes // length
    out, start = [], 0
    for i in range(parts):
        n = length // parts + (1 if i < length % parts else 0)
        offsets = spec.offsets[:dim] + (spec.offsets[dim] + start,) + spec.offsets[dim + 1:]
        lengths = spec.lengths[:dim] + (n,) + spec.lengths[dim + 1:]
        out.append((n * slab_bytes, Box(offsets, lengths)))
        start += n
    return out


@dataclass
class LocalPlan:
    """What one rank holds: ``tensors[fqn] = (dtype, global shape, spec or None if empty)``."""

    rank: int
    tensors: dict[str, tuple[str, tuple[int, ...], ChunkSpec | None]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    per_rank_fqns: tuple[str, ...] = ()
    error: str | None = None  # set instead of the rest when this rank failed before planning (traceback)
    error_type: str | None = None
    error_message: str | None = None
    objects_digest: str | None = None  # digest of the plain-value keys (only group rank 0's are saved)
    guarded: tuple[str, ...] = ()  # fqns staged after save() returns (overlap snapshots): written last

    def signature(self) -> str:
        """A digest of everything the global plan depends on (not the rank: plans are gathered in order)."""
        text = repr((sorted(self.tensors.items()), sorted(self.aliases.items()), self.per_rank_fqns, self.guarded))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class PlannedChunk:
    fqn: str
    spec: ChunkSpec
    nbytes: int
    writer: int


@dataclass
class GlobalPlan:
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # fqn -> (dtype, global shape)
    chunks: list[PlannedChunk]
    aliases: dict[str, str]

    def writes_for(self, rank: int) -> list[PlannedChunk]:
        return [c for c in self.chunks if c.writer == rank]

    def bytes_per_rank(self, world_size: int) -> list[int]:
        out = [0] * world_size
        for c in self.chunks:
            out[c.writer] += c.nbytes
        return out


def make_local_plan(flat: FlatState, rank: int, guarded: frozenset | set = frozenset()) -> LocalPlan:
    """This rank's holdings; ``guarded`` fqns (overlap snapshots) are placed last in its files."""
    plan = LocalPlan(rank=rank, aliases=dict(flat.aliases), per_rank_fqns=tuple(sorted(flat.per_rank)),
                     guarded=tuple(sorted(guarded)))
    for fqn, leaf in flat.tensors.items():
        if fqn in flat.aliases:
            continue
        spec = leaf.spec if leaf.spec.numel > 0 else None
        plan.tensors[fqn] = (dtype_to_str(leaf.dtype), leaf.global_shape, spec)
    return plan


def make_global_plan(plans: list[LocalPlan]) -> GlobalPlan:
    """Deduplicate replicas, assign writers, and check that the shards tile every tensor.

    Raises StateMismatchError when ranks disagree on a tensor's dtype or global shape, and
    ValueError when the shards of a tensor overlap without being identical or leave a gap.
    """
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    first_rank: dict[str, int] = {}
    holders: dict[tuple[str, ChunkSpec], list[int]] = {}
    aliases: dict[str, str] = {}
    for plan in sorted(plans, key=lambda p: p.rank):
        for fqn, target in plan.aliases.items():
            if aliases.setdefault(fqn, target) != target:
                raise StateMismatchError(f"{fqn!r}: rank {plan.rank} ties it to {target!r}, another rank to {aliases[fqn]!r}")
        for fqn, (dtype, shape, spec) in plan.tensors.items():
            if fqn not in tensors:
                tensors[fqn], first_rank[fqn] = (dtype, tuple(shape)), plan.rank
            elif tensors[fqn] != (dtype, tuple(shape)):
                want = tensors[fqn]
                raise StateMismatchError(
                    f"{fqn!r}: rank {first_rank[fqn]} has dtype {want[0]} shape {list(want[1])}, "
                    f"rank {plan.rank} has dtype {dtype} shape {list(shape)}"
                )
            if spec is not None:
                holders.setdefault((fqn, spec), []).append(plan.rank)
    for fqn in aliases:
        tensors.pop(fqn, None)
    unique = [(fqn, spec, ranks) for (fqn, spec), ranks in holders.items() if fqn not in aliases]
    by_fqn: dict[str, list[ChunkSpec]] = {fqn: [] for fqn in tensors}
    for fqn, spec, _ in unique:
        by_fqn[fqn].append(spec)
    for fqn, specs in by_fqn.items():
        check_exact_cover(fqn, tensors[fqn][1], specs)

    load: dict[int, int] = {}
    chunks: list[PlannedChunk] = []
    replicated = []
    for fqn, spec, ranks in unique:
        nbytes = spec.numel * str_to_dtype(tensors[fqn][0]).itemsize
        if len(ranks) == 1:  # fixed writer: count these first so replicas go to the least-loaded holders
            load[ranks[0]] = load.get(ranks[0], 0) + nbytes
            chunks.append(PlannedChunk(fqn, spec, nbytes, ranks[0]))
        else:
            replicated += [(n, fqn, part, ranks) for n, part in _split_replica(spec, nbytes, len(ranks))]
    replicated.sort(key=lambda s: (-s[0], s[1], _spec_key(s[2])))
    for nbytes, fqn, spec, ranks in replicated:
        writer = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[writer] = load.get(writer, 0) + nbytes
        chunks.append(PlannedChunk(fqn, spec, nbytes, writer))
    return GlobalPlan(tensors, chunks, aliases)


# ------------------------------------------------------------------------------------------------ #
# Execution plan: files, offsets, fills, sends
# ------------------------------------------------------------------------------------------------ #
@dataclass(frozen=True)
class LocalFill:
    """Chunk bytes ``[byte_start, byte_start + nbytes)`` are this rank's leaf's bytes from ``src_byte``
    on, in row-major order, of its local tensor narrowed to ``view`` (a box relative to the local
    tensor; None: the whole local tensor)."""

    byte_start: int
    nbytes: int
    view: Box | None
    src_byte: int


@dataclass(frozen=True)
class RecvFill:
    """Chunk bytes ``[byte_start, byte_start + nbytes)`` arrive from rank ``src`` (message ``index``)."""

    byte_start: int
    nbytes: int
    src: int
    index: int


@dataclass(frozen=True)
class SendOp:
    """Send bytes ``[src_byte, src_byte + nbytes)`` of this rank's leaf ``fqn`` to ``dst`` (message ``index``)."""

    fqn: str
    src_byte: int
    nbytes: int
    dst: int
    index: int


@dataclass(frozen=True)
class WriteChunk:
    """A chunk a rank writes: ``spec`` of ``fqn``, at ``offset`` in data file ``file`` (segment
    ``segment`` of the rank), whose bytes come from ``fills`` in order."""

    fqn: str
    spec: ChunkSpec
    nbytes: int
    file: str
    segment: int
    offset: int
    fills: tuple


@dataclass
class SavePlan:
    """Everything every rank executes for one layout (cached by the engine).

    ``writes[r]``: rank ``r``'s chunks in file order; ``segments[r]``: its data files
    ``(relative path, bytes)``; ``sends[r]``: merge transfers it sends; ``bytes_per_rank[r]``:
    bytes it writes.
    """

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    aliases: dict[str, str]
    writes: list[list[WriteChunk]]
    segments: list[list[tuple[str, int]]]
    sends: list[list[SendOp]]
    bytes_per_rank: list[int]
    per_rank_fqns: tuple[str, ...] = ()
    merged_tensors: int = 0
    transfers: int = 0
    transfer_bytes: int = 0

    @property
    def max_mean_bytes(self) -> float:
        """Largest bytes written by one rank over the mean (1.0 is perfect balance)."""
        mean = sum(self.bytes_per_rank) / max(1, len(self.bytes_per_rank))
        return max(self.bytes_per_rank) / mean if mean else 1.0


def _relative_view(leaf_spec: ChunkSpec | None, spec: ChunkSpec) -> Box | None:
    if spec == leaf_spec or not isinstance(spec, Box):
        return None
    assert isinstance(leaf_spec, Box)
    return Box(tuple(o - lo for o, lo in zip(spec.offsets, leaf_spec.offsets)), spec.lengths)


def make_save_plan(plans: list[LocalPlan], *, flat_ranges: str = "store", segment_bytes: int = 1 << 30) -> SavePlan:
    """The global plan plus each rank's files, offsets, fills and sends (deterministic).

    Args:
        flat_ranges: ``"store"`` keeps flat-range chunks as they are; ``"merge"`` turns tensors
            stored entirely as flat ranges into regular boxes (:func:`unickpt.merging.merge_ranges`).
        segment_bytes: a rank starts a new data file when the current one would grow past this
            (a larger chunk gets a file of its own).

    Raises what :func:`make_global_plan` raises, and ValueError for an unknown ``flat_ranges``.
    """
    if flat_ranges not in ("store", "merge"):
        raise ValueError(f"flat_ranges must be 'store' or 'merge', got {flat_ranges!r}")
    gp = make_global_plan(plans)
    world = max((p.rank for p in plans), default=0) + 1
    leaf_spec = {(p.rank, fqn): t[2] for p in plans for fqn, t in p.tensors.items()}
    guarded = {(p.rank, fqn) for p in plans for fqn in p.guarded}
    # (fqn, spec, nbytes, parts) per writer; parts = (byte_start, nbytes, src, src_byte, view)
    todo: list[list[tuple]] = [[] for _ in range(world)]
    merged: list[list[tuple]] = [[] for _ in range(world)]
    by_fqn: dict[str, list[PlannedChunk]] = {}
    for c in gp.chunks:
        by_fqn.setdefault(c.fqn, []).append(c)
    merged_tensors = 0
    for fqn in sorted(by_fqn):
        chunks = by_fqn[fqn]
        dtype, shape = gp.tensors[fqn]
        itemsize = str_to_dtype(dtype).itemsize
        if flat_ranges == "merge" and all(isinstance(c.spec, FlatRange) for c in chunks):
            merged_tensors += 1
            for m in merge_ranges(shape, itemsize, [(c.spec.start, c.spec.length, c.writer) for c in chunks]):
                parts = tuple((b, n, src, sb, None) for b, n, src, sb in m.parts)
                merged[m.writer].append((fqn, m.spec, m.nbytes, parts))
            continue
        for c in sorted(chunks, key=lambda c: _spec_key(c.spec)):
            view = _relative_view(leaf_spec[(c.writer, fqn)], c.spec)
            todo[c.writer].append((fqn, c.spec, c.nbytes, ((0, c.nbytes, c.writer, 0, view),)))

    writes: list[list[WriteChunk]] = []
    segments: list[list[tuple[str, int]]] = []
    for r in range(world):
        chunks, segs, seg_size = [], [], 0
        # file order: what is staged before save() returns, then guarded tensors (overlap snapshots);
        # merged chunks last within each, so their receives have the most time to arrive
        items = todo[r] + merged[r]
        order = sorted(range(len(items)), key=lambda i: ((r, items[i][0]) in guarded, i >= len(todo[r]), i))
        for fqn, spec, nbytes, parts in (items[i] for i in order):
            if not segs or (seg_size and seg_size + nbytes > segment_bytes):
                segs.append(f"data/{r}_{len(segs)}.bin")
                seg_size = 0
            chunks.append((fqn, spec, nbytes, len(segs) - 1, seg_size, parts))
            seg_size += nbytes
        sizes = [0] * len(segs)
        for _, _, nbytes, seg, off, _ in chunks:
            sizes[seg] = max(sizes[seg], off + nbytes)
        bases, _ = stream_layout(sizes)
        rank_writes = []
        for fqn, spec, nbytes, seg, off, parts in chunks:
            rank_writes.append((fqn, spec, nbytes, seg, off, bases[seg] + off, parts))
        writes.append(rank_writes)  # type: ignore[arg-type]
        segments.append(list(zip(segs, sizes)))

    # fills and sends: received parts are cut where the receiver's stream crosses a granule boundary
    # (so that a receive never straddles the ring's wrap), numbered in one global order
    sends: list[list[SendOp]] = [[] for _ in range(world)]
    final: list[list[WriteChunk]] = []
    index = transfers_bytes = 0
    for r in range(world):
        out = []
        for fqn, spec, nbytes, seg, off, stream_pos, parts in writes[r]:
            fills: list = []
            for b, n, src, sb, view in parts:
                if src == r:
                    fills.append(LocalFill(b, n, view, sb))
                    continue
                pos, end = stream_pos + b, stream_pos + b + n
                while pos < end:
                    stop = min(end, (pos // GRANULE_BYTES + 1) * GRANULE_BYTES)
                    k = stop - pos
                    fills.append(RecvFill(pos - stream_pos, k, src, index))
                    sends[src].append(SendOp(fqn, sb + (pos - stream_pos - b), k, r, index))
                    P2P.tag(0, index)  # raises if there are too many transfers
                    index += 1
                    transfers_bytes += k
                    pos = stop
            out.append(WriteChunk(fqn, spec, nbytes, segments[r][seg][0], seg, off, tuple(fills)))
        final.append(out)
    bytes_per_rank = [sum(c.nbytes for c in w) for w in final]
    per_rank_fqns = tuple(sorted({f for p in plans for f in p.per_rank_fqns}))
    return SavePlan(gp.tensors, gp.aliases, final, segments, sends, bytes_per_rank, per_rank_fqns, merged_tensors,
                    index, transfers_bytes)
