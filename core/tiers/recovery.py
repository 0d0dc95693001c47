"""Recovery on restart: the newest step the job can restore from the tiers it still has, each rank's
shards from its nearest good copy, every byte checked against its checksum.

Every rank of the group, on the caller's thread (``Checkpointer.load``), on the tiers' private *plan*
gloo group:

1. **inventory** (**2 collectives**, :meth:`~unickpt.dist.comm.Comm.all_gather_bytes`): the lowest rank
   of each node reports the committed copies in the node's memory directory (tier 0 copies and the
   tier 1 copies it holds for ranks of other nodes, with their files), group rank 0 the newest
   persisted step. Every rank then derives the same table (:func:`plan_sources`): for each step and
   rank, its copies, nearest first: a copy on the rank's own node (**memory**), then copies on other
   nodes (**peer**, sent by a rank of that node).
2. **candidates**: the steps for which every rank has a copy, newest first, as long as they are at least
   as new as the newest persisted step (at the same step memory wins: it is faster).
3. for a candidate, **rounds**: each rank takes its first untried copy; copies on other nodes are sent
   point to point (the server maps the files, the rank receives them into
   ``own/rank_<r>_of_<W>/.restore-<N>/`` in its node's memory, which restores its tier 0 as well); each
   rank loads its copy alone (no collective; ``verify=True``: every chunk against its checksum before
   it is used); then the outcomes are gathered (**2 collectives**). A rank whose copy failed (corrupt,
   partial, unreadable: logged as a warning; a corrupt local copy is removed) takes its next copy in
   the next round; the ranks that succeeded wait. A rank out of copies ends the candidate, and the
   next one is tried (every rank loads again).
4. nothing restorable from memory: None, and the caller loads the newest persisted step from storage
   (collectively; a different world size reshards there, since memory copies of another layout are
   never candidates).

A failed copy never leaves bad data behind: the load that found it raised before its round was used,
and the state is then loaded again, entirely, from the next copy or tier.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..dist.comm import Comm
from ..dist.p2p import wait_all
from ..errors import IntegrityError, StateMismatchError, UnsafeObjectError
from ..loading.stats import LoadStats
from .node_dirs import MemoryLayout, remove_tree
from .peer import map_file, reserve_file
from .placement import Placement

__all__ = ["Source", "plan_sources", "candidates", "Recovery", "RecoveryResult", "RESTORE_TAG"]

log = logging.getLogger("unickpt")

RESTORE_TAG = 0x7200  # + the receiving group rank


@dataclass(frozen=True)
class Source:
    """One copy of one rank's step: ``tier`` ``"memory"`` (on the rank's own node) or ``"peer"`` (on
    another node, sent by ``server``); ``node``, ``kind`` (``"own"`` / ``"peer"`` directory) and ``holder``
    (whose directory: the rank the copy is of) locate it; ``files`` is its manifest."""

    tier: str
    node: str
    kind: str
    server: int | None
    files: tuple

    def nbytes(self) -> int:
        return sum(int(n) for _, n in self.files)


def plan_sources(inventories: dict[str, dict], placement: Placement) -> dict[int, dict[int, list[Source]]]:
    """``{step: {rank: [sources, nearest first]}}`` from each node's inventory
    (:meth:`~unickpt.tiers.node_dirs.MemoryLayout.inventory`, JSON keys as strings). Deterministic."""
    table: dict[int, dict[int, list[Source]]] = {}
    for node in placement.order:
        inv = inventories.get(node) or {}
        for kind in ("own", "peer"):
            for q_text, steps in sorted((inv.get(kind) or {}).items(), key=lambda kv: int(kv[0])):
                q = int(q_text)
                if q >= len(placement.nodes):
                    continue
                for step_text, files in steps.items():
                    local = placement.nodes[q] == node
                    src = Source("memory" if local else "peer", node, kind,
                                 None if local else placement.server(node, q), tuple(tuple(f) for f in files))
                    table.setdefault(int(step_text), {}).setdefault(q, []).append(src)
    for ranks in table.values():
        for q, srcs in ranks.items():
            srcs.sort(key=lambda s: (s.tier != "memory", s.kind != "own", placement.order.index(s.node)))
    return table


def candidates(table: dict[int, dict[int, list[Source]]], world_size: int, persisted: int | None,
               only: int | None = None) -> list[int]:
    """Steps every rank has a copy of, newest first, not older than ``persisted`` (``only``: that step,
    whatever ``persisted``)."""
    steps = [s for s, ranks in table.items() if all(ranks.get(q) for q in range(world_size))]
    if only is not None:
        return [s for s in steps if s == only]
    if persisted is not None:
        steps = [s for s in steps if s >= persisted]
    return sorted(steps, reverse=True)


@dataclass
class RecoveryResult:
    """What a recovery restored on this rank: ``step``, this rank's ``tier``, its :class:`LoadStats`
    (with ``tier`` and ``bytes_by_tier``), the ``rounds`` it took, the candidates it tried, and the
    ``state`` loaded into."""

    step: int
    tier: str
    stats: LoadStats
    rounds: int = 1
    tried: list = field(default_factory=list)
    state: Any = None  # the state loaded (set by Tiers.recover)


class Recovery:
    """One recovery (see the module docstring).

    Args:
        comm: the tiers' collectives (:class:`~unickpt.dist.comm.Comm`; its plan group is used).
        placement: the group's node map; ``layout``: this node's memory directory.
        load_copy: ``load_copy(path) -> LoadStats``: load a copy into the caller's state, alone.
    """

    def __init__(self, comm: Comm, placement: Placement, layout: MemoryLayout, load_copy: Callable[[str], LoadStats]):
        self.comm, self.placement, self.layout, self.load_copy = comm, placement, layout, load_copy
        self.rank, self.world_size = comm.rank, comm.world_size
        self.collectives = 0

    def gather_inventory(self, persisted: int | None) -> tuple[dict[str, dict], int | None]:
        """Every node's inventory and group rank 0's newest persisted step (2 collectives)."""
        me = self.rank
        mine: dict = {}
        if self.placement.leader(me) == me:
            mine["inv"] = self.layout.inventory(self.world_size)
            mine["node"] = self.placement.nodes[me]
        if me == 0:
            mine["persisted"] = persisted
        blobs = self.comm.all_gather_bytes(json.dumps(mine).encode(), self.comm.plan_group)
        self.collectives += 2
        docs = [json.loads(b) for b in blobs]
        inventories = {d["node"]: d["inv"] for d in docs if "inv" in d}
        return inventories, docs[0].get("persisted")

    def run(self, persisted: int | None, only: int | None = None) -> RecoveryResult | None:
        """Steps 1-3 of the module docstring. Returns None when no memory step can be restored
        (the caller loads from storage); raises nothing for bad copies (they are skipped), and
        StateMismatchError / UnsafeObjectError on every rank when a rank's state does not fit its copy
        (the caller's state is wrong, not the copy: a load from storage would refuse it too)."""
        inventories, persisted = self.gather_inventory(persisted)
        table = plan_sources(inventories, self.placement)
        tried = []
        for step in candidates(table, self.world_size, persisted, only):
            tried.append(step)
            result = self._restore(step, table[step])
            if result is not None:
                result.tried = tried
                return result
            if self.rank == 0:
                log.warning("unickpt: step %d cannot be restored from memory on every rank; trying the next tier", step)
        return None

    def _restore(self, step: int, sources: dict[int, list[Source]]) -> RecoveryResult | None:
        me, ws = self.rank, self.world_size
        index = [0] * ws
        done = [False] * ws
        outcome: tuple[LoadStats, str] | None = None
        rounds = 0
        while True:
            rounds += 1
            pick = {q: sources[q][index[q]] for q in range(ws) if not done[q]}
            received, error = self._transfer(step, pick)
            ok, text, fatal = True, None, None
            if me in pick:
                src = pick[me]
                path = received if received is not None else \
                    self.layout.step_dir(src.kind, me, ws, step)
                try:
                    if error is not None:
                        raise error
                    t0 = time.perf_counter()
                    stats = self.load_copy(path)
                    stats.tier = src.tier
                    stats.bytes_by_tier = {src.tier: stats.bytes_read}
                    if received is not None:
                        stats.peer_bytes_received = src.nbytes()
                    stats.total_s = time.perf_counter() - t0
                    if received is not None:  # verified: the copy from a peer becomes this rank's tier 0 copy
                        final = self.layout.step_dir("own", me, ws, step)
                        remove_tree(final)
                        os.rename(received, final)
                    outcome = (stats, src.tier)
                except (StateMismatchError, UnsafeObjectError) as e:  # the caller's state, not the copy
                    ok, text, fatal = False, str(e), type(e).__name__
                except Exception as e:
                    ok, text = False, f"{type(e).__name__}: {e}"
                    where = f"rank {self.comm.ranks[src.server]}'s node" if src.server is not None else "this node"
                    log.warning("unickpt: rank %d: the %s-tier copy of step %d (in %s) is unusable, trying the next "
                                "copy: %s", self.comm.ranks[me], src.tier, step, where, text)
                    if received is not None:
                        remove_tree(received)
                    elif isinstance(e, IntegrityError):
                        remove_tree(path)  # corrupt: never offered again
            blobs = self.comm.all_gather_bytes(json.dumps([ok, text, fatal]).encode() if me in pick else b"null",
                                               self.comm.plan_group)
            self.collectives += 2
            results = [json.loads(b) for b in blobs]
            refused = [q for q in pick if results[q][2]]
            if refused:  # the state does not fit the checkpoint: as a load from storage would, on every rank
                q = refused[0]
                cls = StateMismatchError if results[q][2] == "StateMismatchError" else UnsafeObjectError
                raise cls(f"rank {self.comm.ranks[q]}: restoring step {step} from memory: {results[q][1]}")
            for q in pick:
                if results[q][0]:
                    done[q] = True
                else:
                    index[q] += 1
            if all(done):
                break
            if any(not done[q] and index[q] >= len(sources[q]) for q in range(ws)):
                return None
        assert outcome is not None
        stats, tier = outcome
        return RecoveryResult(step, tier, stats, rounds)

    def _transfer(self, step: int, pick: dict[int, Source]) -> tuple[str | None, BaseException | None]:
        """The round's copies from other nodes, point to point: returns (the directory this rank
        received into, or None; an error that makes its copy unusable, or None)."""
        import torch.distributed as dist

        me, ws = self.rank, self.world_size
        works: list[dist.Work | None] = []  # None: never (every rank here is in the group)
        keep: list[torch.Tensor] = []
        received, error = None, None
        for q in sorted(pick):
            src = pick[q]
            if src.server is None:
                continue
            tag = RESTORE_TAG + q
            if src.server == me:  # serve rank q from this node's copy
                path = self.layout.step_dir(src.kind, q, ws, step)
                for rel, n in src.files:
                    if not n:
                        continue
                    try:
                        t = map_file(os.path.join(path, rel), int(n))
                    except (OSError, RuntimeError) as e:  # gone meanwhile: send zeros, rank q's checksum check fails
                        log.warning("unickpt: cannot read %s for rank %d: %s", os.path.join(path, rel), q, e)
                        t = torch.zeros(int(n), dtype=torch.uint8)
                    keep.append(t)
                    works.append(dist.isend(t, dst=self.comm.ranks[q], group=self.comm.plan_group, tag=tag))
            if q == me:
                received = os.path.join(self.layout.rank_root("own", me, ws), f".restore-{step}")
                remove_tree(received)
                for rel, n in src.files:
                    target = os.path.join(received, rel)
                    into: torch.Tensor | None
                    try:
                        reserve_file(target, int(n))
                        into = map_file(target, int(n)) if n else None
                    except (OSError, RuntimeError) as e:  # no room: receive into RAM, and give this copy up
                        error = error or e
                        into = torch.empty(int(n), dtype=torch.uint8) if n else None
                    if into is not None:
                        keep.append(into)
                        works.append(dist.irecv(into, src=self.comm.ranks[src.server], group=self.comm.plan_group, tag=tag))
        wait_all(works)
        del keep
        return received, error
