"""Point-to-point transfers of a save's merge (:mod:`unickpt.plan.merge`), on a private gloo group.

Who does what: the save thread posts every send of a save first, at stage time, from a snapshot copy
(a send buffer outside the staging ring, so no send ever waits for ring space); each receive is
posted into the ring when the save thread reaches its bytes, and its wait is deferred to the hasher
thread, just before the merged chunk is checksummed and written. Since every rank posts all its
sends before it can block, every receive is eventually matched and no rank waits on another in a
cycle. Tags carry the save's sequence number, so two saves in flight never match each other's
messages. No collective: one message per transfer.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["P2P", "TAG_BITS", "wait_all"]

TAG_BITS = 20  # transfers per save < 2**20; the save's sequence number goes above them


def wait_all(works: Iterable[Any]) -> None:
    """Wait for every posted transfer (``torch.distributed`` ``Work`` objects; None entries, which
    ``isend`` / ``irecv`` give for a peer outside the group, are skipped), in order."""
    for w in works:
        if w is not None:
            w.wait()


class P2P:
    """Point-to-point byte transfers on a private gloo group (none for a world of one).

    Args:
        group: the process group (its ranks in group order are ``ranks``).
        ranks: global rank of each group rank.
    """

    def __init__(self, group: Any, ranks: list[int]):
        self.group, self.ranks = group, ranks

    @staticmethod
    def tag(seq: int, index: int) -> int:
        if index >= 1 << TAG_BITS:
            raise ValueError(f"too many merge transfers in one save ({index})")
        return ((seq % 2048) << TAG_BITS) | index

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Any:
        import torch.distributed as dist

        return dist.isend(buf, dst=self.ranks[dst], group=self.group, tag=tag)

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        import torch.distributed as dist

        return dist.irecv(buf, src=self.ranks[src], group=self.group, tag=tag)
