"""Live weight sync's transfer plan: which training rank sends which bytes to which inference rank.

The read plan of a load (:mod:`unickpt.plan.read_plan`) turned sideways: the "stored" tensors are the
training ranks' shards, held in memory, and the "targets" are the inference ranks' tensors, possibly in
other names and layouts (:mod:`unickpt.plan.mapping` rules: a Megatron ``linear_qkv`` read as Hugging
Face ``q_proj`` / ``k_proj`` / ``v_proj``). Two steps, both pure (no torch, no I/O):

1. :func:`resolve_needs`, on each inference rank: its targets, resolved by the mapping rules into
   pieces of the published tensors, intersected with the boxes that rank holds, give its
   :class:`Need` list: ``(target, region of the target, published tensor, box of it)``, a translation.
2. :func:`plan_transfers`, on every rank of both jobs alike (same inputs: every training rank's
   :class:`SourceEntry` list and every inference rank's needs): each need is cut along the boxes the
   training ranks hold; a box several ranks hold (replicas: DDP, HSDP, a replicated norm under TP) is
   sent by the least-loaded of them, largest pieces first (ByteCheckpoint's balanced writes of replicas),
   so each byte an inference rank needs is sent to it exactly once and the senders' bytes are balanced.
   The result is one :class:`PairPlan` per (sender, receiver): items laid back to back (64-byte
   aligned) in one message buffer, in an order both ends derive alike; elements two targets of one
   receiver need (a tied name served by one published tensor) travel once and are copied twice.

The plan depends only on the two layouts, so a publisher computes it once per subscriber group and
reuses it for every version. Raises :class:`~unickpt.errors.StateMismatchError` naming the tensor when
the training ranks do not hold some element a target needs, or hold overlapping boxes that are not
replicas of each other.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import StateMismatchError
from ..geometry import Box, intersect
from .mapping import Mapping, Rename, Unresolved

__all__ = ["SourceEntry", "TargetEntry", "Need", "Item", "PairPlan", "TransferPlan", "resolve_needs",
           "plan_transfers", "ALIGN", "sources_to_json", "sources_from_json", "needs_to_json", "needs_from_json"]

ALIGN = 64
"""Byte alignment of each item in a message buffer (any dtype's view of it is aligned)."""


@dataclass(frozen=True)
class SourceEntry:
    """A box ``box`` of the published tensor ``name`` (global ``shape``, ``dtype`` name, ``itemsize``
    bytes per element) held by one training rank. A rank may hold several boxes of one tensor
    (Megatron's tensor-parallel ``[gate; up]`` shard is two)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    box: Box
    itemsize: int


@dataclass(frozen=True)
class TargetEntry:
    """The box ``box`` of the target tensor ``name`` (global ``shape``, ``dtype`` name) one inference rank fills."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True)
class Need:
    """Elements ``region`` of target ``target`` (an index into the rank's target list, global target
    coordinates) are the elements ``at`` of the published tensor ``source`` (same lengths)."""

    target: int
    region: Box
    source: str
    at: Box


@dataclass(frozen=True)
class Item:
    """One copy of a message: elements ``at`` of the sender's entry ``entry`` (global coordinates of the
    published tensor) go to elements ``region`` of the receiver's target ``target``; ``nbytes`` bytes at
    byte ``offset`` of the message buffer."""

    entry: int
    at: Box
    target: int
    region: Box
    itemsize: int
    offset: int
    nbytes: int


@dataclass
class PairPlan:
    """What sender ``sender`` sends receiver ``receiver`` each version: ``items`` in one buffer of
    ``nbytes`` bytes; ``word`` is the smallest item size in it (the unit a delta compares)."""

    sender: int
    receiver: int
    items: list[Item] = field(default_factory=list)
    nbytes: int = 0
    word: int = 8


@dataclass
class TransferPlan:
    """Every pair's plan, keyed by ``(sender, receiver)`` (training rank, inference rank); pairs that
    exchange nothing are absent. ``sent_bytes[s]`` is what training rank ``s`` sends per full version."""

    pairs: dict[tuple[int, int], PairPlan]
    sent_bytes: list[int]

    def senders_of(self, receiver: int) -> list[int]:
        return sorted(s for s, r in self.pairs if r == receiver)

    def receivers_of(self, sender: int) -> list[int]:
        return sorted(r for s, r in self.pairs if s == sender)

    @property
    def total_bytes(self) -> int:
        return sum(self.sent_bytes)


def _shift(box: Box, src: tuple[int, ...], dst: tuple[int, ...]) -> Box:
    """``box`` translated by ``dst - src``."""
    return Box(tuple(o - s + d for o, s, d in zip(box.offsets, src, dst)), box.lengths)


def resolve_needs(targets: Sequence[TargetEntry], published: Callable[[str], "tuple[tuple[int, ...], str] | None"],
                  mapping: Mapping | None = None, published_aliases: dict[str, str] | None = None,
                  own_aliases: dict[str, str] | None = None) -> list[Need]:
    """One inference rank's needs: each target resolved through ``mapping`` (None: names as they are)
    over the published tensors (``published(name) -> (shape, dtype name) | None``; a name the trainer
    ties to another, ``published_aliases``, is that tensor), cut to the box the rank holds.

    Raises StateMismatchError naming the target when no published tensor serves it, its shape or dtype
    differs (no cast: publish in the inference dtype, ``Publisher(dtype=...)``), or it is tied here
    (``own_aliases``: the tied name is not a target of its own) while the trainer publishes it as a
    tensor of its own, whose values this model could not hold."""
    for name, first in sorted((own_aliases or {}).items()):
        if published(name) is not None:
            raise StateMismatchError(f"{name!r} is tied to {first!r} in the inference model, but the trainer "
                                     "publishes it as a tensor of its own; tie the trainer's or untie this model's")
    extra = [Rename(a, b) for a, b in sorted((published_aliases or {}).items())]
    resolve = (mapping or Mapping()).resolver(published, extra)
    out: list[Need] = []
    for i, t in enumerate(targets):
        if t.box.numel == 0:
            continue
        try:
            res = resolve(t.name)
        except Unresolved as e:
            raise StateMismatchError(
                f"{t.name!r}: no published tensor serves this target (looked for {e.missing}); "
                "give the Subscriber a mapping= whose rules name it") from None
        if tuple(res.shape) != tuple(t.shape):
            raise StateMismatchError(f"{t.name!r}: the target's shape is {list(t.shape)}, the published "
                                     f"tensors give {list(res.shape)}")
        if res.dtype != t.dtype:
            raise StateMismatchError(f"{t.name!r}: the target's dtype is {t.dtype}, the trainer publishes "
                                     f"{res.dtype} (no silent cast: Publisher(dtype=...) casts explicitly)")
        for p in res.pieces:
            region = intersect(t.box, p.region)
            if region is not None:
                out.append(Need(i, region, p.source, _shift(region, p.region.offsets, p.offsets)))
    return out


def _holders(sources: Sequence[Sequence[SourceEntry]]) -> dict[str, dict[Box, list[tuple[int, int]]]]:
    """``name -> box -> [(rank, entry index)]``; distinct boxes of a name must not overlap."""
    out: dict[str, dict[Box, list[tuple[int, int]]]] = {}
    meta: dict[str, tuple] = {}
    for rank, entries in enumerate(sources):
        for k, e in enumerate(entries):
            if meta.setdefault(e.name, (e.shape, e.dtype)) != (e.shape, e.dtype):
                first = meta[e.name]
                raise StateMismatchError(f"{e.name!r}: training ranks publish it with different shapes or dtypes "
                                         f"({list(first[0])} {first[1]} and {list(e.shape)} {e.dtype} on rank {rank})")
            if e.box.numel:
                out.setdefault(e.name, {}).setdefault(e.box, []).append((rank, k))
    for name, boxes in out.items():
        keys = list(boxes)
        for i in range(len(keys)):
            for j in range(i + 1, len(keys)):
                if intersect(keys[i], keys[j]) is not None:
                    raise StateMismatchError(
                        f"{name!r}: training ranks hold overlapping boxes {keys[i]} and {keys[j]} that are not "
                        "the same box (replicas must hold the same box)")
    return out


def plan_transfers(sources: Sequence[Sequence[SourceEntry]], needs: Sequence[Sequence[Need]]) -> TransferPlan:
    """The transfer plan from every training rank's entries (``sources[s]``) and every inference rank's
    needs (``needs[r]``). Deterministic: every rank that calls it with the same inputs gets the same plan.
    Raises StateMismatchError naming the published tensor and the elements no training rank holds."""
    holders = _holders(sources)
    tasks = []  # (nbytes, receiver, need index, piece box, holders)
    for r, rank_needs in enumerate(needs):
        for n_idx, need in enumerate(rank_needs):
            boxes = holders.get(need.source, {})
            covered = 0
            for hbox, hl in boxes.items():
                at = intersect(need.at, hbox)
                if at is None:
                    continue
                covered += at.numel
                s0, k0 = hl[0]
                tasks.append((at.numel * sources[s0][k0].itemsize, r, n_idx, at, hl))
            if covered != need.at.numel:
                raise StateMismatchError(
                    f"{need.source!r}: no training rank holds all of elements {need.at} (inference rank {r} "
                    f"needs them); the training ranks hold {sorted(boxes, key=lambda b: b.offsets)}")
    load = [0] * len(sources)
    chosen: dict[tuple[int, int], list] = {}
    # largest first, then a fixed order: the same plan everywhere
    for nbytes, r, n_idx, at, hl in sorted(tasks, key=lambda t: (-t[0], t[1], t[2], t[3].offsets)):
        rank, entry = hl[0] if len(hl) == 1 else min(hl, key=lambda h: (load[h[0]], h[0]))
        load[rank] += nbytes
        need = needs[r][n_idx]
        region = _shift(at, need.at.offsets, need.region.offsets)
        chosen.setdefault((rank, r), []).append((n_idx, at.offsets, entry, at, need.target, region,
                                                 sources[rank][entry].itemsize, nbytes))
    pairs: dict[tuple[int, int], PairPlan] = {}
    sent = [0] * len(sources)
    for (s, r), rows in sorted(chosen.items()):
        plan = PairPlan(s, r)
        off = 0
        placed: dict[tuple[int, Box], int] = {}  # the same elements for two targets (tied names): sent once
        for _, _, entry, at, target, region, itemsize, nbytes in sorted(rows, key=lambda x: (x[0], x[1])):
            if (entry, at) in placed:
                plan.items.append(Item(entry, at, target, region, itemsize, placed[(entry, at)], nbytes))
                continue
            off = -(-off // ALIGN) * ALIGN
            placed[(entry, at)] = off
            plan.items.append(Item(entry, at, target, region, itemsize, off, nbytes))
            off += nbytes
            plan.word = min(plan.word, itemsize)
        plan.nbytes = -(-off // ALIGN) * ALIGN
        pairs[(s, r)] = plan
        sent[s] += plan.nbytes
    return TransferPlan(pairs, sent)


# -- the layout exchange's documents (JSON, no pickle) -------------------------------------------------
def sources_to_json(entries: Sequence[SourceEntry], aliases: dict[str, str] | None = None) -> bytes:
    """One training rank's entries and aliases (tied names) as the bytes it sends in the layout exchange."""
    return json.dumps({"entries": [[e.name, e.dtype, list(e.shape), list(e.box.offsets), list(e.box.lengths),
                                    e.itemsize] for e in entries], "aliases": dict(aliases or {})}).encode()


def sources_from_json(data: bytes) -> tuple[list[SourceEntry], dict[str, str]]:
    """``(entries, aliases)`` of a training rank's exchange bytes."""
    doc = json.loads(data)
    return ([SourceEntry(n, d, tuple(s), Box(tuple(o), tuple(l)), int(i)) for n, d, s, o, l, i in doc["entries"]],
            dict(doc["aliases"]))


def needs_to_json(needs: Sequence[Need] | None, error: str | None = None) -> bytes:
    """One inference rank's needs (or the error that stopped it resolving them) as exchange bytes."""
    if error is not None:
        return json.dumps({"error": error}).encode()
    assert needs is not None
    return json.dumps({"needs": [[n.target, list(n.region.offsets), list(n.region.lengths), n.source,
                                  list(n.at.offsets)] for n in needs]}).encode()


def needs_from_json(data: bytes) -> tuple[list[Need], str | None]:
    """``(needs, error)`` of an inference rank's exchange bytes."""
    doc = json.loads(data)
    if "error" in doc:
        return [], str(doc["error"])
    return [Need(int(t), Box(tuple(ro), tuple(rl)), src, Box(tuple(ao), tuple(rl)))
            for t, ro, rl, src, ao in doc["needs"]], None
