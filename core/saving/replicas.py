"""Replica check: the ranks that hold a chunk saved as replicated hold the same bytes.

A plain tensor in the state is taken as replicated over the group (as are ``Replicate`` DTensor dims
and a shard box held by several ranks): the planner writes it once, from one holder. When ranks hold
different values under one name, all but one copy would be lost silently (expert parallelism with
experts numbered from 0 on every rank saved one rank's experts and loaded wrong weights: KempnerForge
#202), and copies that drift apart after a layout was first saved (a missed all-reduce) would be mixed
(some tensors from one rank, some from another). The check (``SaveOptions.check_replicas``):

``"sample"`` (the default): every save.

* The first save of a layout (a plan-cache miss) digests every replicated chunk as ``"first"`` below.
* Every later save of it (a hit) digests a **rotating sample**: chunk ``i`` (in the plan's order) of
  ``n`` bytes is cut into ``m = ceil(n / p)`` pieces of ``p = max(32 KiB, ceil(n / ROTATION))`` bytes
  (``m <= ROTATION``), and the ``c``-th hit of the layout (``c`` counted from 0; it advances only when
  the check passes) digests piece ``(c + i) % ROTATION`` of chunk ``i``, if ``m`` exceeds it. So every
  byte of every replicated chunk is digested once in every :data:`ROTATION` (128) consecutive saves
  of a layout: a drift anywhere is found within 128 saves; a chunk of at least 4 MiB has a piece
  digested on every save (a drift of a whole tensor, as a missed all-reduce makes, is found at the
  next save), a smaller one in ``m`` of every 128 saves. A save digests about 1/128 of the replicated
  bytes (``SaveStats.replica_check_s``; benchmarks/replica_check.py measures it against the stall).
  The pieces a rank holds are folded per *holder set* (the ranks that hold a chunk) into one 8-byte
  ``xxh3_64`` value each, and up to :data:`SLOTS` such values travel in the plan agreement's
  signature ``all_gather`` (:mod:`.plan_agreement`): no collective of its own. Where two holders' values
  differ, the sampled chunks are compared and named as below (4 collectives, then every rank
  raises); where a rank is in more than :data:`SLOTS` holder sets, or ranks expected different plans
  (a layout changed on some ranks only), the sample is compared that way instead (2 collectives).

``"first"``: the first save of each layout only: the whole chunk up to :data:`SAMPLE_BYTES`, else its
length and :data:`SAMPLE_WINDOWS` evenly spaced windows of 64 KiB, from its first byte to its last (a
difference between the windows of a larger chunk is not seen, which renumbered or diverged weights
never are). ``"always"``: every byte of every save (a debug option). ``"off"``: never.

Who does what: every digest runs on the save thread, reading the caller's tensors (or their clones of
the call) before staging: in ``sync`` snapshot mode it is part of the caller's stall; the sample on
a hit runs before the signature exchange, the others after it. Digests are of bytes: ``-0.0`` and
``0.0``, or NaNs of other bit patterns, differ. To compare per chunk (:func:`check_replicas`), two
``all_reduce`` s (MIN and MAX of one int64 per replicated chunk, in the plan's order; non-holders send
the neutral values) on the plan group show which chunks differ, whatever the world size; only then,
to name the ranks, one gather (compact JSON, no pickle) of the differing chunks' digests. Every rank
raises the same :class:`~unickpt.errors.ReplicaMismatchError`.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
from typing import Any, Callable

import torch
import xxhash

from .._util import host_bytes
from ..dist.comm import Comm
from ..errors import ReplicaMismatchError

__all__ = ["replica_digest", "check_replicas", "sample_range", "RotatingSample", "SAMPLE_BYTES", "SAMPLE_WINDOWS",
           "ROTATION", "SLOTS"]

SAMPLE_BYTES = 1 << 20
"""``"first"`` mode: a chunk up to this size is digested whole."""
SAMPLE_WINDOWS = 16
"""``"first"`` mode: a larger chunk is digested in this many evenly spaced windows of 64 KiB (1 MiB in all)."""
_WINDOW = SAMPLE_BYTES // SAMPLE_WINDOWS
ROTATION = 128
"""``"sample"`` mode: every byte of every replicated chunk is digested once in this many saves of a layout."""
_PIECE = 32 << 10  # "sample" mode: the smallest piece
SLOTS = 8
"""``"sample"`` mode: holder sets per rank whose digests travel in the signature exchange (8 bytes each)."""
_I64_MAX, _I64_MIN = (1 << 63) - 1, -(1 << 63)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a 1-d uint8 CPU-or-device tensor (a copy only when not contiguous)."""
    t = t.detach()
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _update(h: Any, t: torch.Tensor, start: int, end: int) -> None:
    """Feed bytes ``[start, end)`` of ``t``'s elements (row-major) to the hasher ``h``: straight from
    memory for a contiguous CPU tensor (no torch call per piece), else through a uint8 view (a device
    tensor's range is copied to the CPU)."""
    if end <= start:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        h.update((ctypes.c_char * (end - start)).from_address(t.data_ptr() + start))
    else:
        h.update(host_bytes(_bytes_view(t)[start:end].cpu()))


def _signed(d: int) -> int:
    return d - (1 << 64) if d >= 1 << 63 else d


def sample_range(nbytes: int, index: int, count: int) -> tuple[int, int] | None:
    """``"sample"`` mode: the bytes ``[start, end)`` of the chunk of ``nbytes`` bytes at ``index`` in
    the plan's replicas that the layout's ``count``-th checked hit digests, or None (none this save).
    Over any :data:`ROTATION` consecutive counts the ranges cover ``[0, nbytes)`` exactly once."""
    piece = max(_PIECE, -(-nbytes // ROTATION))
    k = (count + index) % ROTATION
    start = k * piece
    if k and start >= nbytes:
        return None
    return start, min(nbytes, start + piece)


def replica_digest(t: torch.Tensor, full: bool = False, piece: tuple[int, int] | None = None) -> int:
    """A signed 64-bit digest of ``t``'s bytes (any dtype, shape, device) and their length: every byte
    when ``full`` or at most :data:`SAMPLE_BYTES`, else :data:`SAMPLE_WINDOWS` windows of 64 KiB at
    even spacing (windows are copied to the CPU; a CUDA tensor costs a 1 MiB copy); ``piece``: the
    bytes ``[start, end)`` only (:func:`sample_range`)."""
    t = t.detach() if t.is_contiguous() else t.detach().contiguous()
    n = t.numel() * t.element_size()
    h = xxhash.xxh3_64()
    h.update(n.to_bytes(8, "little"))
    if piece is not None:
        h.update(piece[0].to_bytes(8, "little"))
        _update(h, t, *piece)
    elif full or n <= SAMPLE_BYTES:
        _update(h, t, 0, n)
    else:
        for i in range(SAMPLE_WINDOWS):  # the first window starts at byte 0, the last ends at the last byte
            start = (n - _WINDOW) * i // (SAMPLE_WINDOWS - 1)
            _update(h, t, start, start + _WINDOW)
    return _signed(h.intdigest())


def check_replicas(comm: Comm, replicas: tuple, leaves: dict[str, torch.Tensor], full: bool = False,
                   count: int | None = None) -> int:
    """Compare every replicated chunk across its holders (collective over ``comm``'s plan group).

    Args:
        comm: the engine's :class:`~unickpt.dist.comm.Comm` (world size > 1).
        replicas: ``(fqn, spec, holder ranks)`` of every chunk held by several ranks, in the same
            order on every rank (``SavePlan.replicas``).
        leaves: this rank's tensor for each fqn it holds (its local chunk of that fqn).
        full: digest every byte (``check_replicas="always"``) instead of a sample.
        count: compare only the rotating sample of the layout's ``count``-th checked hit
            (:func:`sample_range`) instead.

    Returns the number of collectives run (2, or 4 when chunks differ). Ranks are group ranks. Raises ReplicaMismatchError
    naming the first differing keys and, for each, which ranks hold which digest.
    """
    import torch.distributed as dist

    n = len(replicas)
    lo = torch.full((n,), _I64_MAX, dtype=torch.int64)
    hi = torch.full((n,), _I64_MIN, dtype=torch.int64)
    mine: dict[int, int] = {}
    for i, (fqn, _, ranks) in enumerate(replicas):
        if comm.rank in ranks:
            t = leaves[fqn]
            piece = None if count is None else sample_range(t.numel() * t.element_size(), i, count)
            if count is not None and piece is None:
                continue
            mine[i] = d = replica_digest(t, full, piece)
            lo[i] = hi[i] = d
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=comm.plan_group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=comm.plan_group)
    differ = torch.nonzero(lo < hi).flatten().tolist()  # lo > hi: not sampled this save
    if not differ:
        return 2
    shown = differ[:8]
    payload = json.dumps({str(i): mine[i] for i in shown if i in mine}).encode()
    gathered = [json.loads(b) for b in comm.all_gather_bytes(payload, comm.plan_group)]
    parts = []
    for i in shown:
        by_digest: dict[int, list[int]] = {}
        for r, digests in enumerate(gathered):
            if str(i) in digests:
                by_digest.setdefault(digests[str(i)], []).append(r)
        groups = "; ".join(f"ranks {rs} hold digest {d & ((1 << 64) - 1):016x}" for d, rs in by_digest.items())
        parts.append(f"{replicas[i][0]!r} ({groups})")
    more = f" and {len(differ) - len(shown)} more" if len(differ) > len(shown) else ""
    raise ReplicaMismatchError(
        f"ranks hold different values under the name of a tensor saved as replicated (written once): "
        f"{', '.join(parts)}{more}. A plain tensor is taken as the same on every rank of the group; if "
        "the ranks hold different tensors under one name (e.g. experts numbered from 0 on every expert-"
        "parallel rank), give each a name of its own, or say where it lies with a DTensor or "
        "unickpt.Shard, or save it per rank with unickpt.PerRank")


class RotatingSample:
    """The ``"sample"`` check of one cached plan on one rank: its holder sets, the slots each rank
    gives them, and the count of checked hits (see the module docstring).

    Args:
        replicas: the plan's ``(fqn, spec, holder ranks)`` (``SavePlan.replicas``).
        rank: this group rank.
        key: bytes naming the plan (its cache key), equal on every rank.

    Attributes:
        count: checked hits so far (advanced by the caller when a check passes).
        fits: every rank is in at most :data:`SLOTS` holder sets (the digests fit the exchange).
    """

    def __init__(self, replicas: tuple, rank: int, key: bytes):
        self.replicas, self.key, self.count = replicas, key, 0
        index: dict[tuple, int] = {}
        self._set_of = [index.setdefault(tuple(ranks), len(index)) for _, _, ranks in replicas]
        used: dict[int, int] = {}
        self._slots: list[list[tuple[int, int]]] = []  # per holder set: (rank, the slot it gives the set)
        for ranks in index:
            self._slots.append([(r, used.get(r, 0)) for r in ranks])
            for r in ranks:
                used[r] = used.get(r, 0) + 1
        self.fits = max(used.values(), default=0) <= SLOTS
        self._mine = {s: slot for s, holders in enumerate(self._slots) for r, slot in holders if r == rank}

    def id(self) -> bytes:
        """8 bytes naming the plan and the count: ranks whose ids are equal sampled the same pieces."""
        return hashlib.blake2b(self.key + self.count.to_bytes(8, "little"), digest_size=8).digest()

    def folds(self, leaf: Callable[[str], torch.Tensor]) -> bytes:
        """This rank's :data:`SLOTS` 8-byte values: per holder set it is in, the ``xxh3_64`` of the
        pieces of this save's sample (:func:`sample_range`) of its chunks of that set, in plan order
        (each preceded by its index, length and offset). ``leaf(fqn)``: this rank's tensor of fqn."""
        hashers = {s: xxhash.xxh3_64() for s in self._mine}
        for i, (fqn, _, ranks) in enumerate(self.replicas):
            s = self._set_of[i]
            if s not in self._mine:
                continue
            t = leaf(fqn)
            n = t.numel() * t.element_size()
            piece = sample_range(n, i, self.count)
            if piece is not None:
                t = t if t.is_contiguous() else t.contiguous()
                h = hashers[s]
                h.update(b"".join(x.to_bytes(8, "little") for x in (i, n, piece[0])))
                _update(h, t, *piece)
        out = bytearray(8 * SLOTS)
        for s, slot in self._mine.items():
            out[8 * slot: 8 * slot + 8] = hashers[s].digest()
        return bytes(out)

    def differ(self, folds: list[bytes]) -> list[tuple[int, ...]]:
        """The holder sets (their ranks) whose holders sent different values; ``folds``: every rank's
        :meth:`folds`, in group-rank order."""
        return [tuple(r for r, _ in holders) for holders in self._slots
                if len({folds[r][8 * slot: 8 * slot + 8] for r, slot in holders}) > 1]
