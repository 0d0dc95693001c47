"""unickpt's own process groups: rank, world size and two private gloo groups, and their collectives.

unickpt never runs collectives on the training process group. It creates two gloo groups over the
same ranks: ``plan`` for the caller's thread (planning at save, agreeing on a step at load) and
``background`` for the save thread (gathering write results, announcing the commit), so the two
threads never interleave collectives on one group (which would deadlock or mismatch). Without an
initialised process group everything runs as a world of one.
"""
from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Comm", "THIS_PROCESS"]


class ThisProcess:
    """Type of :data:`THIS_PROCESS`."""

    def __repr__(self) -> str:
        return "unickpt.ext.THIS_PROCESS"


THIS_PROCESS = ThisProcess()
"""``process_group=THIS_PROCESS``: this process alone, a world of one, even when a default process
group exists (a save that one rank makes by itself, e.g. a framework hook called on rank 0 only).
Creates no process group, so the other ranks need not take part."""


def local_synchronization(ranks: list[int]) -> bool:
    """``use_local_synchronization`` for ``dist.new_group(ranks)``: only for a strict subgroup.

    With local synchronization torch names the group by hashing its ranks with the number of groups
    the calling rank belongs to, so members that belong to different numbers of groups (megatron-core's
    parallel_state creates such groups: embedding, position-embedding) derive different names and
    ``new_group`` hangs. A group of the whole world is created by every rank, so the global counter
    (non-local synchronization) names it the same everywhere.
    """
    return len(ranks) < dist.get_world_size()


class Comm:
    """Collectives over the ranks of ``process_group`` (default: the world).

    Args:
        process_group: the group whose ranks take part; its own backend is not used.
        timeout_s: deadline for each collective, so a dead peer surfaces as an error, not a hang.
    """

    def __init__(self, process_group: Any = None, timeout_s: float = 1800.0):
        self.distributed = dist.is_available() and dist.is_initialized() and process_group is not THIS_PROCESS
        if not self.distributed:
            self.rank, self.world_size, self.ranks = 0, 1, [0]
            self.plan_group = self.background_group = None
            return
        pg = process_group if process_group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(pg)
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        timeout = timedelta(seconds=timeout_s)
        local = local_synchronization(self.ranks)
        self.plan_group = dist.new_group(self.ranks, backend="gloo", timeout=timeout, use_local_synchronization=local)
        self.background_group = dist.new_group(self.ranks, backend="gloo", timeout=timeout, use_local_synchronization=local)

    @classmethod
    def solo(cls) -> "Comm":
        """A world of one (this process alone), whatever process group exists: for tools that read
        a checkpoint in one process."""
        comm = cls.__new__(cls)
        comm.distributed, comm.rank, comm.world_size, comm.ranks = False, 0, 1, [0]
        comm.plan_group = comm.background_group = None
        return comm

    def all_gather(self, obj: Any, group: Any) -> list[Any]:
        """Every rank's ``obj``, in group-rank order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def all_gather_bytes(self, data: bytes, group: Any) -> list[bytes]:
        """Every rank's ``data``, in group-rank order, without pickle, in two collectives: an
        ``all_gather`` of the lengths (8 bytes per rank), then one ``all_reduce`` (sum) of a byte
        buffer as long as all payloads together, in which each rank has put its payload at its own
        offset (the others are zeros), so that the reduction is the concatenation. Ranks that send
        ``b""`` cost nothing beyond their length, unlike a padded ``all_gather`` (every rank sends
        the longest payload)."""
        if self.world_size == 1:
            return [bytes(data)]
        import torch

        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=group)
        lengths = [int(x.item()) for x in sizes]
        starts = [0, *itertools.accumulate(lengths)][:-1]
        total = starts[-1] + lengths[-1]
        if total == 0:
            return [b""] * self.world_size
        buf = torch.zeros(total, dtype=torch.uint8)
        if data:
            buf[starts[self.rank] : starts[self.rank] + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        raw = buf.numpy().tobytes()
        return [raw[a : a + k] for a, k in zip(starts, lengths)]

    def broadcast(self, obj: Any, group: Any) -> Any:
        """Group rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[0], group=group)
        return box[0]

    def close(self) -> None:
        for g in (self.plan_group, self.background_group):
            if g is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(g)
                except (ValueError, RuntimeError):  # already gone with the default group
                    pass
        self.plan_group = self.background_group = None
