"""The process-group side of unickpt: rank, world size and two private gloo groups.

unickpt never runs collectives on the training process group. It creates two gloo groups over the
same ranks: ``plan`` for the caller's thread (planning at save, agreeing on a step at load) and
``background`` for the save thread (gathering write results, announcing the commit), so the two
threads never interleave collectives on one group (which would deadlock or mismatch). Without an
initialised process group everything runs as a world of one.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Comm"]


class Comm:
    """Collectives over the ranks of ``process_group`` (default: the world).

    Args:
        process_group: the group whose ranks take part; its own backend is not used.
        timeout_s: deadline for each collective, so a dead peer surfaces as an error, not a hang.
    """

    def __init__(self, process_group: Any = None, timeout_s: float = 1800.0):
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            self.rank, self.world_size, self.ranks = 0, 1, [0]
            self.plan_group = self.background_group = None
            return
        pg = process_group if process_group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(pg)
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        timeout = timedelta(seconds=timeout_s)
        self.plan_group = dist.new_group(self.ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
        self.background_group = dist.new_group(self.ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)

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
