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
or :class:`RecvFill` for merged flat ranges, see :mod:`unickpt.plan.merge`), and the matching sends.
The engine caches it per layout.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from .._util import gc_paused
from ..dist.p2p import TAG_BITS
from ..errors import StateMismatchError
from ..format.dtypes import dtype_to_str, str_to_dtype
from ..format.files import data_file
from ..format.hf_shards import SAFETENSORS_DTYPES, header, index_json, shard_name
from ..geometry import Box, ChunkSpec, EvenSplit, FlatRange, byte_runs, check_exact_cover
from ..state.flat import FlatState
from .balance import LeastLoaded
from .merge import merge_ranges
from .stream import GRANULE_BYTES, stream_layout

__all__ = ["LocalPlan", "PlannedChunk", "GlobalPlan", "make_local_plan", "make_global_plan", "expand_plans", "decode_plans", "SPLIT_MIN_BYTES",
           "LocalFill", "RecvFill", "SendOp", "WriteChunk", "SavePlan", "make_save_plan", "split_bytes_per_rank"]

SPLIT_MIN_BYTES = 1 << 20
"""A replicated box of at least this many bytes is split along dim 0 into one part per holder, so
that one large replicated tensor does not make a single rank write much more than the others."""


SPLIT_PARTS_PER_MEAN = 4
"""Parts of a split replicated box are at least the mean bytes per rank over this: the greedy writer
choice then stays within about 1/4 of the mean above it, and a save has at most 4 x ranks more chunks
than unique boxes (each costs a metadata entry, with up to 64 block checksums). Chosen on the 405B
simulations of benchmarks/plan_sim.py at 10,000 ranks: 2 leaves TP x PP x DP at 1.5 x the mean bytes
per rank, 8 adds 15-70% more metadata than 4 for no better balance (docs/scale.md)."""


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
    out: list[tuple[int, ChunkSpec]] = []
    start = 0
    for i in range(parts):
        n = length // parts + (1 if i < length % parts else 0)
        offsets = spec.offsets[:dim] + (spec.offsets[dim] + start,) + spec.offsets[dim + 1:]
        lengths = spec.lengths[:dim] + (n,) + spec.lengths[dim + 1:]
        out.append((n * slab_bytes, Box(offsets, lengths)))
        start += n
    return out


@dataclass
class LocalPlan:
    """What one rank holds: ``tensors[fqn] = (dtype, global shape, spec)``; spec is a box or flat
    range, None if empty, or an :class:`~unickpt.geometry.EvenSplit` when the rank holds exactly its
    part of that split of the group (rank ``r`` holds part ``r``): every rank of an FSDP2 layout over
    the whole group then has the same plan, which is gathered and planned once."""

    rank: int
    tensors: dict[str, tuple[str, tuple[int, ...], ChunkSpec | EvenSplit | None]] = field(default_factory=dict)
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
        spec]`` with spec ``null``, ``[offsets, lengths]`` (box), ``[start, length, 0]`` (flat range:
        three numbers, a box has two lists) or ``["s", dim, parts]`` (even split).
        ``with_table=False``: the specs only, in table order,
        with the table's digest; :meth:`from_bytes` then needs a plan with that table."""
        def spec(s: ChunkSpec | EvenSplit | None) -> Any:
            if s is None:
                return None
            if isinstance(s, EvenSplit):
                return ["s", s.dim, s.parts]
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
        def spec(s: Any) -> ChunkSpec | EvenSplit | None:
            if s is None:
                return None
            if len(s) == 2:
                return Box(tuple(s[0]), tuple(s[1]))
            return EvenSplit.of(int(s[1]), int(s[2])) if s[0] == "s" else FlatRange(int(s[0]), int(s[1]))

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
        """A digest of everything the global plan depends on (not the rank: plans are gathered in order).
        Specs enter as plain tuples: the dataclasses' own ``repr`` cost ~1.4 ms per save for 736 leaves."""
        table = sorted((f, d, tuple(shape), _spec_key(s)) for f, (d, shape, s) in self.tensors.items())
        text = repr((table, sorted(self.aliases.items()), self.per_rank_fqns, self.guarded))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class PlannedChunk:
    fqn: str
    spec: ChunkSpec
    nbytes: int
    writer: int


def split_bytes_per_rank(splits: dict[str, tuple[EvenSplit, tuple[int, ...], int]], world: int) -> list[int]:
    """Bytes each rank writes of the split tensors ``{fqn: (split, shape, itemsize)}`` (rank ``k``
    writes part ``k``), in O(tensors + world): every part but the last non-empty one has ``step`` rows."""
    diff = [0] * (world + 1)
    for split, shape, itemsize in splits.values():
        m = split.nonempty(shape)
        if not m:
            continue
        row = math.prod(shape) // shape[split.dim] * itemsize
        step = split.step(shape)
        diff[0] += step * row
        diff[m - 1] -= step * row
        diff[m - 1] += (shape[split.dim] - (m - 1) * step) * row
        diff[m] -= (shape[split.dim] - (m - 1) * step) * row
    out, acc = [], 0
    for r in range(world):
        acc += diff[r]
        out.append(acc)
    return out


@dataclass
class GlobalPlan:
    """Who writes what: ``chunks`` (explicit, each with its writer) and ``splits`` (fqn -> the
    :class:`~unickpt.geometry.EvenSplit` every rank declared: rank ``k`` writes part ``k``; never
    enumerated), in sorted fqn order."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]  # fqn -> (dtype, global shape)
    chunks: list[PlannedChunk]
    aliases: dict[str, str]
    replicas: list[tuple[str, ChunkSpec, tuple[int, ...]]] = field(default_factory=list)  # (fqn, spec, holders)
    # of every chunk held by several ranks, in the same order on every rank (unickpt.saving.replicas checks them)
    splits: dict[str, EvenSplit] = field(default_factory=dict)

    def writes_for(self, rank: int) -> list[PlannedChunk]:
        """Rank ``rank``'s explicit chunks (its parts of ``splits`` are not listed)."""
        return [c for c in self.chunks if c.writer == rank]

    def bytes_per_rank(self, world_size: int) -> list[int]:
        out = split_bytes_per_rank({f: (s, self.tensors[f][1], str_to_dtype(self.tensors[f][0]).itemsize)
                                    for f, s in self.splits.items()}, world_size)
        for c in self.chunks:
            out[c.writer] += c.nbytes
        return out


def _spec_key(s: ChunkSpec | EvenSplit | None) -> tuple | None:
    return None if s is None else _chunk_key(s)


def _chunk_key(s: ChunkSpec | EvenSplit) -> tuple:
    """A plain, orderable tuple for a spec (sorting and plan signatures)."""
    if isinstance(s, Box):
        return ("b", s.offsets, s.lengths)
    if isinstance(s, EvenSplit):
        return ("s", s.dim, s.parts)
    return ("f", s.start, s.length)


def make_local_plan(flat: FlatState, rank: int, guarded: frozenset | set = frozenset(),
                    world_size: int = 1) -> LocalPlan:
    """This rank's holdings; ``guarded`` fqns (overlap snapshots) are placed last in its files. A
    shard that is exactly this rank's part of an even split of the ``world_size`` ranks
    (:meth:`EvenSplit.detect`: FSDP2, ``Shard(dim)`` over the group) is recorded as that split."""
    plan = LocalPlan(rank=rank, aliases=dict(flat.aliases), per_rank_fqns=tuple(sorted(flat.per_rank)),
                     guarded=tuple(sorted(guarded)))
    for fqn, leaf in flat.tensors.items():
        if fqn in flat.aliases:
            continue
        spec = leaf.spec if leaf.spec.numel > 0 else None
        plan.tensors[fqn] = (dtype_to_str(leaf.dtype), leaf.global_shape,
                             EvenSplit.detect(leaf.global_shape, spec, rank, world_size) or spec)
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


def make_global_plan(plans: list[LocalPlan], *, partial: bool = False, whole: str | None = None) -> GlobalPlan:
    """Deduplicate replicas, assign writers, and check that the shards tile every tensor.

    Cost: linear in the entries of the distinct plans (ranks sharing one ``tensors`` dict, see
    :func:`expand_plans`, count once) plus O(log ranks) per written chunk; a replicated chunk of
    ``>= SPLIT_MIN_BYTES`` is split into at most ``min(holders, nbytes / (mean bytes per rank / 4))``
    parts (:data:`SPLIT_PARTS_PER_MEAN`), so the chunk count grows with the world size only where the
    data needs it for balance. A tensor that every rank with a non-empty part of the same
    :class:`~unickpt.geometry.EvenSplit` (``parts`` = the world) declares as that split, and no rank
    holds otherwise, stays one split, O(1) whatever the world; otherwise the declared parts are
    enumerated like any box.

    ``whole``: an fqn prefix whose tensors are never split (``SaveOptions.safetensors``): a replicated
    one is written by one of its holders; a sharded one keeps its shards as chunks here, and the
    execution plan gathers them into one writer's file (:func:`_gather_writers`).

    Raises StateMismatchError when ranks disagree on a tensor's dtype or global shape, and
    ValueError when the shards of a tensor overlap without being identical or leave a gap.
    """
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    first_rank: dict[str, int] = {}
    holders: dict[tuple[str, ChunkSpec], list[tuple[int, ...]]] = {}
    declared: dict[str, list[tuple[EvenSplit, tuple[int, ...]]]] = {}  # fqn -> (split, ranks declaring it)
    aliases: dict[str, str] = {}
    groups: dict[int, list[LocalPlan]] = {}  # ranks sharing one tensors dict: processed once
    for plan in sorted(plans, key=lambda p: p.rank):
        groups.setdefault(id(plan.tensors), []).append(plan)
    world = max((p.rank for p in plans), default=0) + 1
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
            if isinstance(spec, EvenSplit):
                declared.setdefault(fqn, []).append((spec, ranks))
            elif spec is not None:
                holders.setdefault((fqn, spec), []).append(ranks)
    for fqn in aliases:
        tensors.pop(fqn, None)
    splits: dict[str, EvenSplit] = {}
    boxed = {fqn for fqn, _ in holders}
    for fqn, decl in declared.items():
        if fqn in aliases:
            continue
        first, shape = decl[0][0], tensors[fqn][1]  # decoded and detected splits: one object per value
        if whole is not None and fqn.startswith(whole):  # never a split: its parts are boxes (refused below)
            for split, rs in decl:
                for r in rs:
                    part = split.part(shape, r)
                    if part is not None:
                        holders.setdefault((fqn, part), []).append((r,))
            continue
        if first.parts == world and fqn not in boxed and all(s is first or s == first for s, _ in decl):
            # a split when every rank whose part is not empty declared it (the others hold nothing)
            m = first.nonempty(shape)
            if sum(bisect.bisect_left(rs, m) for _, rs in decl) == m:
                splits[fqn] = first
                continue
        for split, rs in decl:  # not every rank's part of one split: the declared parts are boxes
            for r in rs:
                part = split.part(shape, r)
                if part is not None:  # never None: a rank whose part is empty declares no split
                    holders.setdefault((fqn, part), []).append((r,))
    splits = dict(sorted(splits.items()))
    unique = [(fqn, spec, tuple(sorted(r for rs in groups_ for r in rs)) if len(groups_) > 1 else groups_[0])
              for (fqn, spec), groups_ in holders.items() if fqn not in aliases]
    by_fqn: dict[str, list[ChunkSpec]] = {fqn: [] for fqn in tensors if fqn not in splits}
    for fqn, spec, _ in unique:
        if fqn in splits:
            raise ValueError(f"{fqn!r}: every rank holds its part of {splits[fqn]}, and a rank also holds {spec}")
        by_fqn[fqn].append(spec)
    for fqn, specs in by_fqn.items():
        check_exact_cover(fqn, tensors[fqn][1], specs, partial=partial)

    itemsize = {dt: str_to_dtype(dt).itemsize for dt in {d for d, _ in tensors.values()}}
    split_load = split_bytes_per_rank({f: (sp, tensors[f][1], itemsize[tensors[f][0]]) for f, sp in splits.items()},
                                      world)
    load: dict[int, int] = {r: b for r, b in enumerate(split_load) if b}
    chunks: list[PlannedChunk] = []
    replicated = []
    total = sum(split_load)
    for fqn, spec, ranks in unique:
        nbytes = spec.numel * itemsize[tensors[fqn][0]]
        total += nbytes
        if len(ranks) == 1:  # fixed writer: count these first so replicas go to the least-loaded holders
            load[ranks[0]] = load.get(ranks[0], 0) + nbytes
            chunks.append(PlannedChunk(fqn, spec, nbytes, ranks[0]))
        else:
            replicated.append((nbytes, fqn, spec, tuple(ranks)))
    part_bytes = total / world / SPLIT_PARTS_PER_MEAN
    parts = []
    for nbytes, fqn, spec, ranks in replicated:
        count = 1 if whole is not None and fqn.startswith(whole) else _part_count(nbytes, len(ranks), part_bytes)
        if count == 1:
            parts.append((nbytes, fqn, spec, ranks))
        else:
            parts += [(n, fqn, part, ranks) for n, part in _split_replica(spec, nbytes, count)]
    parts.sort(key=lambda s: (-s[0], s[1], _chunk_key(s[2])))
    pickers: dict[tuple[int, ...], LeastLoaded] = {}
    for nbytes, fqn, spec, ranks in parts:
        picker = pickers.get(ranks)
        if picker is None:
            picker = pickers[ranks] = LeastLoaded(ranks, load)
        writer = picker.pop_min()
        load[writer] = load.get(writer, 0) + nbytes
        picker.refresh(writer)
        chunks.append(PlannedChunk(fqn, spec, nbytes, writer))
    return GlobalPlan(tensors, chunks, aliases, [(fqn, spec, ranks) for _, fqn, spec, ranks in replicated], splits)


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
    ``segment`` of the rank), whose bytes come from ``fills`` in order. ``slot``: for a part of a
    split tensor, its record's slot in the rank's index file (format v2); -1 for an explicit chunk."""

    fqn: str
    spec: ChunkSpec
    nbytes: int
    file: str
    segment: int
    offset: int
    fills: tuple
    slot: int = -1


class LazyRankLists(Sequence):
    """``plan.writes[r]`` / ``plan.segments[r]``: computed for a rank when first asked for (a rank
    executes only its own; the commit needs no other rank's), so that a plan of ranks x split tensors
    parts costs O(tensors) to make, not O(ranks x tensors)."""

    def __init__(self, world: int, get: Callable[[int], list]):
        self._world, self._get = world, get

    def __len__(self) -> int:
        return self._world

    def __getitem__(self, r: int) -> list:  # type: ignore[override]
        if not -self._world <= r < self._world:
            raise IndexError(r)
        return self._get(r % self._world)


@dataclass
class SavePlan:
    """Everything every rank executes for one layout (cached by the engine).

    ``writes[r]``: rank ``r``'s chunks in file order; ``segments[r]``: its data files
    ``(relative path, bytes)`` (both computed per rank on first use, :class:`LazyRankLists`);
    ``sends[r]``: merge transfers it sends; ``bytes_per_rank[r]``: bytes it writes;
    ``heads[r]``: per data file, the bytes written before its staged bytes (safetensors headers: chunk
    offsets are file offsets, past the head); ``hf_index``: ``model.safetensors.index.json``, which
    group rank 0 writes before the commit (safetensors shards of more than one writer);
    ``splits``: ``fqn -> (EvenSplit, slot)`` of the split tensors (format v2: rank ``k`` writes part
    ``k`` and its index record at ``slot``); ``explicit[r]``: ``(fqn, spec, nbytes)`` of rank ``r``'s
    other chunks, in the order they appear in ``writes[r]`` (what the commit needs of every rank).
    """

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    aliases: dict[str, str]
    writes: Sequence[list[WriteChunk]]
    segments: Sequence[list[tuple[str, int]]]
    sends: list[list[SendOp]]
    bytes_per_rank: list[int]
    per_rank_fqns: tuple[str, ...] = ()
    merged_tensors: int = 0
    transfers: int = 0
    transfer_bytes: int = 0
    replicas: tuple = ()  # GlobalPlan.replicas
    splits: dict[str, tuple[EvenSplit, int]] = field(default_factory=dict)
    explicit: Sequence[list[tuple[str, ChunkSpec, int]]] = ()
    heads: Sequence[list[bytes]] = ()
    hf_index: bytes | None = None

    def head(self, rank: int, segment: int) -> bytes:
        """The bytes rank ``rank`` writes before the staged bytes of its data file ``segment`` (a
        safetensors header, :mod:`unickpt.format.hf_shards`; ``b""`` for an ordinary data file)."""
        return self.heads[rank][segment] if self.heads else b""

    def stream_sizes(self, rank: int) -> list[int]:
        """Staged bytes of each of rank ``rank``'s data files (the file's size less its head)."""
        return [n - len(self.head(rank, i)) for i, (_, n) in enumerate(self.segments[rank])]

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


def make_save_plan(plans: list[LocalPlan], *, flat_ranges: str = "store", segment_bytes: int = 1 << 30,
                   partial: bool = False, safetensors: str | None = None) -> SavePlan:
    """The global plan plus each rank's files, offsets, fills and sends (deterministic).

    Args:
        flat_ranges: ``"store"`` keeps flat-range chunks as they are; ``"merge"`` turns tensors
            stored entirely as flat ranges into regular boxes (:func:`unickpt.plan.merge.merge_ranges`).
        segment_bytes: a rank starts a new data file when the current one would grow past this
            (a larger chunk gets a file of its own).
        partial: the plans are a part of a job-wide state (a memory-tier copy of one rank's shards,
            :mod:`unickpt.tiers`): shards must not overlap but need not cover their global tensors.
        safetensors: an fqn prefix: the tensors under it are written whole, each by one holder
            (least loaded first), into one safetensors file per writer (its first data file, named
            and headed by :mod:`unickpt.format.hf_shards`, names relative to the prefix), every
            other tensor into the writers' ordinary data files.

    Cost: O(tensors + explicit chunks + world); a rank's files and offsets cost O(its chunks) when
    first asked for (:class:`LazyRankLists`), except that the receivers of merge transfers are laid out at
    once (their transfers are numbered in one global order).

    Raises what :func:`make_global_plan` raises, and ValueError for an unknown ``flat_ranges``.
    """
    if flat_ranges not in ("store", "merge"):
        raise ValueError(f"flat_ranges must be 'store' or 'merge', got {flat_ranges!r}")
    with gc_paused():
        return _make_save_plan(plans, flat_ranges, segment_bytes, partial, safetensors)


def _gather_writers(gp: GlobalPlan, prefix: str, world: int) -> dict[str, tuple[int, int]]:
    """The group's sharded tensors (several chunks: DTensor shards, FSDP flat ranges, split parts), each
    gathered whole into one writer's safetensors file: ``fqn -> (writer, nbytes)``. Largest first, each to
    the rank with the fewest group bytes so far (whole tensors of one holder counted first; ties: the
    lowest rank), so the safetensors files stay balanced; computed alike on every rank (no collective)."""
    count: dict[str, int] = {}
    for c in gp.chunks:
        if c.fqn.startswith(prefix):
            count[c.fqn] = count.get(c.fqn, 0) + 1
    load = [0] * world
    sizes: dict[str, int] = {}
    for c in gp.chunks:
        if c.fqn.startswith(prefix):
            if count[c.fqn] == 1:
                load[c.writer] += c.nbytes
            else:
                sizes[c.fqn] = sizes.get(c.fqn, 0) + c.nbytes
    out: dict[str, tuple[int, int]] = {}
    for fqn, nbytes in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        writer = min(range(world), key=lambda r: (load[r], r))
        load[writer] += nbytes
        out[fqn] = (writer, nbytes)
    return out


def _gather_parts(fqn: str, shape: tuple[int, ...], itemsize: int, chunks: list[PlannedChunk],
                  leaf_specs: dict[int, ChunkSpec | EvenSplit | None]) -> tuple[tuple, ...]:
    """``(byte offset in the whole tensor, nbytes, source rank, byte offset in the source's leaf, view)`` of
    every storage-contiguous run of ``chunks`` (they tile the tensor), in the whole tensor's row-major
    order: what a gathering writer copies (its own runs) or receives (the others'). A box's runs follow its
    row-major order in its holder's local tensor (``view``: the box inside the holder's leaf, None when the
    leaf is the box); a flat range is one run."""
    full = Box((0,) * len(shape), tuple(shape))
    parts: list[tuple] = []
    for c in chunks:
        if isinstance(c.spec, FlatRange):
            parts.append((c.spec.start * itemsize, c.spec.length * itemsize, c.writer, 0, None))
            continue
        leaf = leaf_specs.get(c.writer)
        view = None if isinstance(leaf, EvenSplit) else _relative_view(leaf, c.spec)
        if view is not None:  # a send reads its leaf from byte 0: the chunk must be the whole leaf
            raise ValueError(f"{fqn!r}: rank {c.writer} holds {leaf}, of which only {c.spec} is to be gathered "
                             "into the safetensors file (SaveOptions.safetensors); a shard must be gathered whole")
        src = 0
        for start, n in byte_runs(full, c.spec, itemsize):
            parts.append((start, n, c.writer, src, view))
            src += n
    return tuple(sorted(parts, key=lambda p: p[0]))


def _shard_files(gp: GlobalPlan, prefix: str,
                 gathered: dict[str, tuple[int, int]]) -> tuple[dict[int, str], list[str], bytes | None]:
    """Writer -> its safetensors file name; the group's empty tensors (no chunk: listed in the first
    writer's header); and the index json (None for one writer). ``gathered``: :func:`_gather_writers`."""
    for fqn, (dtype, _) in gp.tensors.items():
        if fqn.startswith(prefix) and dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{fqn!r}: dtype {dtype} has no safetensors name (SaveOptions.safetensors={prefix!r}; "
                             f"stored as safetensors: {sorted(SAFETENSORS_DTYPES)})")
    for alias, target in gp.aliases.items():  # a tie across the prefix: the files would lack one of the two
        if alias.startswith(prefix) != target.startswith(prefix):
            inside, outside = (alias, target) if alias.startswith(prefix) else (target, alias)
            raise ValueError(f"{inside!r} is the same tensor as {outside!r}, outside {prefix!r} "
                             f"(SaveOptions.safetensors): stored once, it cannot be in the safetensors files and "
                             f"out of them; save one of the two names only")
    group = [(c.fqn, c.writer, c.nbytes) for c in gp.chunks if c.fqn.startswith(prefix) and c.fqn not in gathered]
    group += [(fqn, writer, nbytes) for fqn, (writer, nbytes) in gathered.items()]
    written = {fqn for fqn, _, _ in group}
    empty = sorted(f for f in gp.tensors if f.startswith(prefix) and f not in written and f not in gp.splits)
    writers = sorted({w for _, w, _ in group}) or ([0] if empty else [])
    names = {w: shard_name(k, len(writers)) for k, w in enumerate(writers)}
    if len(writers) < 2:
        return names, empty, None
    weight_map = {fqn[len(prefix):]: names[w] for fqn, w, _ in group}
    weight_map.update({f[len(prefix):]: names[writers[0]] for f in empty})
    return names, empty, index_json(weight_map, sum(n for _, _, n in group))


def _make_save_plan(plans: list[LocalPlan], flat_ranges: str, segment_bytes: int, partial: bool = False,
                    safetensors: str | None = None) -> SavePlan:
    gp = make_global_plan(plans, partial=partial, whole=safetensors)
    world = max((p.rank for p in plans), default=0) + 1
    gathered = _gather_writers(gp, safetensors, world) if safetensors is not None else {}
    shard_files, empty, hf_index = (_shard_files(gp, safetensors, gathered) if safetensors is not None
                                    else ({}, [], None))
    by_rank = {p.rank: p for p in plans}
    guarded_sets: dict[int, frozenset] = {}  # by id of the guarded tuple: ranks sharing a plan share it
    guards: dict[int, frozenset] = {}  # rank -> its guarded fqns (only ranks with some): what the lazy
    # per-rank layouts keep of the local plans, so that a cached plan does not hold every rank's plan
    for p in plans:
        if p.guarded:
            g = guarded_sets.get(id(p.guarded))
            if g is None:
                g = guarded_sets[id(p.guarded)] = frozenset(p.guarded)
            guards[p.rank] = g

    def is_guarded(r: int, fqn: str) -> bool:
        g = guards.get(r)
        return g is not None and fqn in g

    # (fqn, spec, nbytes, parts, slot) per writer; parts = (byte_start, nbytes, src, src_byte, view)
    todo: dict[int, list[tuple]] = {}
    merged: dict[int, list[tuple]] = {}
    by_fqn: dict[str, list[PlannedChunk]] = {}
    for c in gp.chunks:
        by_fqn.setdefault(c.fqn, []).append(c)
    merged_tensors = 0
    for fqn in sorted(by_fqn):
        chunks = by_fqn[fqn]
        dtype, shape = gp.tensors[fqn]
        itemsize = str_to_dtype(dtype).itemsize
        if fqn in gathered:  # a sharded safetensors tensor: whole, in one writer's file, its shards received
            writer, nbytes = gathered[fqn]
            parts = _gather_parts(fqn, shape, itemsize, chunks,
                                  {c.writer: by_rank[c.writer].tensors[fqn][2] for c in chunks})
            merged.setdefault(writer, []).append((fqn, Box((0,) * len(shape), tuple(shape)), nbytes, parts, -1))
            merged_tensors += 1
            continue
        ranges = [(c.spec.start, c.spec.length, c.writer) for c in chunks if isinstance(c.spec, FlatRange)]
        if flat_ranges == "merge" and len(ranges) == len(chunks):
            merged_tensors += 1
            for m in merge_ranges(shape, itemsize, ranges):
                parts = tuple((b, n, src, sb, None) for b, n, src, sb in m.parts)
                merged.setdefault(m.writer, []).append((fqn, m.spec, m.nbytes, parts, -1))
            continue
        for c in sorted(chunks, key=lambda c: _chunk_key(c.spec)):
            leaf_spec = by_rank[c.writer].tensors[fqn][2]
            view = None if isinstance(leaf_spec, EvenSplit) else _relative_view(leaf_spec, c.spec)
            todo.setdefault(c.writer, []).append((fqn, c.spec, c.nbytes, ((0, c.nbytes, c.writer, 0, view),), -1))
    splits = {fqn: (split, slot) for slot, (fqn, split) in enumerate(gp.splits.items())}
    split_items = [(fqn, split, slot, gp.tensors[fqn][1], str_to_dtype(gp.tensors[fqn][0]).itemsize)
                   for fqn, (split, slot) in splits.items()]

    def items_of(r: int) -> list[tuple]:
        """Rank r's chunks in file order: staged before save() returns, then guarded tensors (overlap
        snapshots); merged chunks last within each, so their receives have the most time to arrive;
        fqn order otherwise."""
        parts = []
        for fqn, split, slot, shape, isz in split_items:
            box = split.part(shape, r)
            if box is not None:
                parts.append((fqn, box, box.numel * isz, ((0, box.numel * isz, r, 0, None),), slot))
        own = list(heapq.merge(todo.get(r, []), parts, key=lambda x: x[0])) if parts else todo.get(r, [])
        items = own + merged.get(r, [])
        order = sorted(range(len(items)), key=lambda i: (is_guarded(r, items[i][0]), i >= len(own), i))
        return [items[i] for i in order]

    def explicit_of(r: int) -> list[tuple[str, ChunkSpec, int]]:
        """Rank r's explicit chunks (not parts of split tensors) in the order of ``writes_of(r)``."""
        items = todo.get(r, []) + merged.get(r, [])
        n = len(todo.get(r, []))
        order = sorted(range(len(items)), key=lambda i: (is_guarded(r, items[i][0]), i >= n, i))
        if r in shard_files:  # its safetensors file first, as layout() writes it
            assert safetensors is not None
            order.sort(key=lambda i: not items[i][0].startswith(safetensors))  # stable: the order within each
        return [items[i][:3] for i in order]

    layouts: dict[int, tuple[list, list, list]] = {}  # rank -> (chunks with stream positions, segments, heads)

    def layout(r: int) -> tuple[list, list, list]:
        got = layouts.get(r)
        if got is not None:
            return got
        chunks: list = []
        segs: list[str] = []
        heads: dict[int, bytes] = {}
        seg_size = 0
        items = items_of(r)
        if r in shard_files:  # the safetensors file first, its tensors in header order
            assert safetensors is not None
            group = [it for it in items if it[0].startswith(safetensors)]
            items = [it for it in items if not it[0].startswith(safetensors)]
            listed = [(fqn, nbytes) for fqn, _, nbytes, _, _ in group]
            if r == min(shard_files):
                listed += [(fqn, 0) for fqn in empty]
            head = heads[0] = header([(fqn[len(safetensors):], gp.tensors[fqn][0], gp.tensors[fqn][1], nbytes)
                                      for fqn, nbytes in listed])
            segs.append(shard_files[r])
            seg_size = len(head)
            for fqn, spec, nbytes, parts, slot in group:
                chunks.append((fqn, spec, nbytes, 0, seg_size, parts, slot))
                seg_size += nbytes
        fresh = len(segs)  # the other tensors start a data file of their own
        for fqn, spec, nbytes, parts, slot in items:
            if len(segs) == fresh or (seg_size and seg_size + nbytes > segment_bytes):
                segs.append(data_file(r, len(segs)))
                seg_size = 0
            chunks.append((fqn, spec, nbytes, len(segs) - 1, seg_size, parts, slot))
            seg_size += nbytes
        head_of = [heads.get(i, b"") for i in range(len(segs))]
        sizes = [len(h) for h in head_of]
        for _, _, nbytes, seg, off, _, _ in chunks:
            sizes[seg] = max(sizes[seg], off + nbytes)
        bases, _ = stream_layout([n - len(h) for n, h in zip(sizes, head_of)])
        got = layouts[r] = ([(fqn, spec, nbytes, seg, off, bases[seg] + off - len(head_of[seg]), parts, slot)
                             for fqn, spec, nbytes, seg, off, parts, slot in chunks], list(zip(segs, sizes)), head_of)
        return got

    # fills and sends: received parts are cut where the receiver's stream crosses a granule boundary
    # (so that a receive never straddles the ring's wrap), numbered in one global order (by receiver)
    sends: list[list[SendOp]] = [[] for _ in range(world)]
    recv_fills: dict[tuple[int, int], list] = {}  # (receiver, chunk position) -> fills
    index = transfers_bytes = 0
    for r in sorted(merged):
        for ci, (fqn, spec, nbytes, seg, off, stream_pos, parts, slot) in enumerate(layout(r)[0]):
            if all(src == r for _, _, src, _, _ in parts):
                continue
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
            recv_fills[(r, ci)] = fills
    finals: dict[int, list[WriteChunk]] = {}

    def writes_of(r: int) -> list[WriteChunk]:
        got = finals.get(r)
        if got is None:
            chunks, segments, _ = layout(r)
            got = finals[r] = [
                WriteChunk(fqn, spec, nbytes, segments[seg][0], seg, off,
                           tuple(recv_fills.get((r, ci)) or (LocalFill(b, n, view, sb) for b, n, _, sb, view in parts)),
                           slot)
                for ci, (fqn, spec, nbytes, seg, off, _, parts, slot) in enumerate(chunks)]
        return got

    bytes_per_rank = gp.bytes_per_rank(world)
    per_rank_fqns = tuple(sorted({f for fqns in {id(p.per_rank_fqns): p.per_rank_fqns for p in plans}.values()
                                  for f in fqns}))
    del by_rank, guarded_sets
    return SavePlan(gp.tensors, gp.aliases, LazyRankLists(world, writes_of), LazyRankLists(world, lambda r: layout(r)[1]), sends,
                    bytes_per_rank, per_rank_fqns, merged_tensors, index, transfers_bytes, tuple(gp.replicas), splits,
                    LazyRankLists(world, explicit_of), LazyRankLists(world, lambda r: layout(r)[2]) if shard_files else (),
                    hf_index)
