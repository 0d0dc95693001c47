"""Save planning: who writes which chunk. Pure functions, testable without a process group.

Each rank describes what it holds in a compact :class:`LocalPlan`; every rank gathers all of them
and runs :func:`make_global_plan`, which is deterministic, so all ranks reach the same plan with
one collective. Replicas (the same fqn and the same box or flat range on several ranks: data
parallel copies, replicated tensors, DTensor ``Replicate`` dims) are written once; each unique chunk
goes to the holder with the fewest bytes assigned so far (largest chunks first), which balances
replicated bytes over their holders instead of piling them on rank 0 (the imbalance reported in
pytorch/pytorch#125740). Chunks with a single holder are counted first, and replicated boxes of
at least :data:`SPLIT_MIN_BYTES` are split into row blocks across their holders.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .codec import dtype_to_str, str_to_dtype
from .errors import StateMismatchError
from .resharding import Box, ChunkSpec, check_exact_cover
from .state import FlatState

__all__ = ["LocalPlan", "PlannedChunk", "GlobalPlan", "make_local_plan", "make_global_plan", "SPLIT_MIN_BYTES"]

SPLIT_MIN_BYTES = 1 << 20
"""A replicated box of at least this many bytes is split along dim 0 into one part per holder, so
that one large replicated tensor does not make a single rank write much more than the others."""


def _spec_key(spec: ChunkSpec) -> tuple:
    return (0, spec.offsets, spec.lengths) if isinstance(spec, Box) else (1, (spec.start,), (spec.length,))


def _split_replica(spec: ChunkSpec, nbytes: int, holders: int) -> list[tuple[int, ChunkSpec]]:
    """``[(bytes, part)]``: the chunk whole, or split into row blocks when large and replicated."""
    if not isinstance(spec, Box) or not spec.lengths or nbytes < SPLIT_MIN_BYTES or spec.lengths[0] < 2:
        return [(nbytes, spec)]
    rows = spec.lengths[0]
    parts = min(holders, rows)
    row_bytes = nbytes // rows
    out, start = [], 0
    for i in range(parts):
        n = rows // parts + (1 if i < rows % parts else 0)
        offsets = (spec.offsets[0] + start,) + spec.offsets[1:]
        out.append((n * row_bytes, Box(offsets, (n,) + spec.lengths[1:])))
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

    def signature(self) -> str:
        """A digest of everything the global plan depends on (not the rank: plans are gathered in order)."""
        text = repr((sorted(self.tensors.items()), sorted(self.aliases.items()), self.per_rank_fqns))
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


def make_local_plan(flat: FlatState, rank: int) -> LocalPlan:
    plan = LocalPlan(rank=rank, aliases=dict(flat.aliases), per_rank_fqns=tuple(sorted(flat.per_rank)))
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
