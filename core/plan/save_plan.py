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
dimension long enough to give every holder a part; no part under 1/4 of the mean bytes per rank,
:data:`SPLIT_PARTS_PER_MEAN`, so chunks stay proportional to the unique data, not to the ranks).
Ranks with identical plans (replicas) are planned once and the least-loaded holder comes from a
heap: the plan is near-linear in the entries of the distinct plans (docs/scale.md).

:func:`make_save_plan` turns the global plan into what each rank executes (:class:`SavePlan`): its
chunks in file order (data files ``data/<rank>_<n>.bin`` of at most ``segment_bytes``, chunks packed
back to back as format v1 stores them), where each chunk's bytes come from (:class:`LocalFill`,
or :class:`RecvFill` for merged flat ranges, see :mod:`unickpt.merging`), and the matching sends.
The engine caches it per layout.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .._util import gc_paused
from ..dist.p2p import TAG_BITS
from ..errors import StateMismatchError
from ..format.dtypes import dtype_to_str, str_to_dtype
from ..format.layout import data_file
from ..geometry import Box, ChunkSpec, FlatRange, check_exact_cover
from ..state.flat import FlatState
from .balance import LeastLoaded
from .merge import merge_ranges
from .stream import GRANULE_BYTES, stream_layout

__all__ = ["LocalPlan", "PlannedChunk", "GlobalPlan", "make_local_plan", "make_global_plan", "expand_plans", "decode_plans", "SPLIT_MIN_BYTES",
           "LocalFill", "RecvFill", "SendOp", "WriteChunk", "SavePlan", "make_save_plan"]

SPLIT_MIN_BYTES = 1 << 20
"""A replicated box of at least this many bytes is split along dim 0 into one part per holder, so
that one large replicated tensor does not make a single rank write much more than the others."""


SPLIT_PARTS_PER_MEAN = 4
"""Parts of a split replicated box are at least the mean bytes per rank over this: the greedy writer
choice then stays within about 1/4 of the mean above it, and a save has at most 4 x ranks more chunks
than unique boxes (each costs a metadata entry, with up to 64 block checksums). Chosen on the 405B
simulations of benchmarks/plan_sim.py at 10,000 ranks: 2 leaves TP x PP x DP at 1.5 x the mean bytes
per rank, 8 adds 15-70% more metadata than 4 for no better balance (docs/scale.md)."""


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

    def table_digest(self) -> str:
        """A digest of the tensor table: fqns, dtypes and global shapes in order, not the specs
        (ranks of one pipeline stage share it while their shards differ)."""
        text = repr([(f, d, tuple(shape)) for f, (d, shape, _) in self.tensors.items()])
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def to_bytes(self, with_table: bool = True) -> bytes:
        """Compact JSON encoding (no pickle), what the engine gathers: per tensor ``[fqn, dtype, shape,
        spec]`` with spec ``null``, ``[offsets, lengths]`` (box) or ``[start, length, 0]`` (flat range:
        three numbers, a box has two lists). ``with_table=False``: the specs only, in table order,
        with the table's digest; :meth:`from_bytes` then needs a plan with that table."""
        def spec(s: ChunkSpec | None) -> Any:
            if s is None:
                return None
            return [list(s.offsets), list(s.lengths)] if isinstance(s, Box) else [s.start, s.length, 0]

        doc: dict[str, Any] = {"r": self.rank, "a": self.aliases, "p": list(self.per_rank_fqns),
                               "g": list(self.guarded), "o": self.objects_digest}
        if with_table:
            doc["t"] = [[f, d, list(shape), spec(s)] for f, (d, shape, s) in self.tensors.items()]
        else:
            doc["k"], doc["s"] = self.table_digest(), [spec(s) for _, _, s in self.tensors.values()]
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, table: "LocalPlan | None" = None) -> "LocalPlan":
        """Inverse of :meth:`to_bytes`; an encoding without its table takes the fqns, dtypes and shapes
        from ``table`` (a plan whose :meth:`table_digest` it names). Raises ValueError for malformed
        input or a missing or different table."""
        def spec(s: Any) -> ChunkSpec | None:
            if s is None:
                return None
            return Box(tuple(s[0]), tuple(s[1])) if len(s) == 2 else FlatRange(int(s[0]), int(s[1]))

        try:
            doc = json.loads(data)
            tensors: dict = {}
            if "t" in doc:
                for f, d, shape, s in doc["t"]:
                    tensors[f] = (d, tuple(shape), spec(s))
            else:
                if table is None or table.table_digest() != doc["k"] or len(table.tensors) != len(doc["s"]):
                    raise ValueError(f"rank {doc.get('r')}'s plan names tensor table {doc.get('k')!r}, which was not "
                                     "received")
                for (f, (d, shape, _)), s in zip(table.tensors.items(), doc["s"]):
                    tensors[f] = (d, shape, spec(s))
            return cls(rank=int(doc["r"]), tensors=tensors, aliases=dict(doc["a"]), per_rank_fqns=tuple(doc["p"]),
                       guarded=tuple(doc["g"]), objects_digest=doc["o"])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"malformed local plan ({type(e).__name__}: {e})") from e

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
    replicas: list[tuple[str, ChunkSpec, tuple[int, ...]]] = field(default_factory=list)  # (fqn, spec, holders)
    # of every chunk held by several ranks, in the same order on every rank (unickpt.replicas checks them)

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


def expand_plans(gathered: list[LocalPlan | None], firsts: list[int]) -> list[LocalPlan]:
    """Every rank's plan from the plans of the ranks that sent one: rank ``r`` with ``firsts[r] != r``
    sent nothing (its plan signature equals rank ``firsts[r]``'s, e.g. a data-parallel replica) and
    gets that rank's plan under its own rank. Such ranks share one ``tensors`` dict, which
    :func:`make_global_plan` processes once for all of them. Raises ValueError when a rank that
    should have sent its plan did not."""
    out: list[LocalPlan] = []
    for r, first in enumerate(firsts):
        src = gathered[first]
        if src is None:
            raise ValueError(f"rank {first} sent no plan, but rank {r} expects its plan")
        out.append(src if first == r else
                   LocalPlan(rank=r, tensors=src.tensors, aliases=src.aliases, per_rank_fqns=src.per_rank_fqns,
                             objects_digest=src.objects_digest, guarded=src.guarded))
    return out


def decode_plans(blobs: list[bytes], firsts: list[int], table_firsts: list[int] | None = None) -> list[LocalPlan]:
    """Every rank's plan from the gathered :meth:`LocalPlan.to_bytes` encodings: ``b""`` from a rank
    whose plan repeats rank ``firsts[r]``'s (see :func:`expand_plans`), the specs only from a rank
    whose tensor table (:meth:`LocalPlan.table_digest`) repeats rank ``table_firsts[r]``'s (that rank
    sent its table). Raises ValueError for a malformed or missing plan."""
    table_firsts = table_firsts or list(range(len(blobs)))
    decoded: list[LocalPlan | None] = [None] * len(blobs)
    with gc_paused():
        for r, b in enumerate(blobs):
            if firsts[r] == r:
                t = table_firsts[r]
                decoded[r] = LocalPlan.from_bytes(b, None if t == r else decoded[t])
        return expand_plans(decoded, firsts)


def _part_count(nbytes: int, holders: int, part_bytes: float) -> int:
    """How many parts a replicated chunk of ``nbytes`` is split into: one per holder, but no part
    smaller than ``part_bytes`` (so the number of chunks stays proportional to the world size and
    the unique bytes, not to ranks x replicated tensors); 1 below :data:`SPLIT_MIN_BYTES`."""
    if nbytes < SPLIT_MIN_BYTES or holders < 2:
        return 1
    return max(1, min(holders, int(nbytes // max(1.0, part_bytes))))


def make_global_plan(plans: list[LocalPlan]) -> GlobalPlan:
    """Deduplicate replicas, assign writers, and check that the shards tile every tensor.

    Cost: linear in the entries of the distinct plans (ranks sharing one ``tensors`` dict, see
    :func:`expand_plans`, count once) plus O(log ranks) per written chunk; a replicated chunk of
    ``>= SPLIT_MIN_BYTES`` is split into at most ``min(holders, nbytes / (mean bytes per rank / 4))``
    parts (:data:`SPLIT_PARTS_PER_MEAN`), so the chunk count grows with the world size only where the
    data needs it for balance.

    Raises StateMismatchError when ranks disagree on a tensor's dtype or global shape, and
    ValueError when the shards of a tensor overlap without being identical or leave a gap.
    """
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    first_rank: dict[str, int] = {}
    holders: dict[tuple[str, ChunkSpec], list[tuple[int, ...]]] = {}
    aliases: dict[str, str] = {}
    groups: dict[int, list[LocalPlan]] = {}  # ranks sharing one tensors dict: processed once
    for plan in sorted(plans, key=lambda p: p.rank):
        groups.setdefault(id(plan.tensors), []).append(plan)
    for members in sorted(groups.values(), key=lambda m: m[0].rank):
        plan = members[0]
        ranks = tuple(p.rank for p in members)
        for p in members:
            for fqn, target in p.aliases.items():
                if aliases.setdefault(fqn, target) != target:
                    raise StateMismatchError(f"{fqn!r}: rank {p.rank} ties it to {target!r}, another rank to {aliases[fqn]!r}")
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
                holders.setdefault((fqn, spec), []).append(ranks)
    for fqn in aliases:
        tensors.pop(fqn, None)
    unique = [(fqn, spec, sorted(r for rs in groups_ for r in rs) if len(groups_) > 1 else groups_[0])
              for (fqn, spec), groups_ in holders.items() if fqn not in aliases]
    by_fqn: dict[str, list[ChunkSpec]] = {fqn: [] for fqn in tensors}
    for fqn, spec, _ in unique:
        by_fqn[fqn].append(spec)
    for fqn, specs in by_fqn.items():
        check_exact_cover(fqn, tensors[fqn][1], specs)

    itemsize = {dt: str_to_dtype(dt).itemsize for dt in {d for d, _ in tensors.values()}}
    load: dict[int, int] = {}
    chunks: list[PlannedChunk] = []
    replicated = []
    total = 0
    for fqn, spec, ranks in unique:
        nbytes = spec.numel * itemsize[tensors[fqn][0]]
        total += nbytes
        if len(ranks) == 1:  # fixed writer: count these first so replicas go to the least-loaded holders
            load[ranks[0]] = load.get(ranks[0], 0) + nbytes
            chunks.append(PlannedChunk(fqn, spec, nbytes, ranks[0]))
        else:
            replicated.append((nbytes, fqn, spec, tuple(ranks)))
    world = max((p.rank for p in plans), default=0) + 1
    part_bytes = total / world / SPLIT_PARTS_PER_MEAN
    parts = []
    for nbytes, fqn, spec, ranks in replicated:
        count = _part_count(nbytes, len(ranks), part_bytes)
        if count == 1:
            parts.append((nbytes, fqn, spec, ranks))
        else:
            parts += [(n, fqn, part, ranks) for n, part in _split_replica(spec, nbytes, count)]
    parts.sort(key=lambda s: (-s[0], s[1], _spec_key(s[2])))
    pickers: dict[tuple[int, ...], LeastLoaded] = {}
    for nbytes, fqn, spec, ranks in parts:
        picker = pickers.get(ranks)
        if picker is None:
            picker = pickers[ranks] = LeastLoaded(ranks, load)
        writer = picker.pop_min()
        load[writer] = load.get(writer, 0) + nbytes
        picker.refresh(writer)
        chunks.append(PlannedChunk(fqn, spec, nbytes, writer))
    return GlobalPlan(tensors, chunks, aliases, [(fqn, spec, ranks) for _, fqn, spec, ranks in replicated])


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
    replicas: tuple = ()  # GlobalPlan.replicas

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
    with gc_paused():
        return _make_save_plan(plans, flat_ranges, segment_bytes)


def _make_save_plan(plans: list[LocalPlan], flat_ranges: str, segment_bytes: int) -> SavePlan:
    gp = make_global_plan(plans)
    world = max((p.rank for p in plans), default=0) + 1
    by_rank = {p.rank: p for p in plans}
    guarded_sets: dict[int, frozenset] = {}  # by id of the guarded tuple: ranks sharing a plan share it

    def is_guarded(r: int, fqn: str) -> bool:
        g = by_rank[r].guarded
        if not g:
            return False
        s = guarded_sets.get(id(g))
        if s is None:
            s = guarded_sets[id(g)] = frozenset(g)
        return fqn in s

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
            view = _relative_view(by_rank[c.writer].tensors[fqn][2], c.spec)
            todo[c.writer].append((fqn, c.spec, c.nbytes, ((0, c.nbytes, c.writer, 0, view),)))

    writes: list[list[WriteChunk]] = []
    segments: list[list[tuple[str, int]]] = []
    for r in range(world):
        chunks, segs, seg_size = [], [], 0
        # file order: what is staged before save() returns, then guarded tensors (overlap snapshots);
        # merged chunks last within each, so their receives have the most time to arrive
        items = todo[r] + merged[r]
        order = sorted(range(len(items)), key=lambda i: (is_guarded(r, items[i][0]), i >= len(todo[r]), i))
        for fqn, spec, nbytes, parts in (items[i] for i in order):
            if not segs or (seg_size and seg_size + nbytes > segment_bytes):
                segs.append(data_file(r, len(segs)))
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
                    if index >= 1 << TAG_BITS:  # a transfer's tag holds its index below the save's number
                        raise ValueError(f"too many merge transfers in one save ({index})")
                    index += 1
                    transfers_bytes += k
                    pos = stop
            out.append(WriteChunk(fqn, spec, nbytes, segments[r][seg][0], seg, off, tuple(fills)))
        final.append(out)
    bytes_per_rank = [sum(c.nbytes for c in w) for w in final]
    per_rank_fqns = tuple(sorted({f for fqns in {id(p.per_rank_fqns): p.per_rank_fqns for p in plans}.values()
                                  for f in fqns}))
    return SavePlan(gp.tensors, gp.aliases, final, segments, sends, bytes_per_rank, per_rank_fqns, merged_tensors,
                    index, transfers_bytes, tuple(gp.replicas))
