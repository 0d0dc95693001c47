"""Which rank holds which rank's peer copy (tier 1): a ring over nodes. Pure and deterministic.

Nodes are ordered by their lowest rank. Rank ``r``, the ``i``-th rank of node ``k``, has its copy held
by the ``i mod n``-th rank of node ``k+1`` (mod the number of nodes; ``n`` that node's rank count).
So every copy lies on another node than its rank (the loss of one node leaves one copy of each of
its ranks' shards on the next node), the copies of one node go to one other node (a second node loss
loses a shard only when it is the holder's node too), and with equal nodes every rank holds exactly
one peer copy (the memory per rank is the same everywhere). With one node there is no peer tier.
"""
from __future__ import annotations

__all__ = ["Placement"]


class Placement:
    """The node map of a group and its peer placement.

    Args:
        nodes: the node id of every group rank, in group-rank order.
    """

    def __init__(self, nodes: list[str]):
        self.nodes = list(nodes)
        self.order: list[str] = list(dict.fromkeys(self.nodes))  # by lowest rank
        self.members: dict[str, list[int]] = {n: [] for n in self.order}
        for r, n in enumerate(self.nodes):
            self.members[n].append(r)
        self.holder: dict[int, int | None] = {}
        k = len(self.order)
        for r, n in enumerate(self.nodes):
            if k < 2:
                self.holder[r] = None
                continue
            i = self.members[n].index(r)
            nxt = self.members[self.order[(self.order.index(n) + 1) % k]]
            self.holder[r] = nxt[i % len(nxt)]

    @property
    def node_count(self) -> int:
        return len(self.order)

    def senders(self, rank: int) -> list[int]:
        """The ranks whose copies ``rank`` holds, ascending."""
        return [r for r, h in self.holder.items() if h == rank]

    def same_node(self, a: int, b: int) -> bool:
        return self.nodes[a] == self.nodes[b]

    def leader(self, rank: int) -> int:
        """The lowest rank of ``rank``'s node (it reports the node's memory inventory)."""
        return self.members[self.nodes[rank]][0]

    def server(self, node: str, for_rank: int) -> int:
        """The rank of ``node`` that sends a copy to ``for_rank`` during recovery (spread over the
        node's ranks, so that a node's ranks restore in parallel)."""
        members = self.members[node]
        return members[for_rank % len(members)]
