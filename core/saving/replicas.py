"""Replica check: the ranks that hold a chunk saved as replicated hold the same bytes.

A plain tensor in the state is taken as replicated over the group (as are ``Replicate`` DTensor dims
and a shard box held by several ranks): the planner writes it once, from one holder. When ranks hold
different values under one name, all but one copy would be lost silently (expert parallelism with
experts numbered from 0 on every rank saved one rank's experts and loaded wrong weights: KempnerForge
#202). So the first save of each layout (a plan-cache miss), or every save with
``SaveOptions.check_replicas="always"``, compares a digest of every replicated chunk across its holders.

Who does what: on the stager thread, after the plan is agreed and before staging, each holder digests
its copy of every replicated chunk (``xxh3_64``; ``"first"``: the whole chunk up to
:data:`SAMPLE_BYTES`, else its length and :data:`SAMPLE_WINDOWS` evenly spaced windows of 64 KiB,
from its first byte to its last, so the first save stays cheap; a difference between the windows of
a larger chunk is not seen, which renumbered or diverged weights never are; ``"always"``: every byte).
The digest is of bytes: ``-0.0`` and ``0.0``, or NaNs of other bit patterns, differ), then two ``all_reduce`` s (MIN and MAX of one int64
per replicated chunk, in the plan's order; non-holders send the neutral values) on the plan group show
which chunks differ, whatever the world size. Only then, to name the ranks, one gather (compact JSON, no pickle)
of the differing chunks' digests. Every rank raises the same :class:`~unickpt.errors.ReplicaMismatchError`.
"""
from __future__ import annotations

import json
from typing import Any

import torch
import xxhash

from ..errors import ReplicaMismatchError

__all__ = ["replica_digest", "check_replicas", "SAMPLE_BYTES", "SAMPLE_WINDOWS"]

SAMPLE_BYTES = 1 << 20
"""``"first"`` mode: a chunk up to this size is digested whole."""
SAMPLE_WINDOWS = 16
"""``"first"`` mode: a larger chunk is digested in this many evenly spaced windows of 64 KiB (1 MiB in all)."""
_WINDOW = SAMPLE_BYTES // SAMPLE_WINDOWS
_I64_MAX, _I64_MIN = (1 << 63) - 1, -(1 << 63)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a 1-d uint8 CPU-or-device tensor (a copy only when not contiguous)."""
    t = t.detach()
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def replica_digest(t: torch.Tensor, full: bool = False) -> int:
    """A signed 64-bit digest of ``t``'s bytes (any dtype, shape, device): every byte when ``full`` or
    at most :data:`SAMPLE_BYTES`, else the length and :data:`SAMPLE_WINDOWS` windows of 64 KiB at even
    spacing (windows are copied to the CPU; a CUDA tensor costs a 1 MiB copy)."""
    b = _bytes_view(t)
    n = b.numel()
    h = xxhash.xxh3_64()
    h.update(n.to_bytes(8, "little"))
    if full or n <= SAMPLE_BYTES:
        h.update(memoryview(b.cpu().numpy()))
    else:
        for i in range(SAMPLE_WINDOWS):  # the first window starts at byte 0, the last ends at the last byte
            start = (n - _WINDOW) * i // (SAMPLE_WINDOWS - 1)
            h.update(memoryview(b[start: start + _WINDOW].cpu().numpy()))
    d = h.intdigest()
    return d - (1 << 64) if d >= 1 << 63 else d


def check_replicas(comm: Any, replicas: tuple, leaves: dict[str, torch.Tensor], full: bool = False) -> int:
    """Compare every replicated chunk across its holders (collective over ``comm``'s plan group).

    Args:
        comm: the engine's :class:`~unickpt.collectives.Comm` (world size > 1).
        replicas: ``(fqn, spec, holder ranks)`` of every chunk held by several ranks, in the same
            order on every rank (``SavePlan.replicas``).
        leaves: this rank's tensor for each fqn it holds (its local chunk of that fqn).
        full: digest every byte (``check_replicas="always"``) instead of a sample.

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
            mine[i] = d = replica_digest(leaves[fqn], full)
            lo[i] = hi[i] = d
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=comm.plan_group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=comm.plan_group)
    differ = torch.nonzero(lo != hi).flatten().tolist()
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
