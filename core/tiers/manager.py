"""``Tiers``: the memory tiers of one :class:`~unickpt.Checkpointer` and its per-step agreement.

What runs where (every rank of the checkpointer's group):

- **construction** (caller's thread, collective): two private gloo groups (:class:`~unickpt.dist.comm.Comm`:
  *plan* for the caller's thread, *background* for the peer threads), **2 collectives** to learn every
  rank's node (:mod:`.placement`), the signal handlers (:mod:`.signals`), this rank's memory saver
  (a :class:`~unickpt.saving.saver.Saver` of this process alone: the staging rings, drain threads and
  commit thread of the save path, writing ``SaveOptions.partial`` checkpoints into tmpfs) and the peer
  threads (:mod:`.peer`).
- **per step** (:meth:`Tiers.agree`, caller's thread; :mod:`.agreement`): **1 collective**, an
  all-reduce of three integers: whether any rank has received a preemption notice, the newest step
  that every rank has *finished* (committed in its tier 0), and the job's *watermark*, the newest step
  that every rank has committed and, with tier 1, whose copy its holder has received; pipelined:
  posted at one step and read at the next, so that the caller never waits for it (both are lower
  bounds, a step old). Then retention (:func:`~unickpt.tiers.node_dirs.retain_steps`,
  :meth:`Tiers._retain`): each rank keeps its newest ``memory_keep`` copies per tier, every copy newer
  than the finished step (one of them may become the job's last common step when the slowest rank
  finishes it) and the newest at or below the finished step and the watermark, so that a rank ahead
  never deletes the job's last common step; nothing grows over time (at most ``MAX_UNSETTLED`` copies
  newer than the finished step).
- **memory save** (:meth:`Tiers.memory_save`): the caller's thread takes the snapshot (the stall: the
  copy into the staging ring, as for a persistent save); the drain threads checksum and write it to
  ``own/rank_<r>_of_<W>/step_<N>/`` in this node's memory directory and the commit thread writes its
  ``metadata.json``, with no collective; then the peer send thread copies it to the holder.
- **recovery** (:meth:`Tiers.recover`, caller's thread, collective): :mod:`.recovery`, then **1 barrier** once each
  node's lowest rank has removed the copies newer than the restored step; after a load from storage
  instead, :meth:`Tiers.forget_newer` does the same removal and barrier.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
import uuid
import weakref
from collections import deque
from typing import Any, Callable

from ..dist.comm import Comm
from ..loading.loader import Loader
from ..loading.stats import LoadStats
from ..options import LoadOptions, SaveOptions, TierOptions
from ..requests import LoadRequest, SaveRequest
from ..saving.saver import Saver
from .agreement import Agreement, StepAgreement
from .node_dirs import SPARE_DIR, MemoryLayout, copy_dir, dir_bytes, recycle_into, remove_tree, retain_steps
from .peer import PeerCopier
from .placement import Placement
from .recovery import Recovery, RecoveryResult
from .signals import PreemptionNotice

__all__ = ["Tiers", "finish_all"]

log = logging.getLogger("unickpt")

_LIVE: "weakref.WeakSet[Tiers]" = weakref.WeakSet()
MAX_SPARES = 1  # data files of removed copies kept for the next memory save (in-place staging)
# copies per tier and rank kept newer than the agreed finished step (retention): the ranks' skew, the
# pipelined agreement and the saves in flight are a few steps; the bound is for a rank that never
# finishes a memory save (its failures would otherwise make every other rank keep every copy)
MAX_UNSETTLED = 8


class _Done:
    """The handle of a copy that needs no save (committed already)."""

    def wait(self, timeout: float | None = None) -> None:
        return None


class Tiers:
    """The memory tiers and the per-step agreement of one checkpointer (see the module docstring).

    Args:
        root: the persistent root (names this run's memory directory).
        options: validated :class:`~unickpt.TierOptions`.
        process_group: the ranks taking part (default: the world); construction is collective.
        save_options: the checkpointer's save options (memory saves use them, as partial, buffered
            saves in this process alone).
        timeout_s: deadline of each collective and transfer.
        local_world_size: ranks on this host (sizes the default staging ring).
    """

    def __init__(self, root: str, options: TierOptions, *, process_group: Any = None,
                 save_options: SaveOptions | None = None, timeout_s: float = 1800.0,
                 local_world_size: int | None = None):
        self.options = options
        self.comm = Comm(process_group, timeout_s)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        nodes = [json.loads(b) for b in self.comm.all_gather_bytes(json.dumps(options.node_id).encode(),
                                                                    self.comm.plan_group)]
        self.placement = Placement(nodes)
        self.node = nodes[self.rank]
        self.layout = MemoryLayout(str(options.memory_dir), str(root))
        self.notice = PreemptionNotice(tuple(options.signals))
        self.memory = options.memory_every is not None
        self.saver: Saver | None = None
        self.loader: Loader | None = None
        self.peer: PeerCopier | None = None
        self._own_newest = -1  # newest committed own memory step (commit thread writes, caller reads)
        self._restored: int | None = None  # the step this run restored (its copy is this run's)
        self._handles: deque = deque()
        self._memory_saves = 0
        self._first_bytes: int | None = None
        self._lock = threading.Lock()
        self._retain_lock = threading.Lock()
        self.skipped = 0  # memory saves skipped (no room, or a failure)
        self.steps = StepAgreement(self.comm, self.notice, self._contribution,
                                   self._retain if self.memory else None, self._lock)
        self.agree_s: deque = self.steps.seconds  # seconds of the recent agreements
        self.closed = False
        if self.memory:
            self.layout.ensure(self.node)
            base = save_options or SaveOptions()
            own_root = self.layout.rank_root("own", self.rank, self.world_size)
            self._spare_dir = os.path.join(own_root, SPARE_DIR)
            os.makedirs(self._spare_dir, exist_ok=True)
            self.memory_options = base.with_(partial=True, direct_io=False, upload_to=None, upload_options=None,
                                             writer="thread", check_replicas="off", segment_bytes=1 << 50,
                                             in_place=self._spare_dir)
            self.saver = Saver(Comm.solo(), self.memory_options, uuid.uuid4().hex, local_world_size=local_world_size,
                               timeout_s=timeout_s)
            self.loader = Loader(Comm.solo())
            peer = options.peer and self.placement.node_count > 1
            if options.peer and not peer and self.rank == 0:
                log.warning("unickpt: every rank is on one node (%s): no peer tier (tier 1); memory copies "
                            "survive process crashes, not the loss of the node", self.node)
            self.peer = PeerCopier(self.comm.background_group, self.comm.ranks, self.rank, self.world_size,
                                   self.placement.holder[self.rank] if peer else None,
                                   self.placement.senders(self.rank) if peer else [], self.layout, self._may_hold,
                                   self._received)
        _LIVE.add(self)

    # -- the per-step agreement -----------------------------------------------------------------------
    def _contribution(self) -> tuple[int, int]:
        """(newest committed own step, the same and newest step whose peer copy the holder received)."""
        own = self._own_newest
        if self.peer is not None and self.peer.holder is not None and self.peer.broken is None:
            return own, min(own, self.peer.sent_newest)
        return own, own

    def agree(self) -> Agreement:
        """Caller's thread, every step (**1 collective**, :mod:`.agreement`): has any rank received a
        preemption notice, and the job's memory watermarks."""
        return self.finish_agreement(self.start_agreement())

    def start_agreement(self) -> tuple:
        """The first half of :meth:`agree`: :meth:`~unickpt.tiers.agreement.StepAgreement.start`."""
        return self.steps.start()

    def finish_agreement(self, pending: tuple) -> Agreement:
        """The second half of :meth:`agree`: :meth:`~unickpt.tiers.agreement.StepAgreement.finish`."""
        return self.steps.finish(pending)

    @property
    def last_agreement(self) -> Agreement | None:
        """The newest agreement (None before the first)."""
        return self.steps.last

    def _busy(self, path: str) -> bool:
        assert self.saver is not None
        return self.saver.in_flight(path) or (self.peer is not None and self.peer.sending == path)

    def _retain(self, agreement: Agreement | None, own_only: bool = False) -> None:
        """Retention (:func:`~unickpt.tiers.node_dirs.retain_steps`) of this rank's copies and, unless
        ``own_only``, of those it holds for its senders (caller's thread, or the commit thread), with
        ``agreement``'s watermarks (None: before the first; no step is known finished).

        Own copies: the newest ``memory_keep``, every one newer than the agreed ``finished`` step (a
        rank ahead may hold the step the others are finishing: the job's next common step), the
        newest at or below ``finished`` (the job's last common step) and at or below ``watermark``
        (the newest step restorable after the loss of a node). Peer copies: likewise with
        ``watermark`` alone (they count in it)."""
        if agreement is None:
            agreement = Agreement(False, None, 0.0)
        keep, watermark = self.options.memory_keep, agreement.watermark
        with self._retain_lock:
            retain_steps(self.layout.rank_root("own", self.rank, self.world_size), keep,
                         (agreement.finished, watermark), self._busy, recycle_into(self._spare_dir, MAX_SPARES),
                         settled=agreement.finished, unsettled_max=MAX_UNSETTLED)
            if self.peer is not None and not own_only:
                for s in self.peer.senders:
                    self._retain_peer(s, watermark)

    def _retain_peer(self, sender: int, watermark: int | None) -> None:
        """Retention of the copies held for ``sender`` (see :meth:`_retain`); the caller holds the lock."""
        retain_steps(self.layout.rank_root("peer", sender, self.world_size), self.options.memory_keep, watermark,
                     lambda p: False, settled=watermark, unsettled_max=MAX_UNSETTLED)

    # -- memory saves ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether ``step`` is a memory step (``step % memory_every == 0``)."""
        every = self.options.memory_every
        return bool(self.memory) and every is not None and step % int(every) == 0

    def memory_bytes(self) -> dict:
        """The memory this rank's tiers hold now, bytes: ``own`` (its tier 0 copies), ``peer`` (the
        copies it holds for ranks of other nodes), ``staging`` (the memory saver's staging rings)."""
        if not self.memory:
            return {"own": 0, "peer": 0, "staging": 0}
        assert self.saver is not None
        own = dir_bytes(self.layout.rank_root("own", self.rank, self.world_size))
        peer = sum(dir_bytes(self.layout.rank_root("peer", s, self.world_size))
                   for s in (self.peer.senders if self.peer is not None else []))
        staging = sum(p.capacity_bytes for p in self.saver.pipeline.pools)
        return {"own": own, "peer": peer, "staging": staging}

    def _held(self) -> int:
        b = self.memory_bytes()
        return b["own"] + b["peer"]

    def _may_hold(self, sender: int, nbytes: int) -> bool:
        limit = self.options.memory_limit_bytes
        return limit is None or self._held() + nbytes <= limit

    def _copy_bytes(self, state: dict) -> int:
        """The expected size of a memory copy: the newest copy's, or the state's tensor bytes."""
        newest = self.layout.committed("own", self.rank, self.world_size)
        if newest:
            return dir_bytes(self.layout.step_dir("own", self.rank, self.world_size, newest[-1]))
        if self._first_bytes is None:
            from ..state.flat import flatten

            flat = flatten(state, for_load=False)
            self._first_bytes = sum(leaf.local.numel() * leaf.local.element_size()
                                    for fqn, leaf in flat.tensors.items() if fqn not in flat.aliases)
        return self._first_bytes

    def memory_save(self, step: int, state: dict, *, allow_pickle: bool = False) -> Any:
        """Save ``state`` as memory step ``step`` of this rank (no collective; see the module
        docstring) and schedule its peer copy. Returns the :class:`~unickpt.SaveHandle`, or None
        when skipped (no room under ``memory_limit_bytes``, or the save could not start: logged).
        Never raises for a failed memory save: training goes on, with the older copies."""
        assert self.saver is not None
        self._reap()
        path = self.layout.step_dir("own", self.rank, self.world_size, step)
        handle: Any = None
        limit, stale = self.options.memory_limit_bytes, copy_dir(path).is_committed()
        if stale and step != self._restored:  # a run's that did not restore it: never this save's
            remove_tree(path, recycle_into(self._spare_dir, MAX_SPARES))
        if stale and step == self._restored:
            handle = _Done()  # the copy this run restored is there
        elif limit is not None and self._held() + self._copy_bytes(state) > limit:
            self.skipped += 1
            log.warning("unickpt: rank %d: memory save of step %d skipped: the memory tiers hold %d bytes, a copy "
                        "takes about %d more, memory_limit_bytes is %d", self.comm.ranks[self.rank], step,
                        self._held(), self._copy_bytes(state), limit)
        else:
            extra = {"tier": {"kind": "memory", "rank": self.rank, "world_size": self.world_size, "node": self.node}}
            try:
                handle = self.saver.save(SaveRequest(path, async_save=True, step=int(step), extra=extra,
                                                     allow_pickle=allow_pickle, options=self.memory_options,
                                                     on_commit=functools.partial(self._committed, int(step))), state)
                self._handles.append(handle)
            except Exception as e:
                self.skipped += 1
                log.error("unickpt: rank %d: memory save of step %d failed: %s", self.comm.ranks[self.rank], step, e)
                handle = None
        if self.peer is not None and self._memory_saves % self.options.peer_every == 0:
            self.peer.schedule(step, handle, path)
        self._memory_saves += 1
        return None if isinstance(handle, _Done) else handle

    def _committed(self, step: int) -> None:
        """Commit thread: a memory save committed; the copies it replaces go (with the last watermark)."""
        with self._lock:
            self._own_newest = max(self._own_newest, step)
            if self.steps.agreeing:  # a newer watermark is on its way: finish_agreement retains with it
                return
            last = self.steps.last
        try:
            self._retain(last, own_only=True)
        except OSError as e:  # pragma: no cover - retention is retried at the next step
            log.warning("unickpt: memory retention failed: %s", e)

    def _received(self, sender: int) -> None:
        """Receive thread: a peer copy landed; the copies it replaces go (with the last watermark)."""
        last = self.last_agreement
        with self._retain_lock:
            self._retain_peer(sender, last.watermark if last is not None else None)

    def _reap(self, wait: bool = False) -> None:
        """Report finished memory saves that failed (a warning: the older copies stay)."""
        while self._handles and (wait or self._handles[0].done()):
            h = self._handles.popleft()
            try:
                h.wait()
            except BaseException as e:
                self.skipped += 1
                log.warning("unickpt: memory save %s failed (older memory copies are kept): %s", h.path, e)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the memory saves and the peer copies in flight. False if ``timeout`` passed first."""
        self._reap(wait=True)
        return self.peer.wait_idle(timeout) if self.peer is not None else True

    # -- recovery ----------------------------------------------------------------------------------------
    def recover(self, state: dict | Callable[[str], dict], *, persisted: int | None, only: int | None = None,
                strict: bool = True, allow_pickle: bool = False,
                load_options: LoadOptions | None = None) -> RecoveryResult | None:
        """Restore the newest memory step every rank has (collective; :mod:`.recovery`), not older than
        ``persisted``. ``state``: the state to load into, or ``state(copy path)`` that builds it for a
        copy (a plugin's template from the copy's metadata); the result's ``state`` is what was
        loaded. Returns None (the caller loads from storage, then calls :meth:`forget_newer`) when
        there is none. After a recovery every copy newer than the restored step is removed (another
        future) by each node's lowest rank, and every rank waits for that (one barrier). Raises StateMismatchError / UnsafeObjectError (every rank) when the state does not fit."""
        if not self.memory:
            return None
        assert self.loader is not None
        self.wait()
        opts = (load_options or LoadOptions()).with_(verify=True, redistribute=False)
        loader = self.loader
        loaded: dict = {}

        def load_copy(path: str) -> LoadStats:
            target = state(path) if callable(state) else state
            stats = loader.load(LoadRequest(path, strict=strict, allow_pickle=allow_pickle, options=opts), target)
            loaded["state"] = target
            return stats

        recovery = Recovery(self.comm, self.placement, self.layout, load_copy)
        result = recovery.run(persisted, only)
        # copies newer than the restored step are another future: removed once a step is restored
        # (here, or by forget_newer after the caller's load from storage succeeded: never before)
        if result is not None:
            _remove_newer(self, result.step)
            result.state, self._restored = loaded.get("state"), result.step
            with self._lock:
                self._own_newest = max(self._own_newest, result.step)  # the restored step is committed here
        return result

    def forget_newer(self, step: int) -> None:
        """After a successful load of ``step`` from storage (every rank, collective: **1 barrier**):
        the node's lowest rank removes this node's memory copies of later steps and of other world
        sizes, and no rank goes on before that (as after :meth:`recover`)."""
        if self.memory:
            _remove_newer(self, step)
        with self._lock:
            self._own_newest = min(self._own_newest, step)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> None:
        """Wait for the memory saves and peer copies (at most ``timeout`` seconds for the copies), stop
        the threads, free the staging memory, put the signal handlers back and destroy the private
        groups. The memory copies stay (a restart may need them; ``clear_memory`` removes them)."""
        if self.closed:
            return
        self.closed = True
        idle = True
        try:
            self.steps.drain()
            self._reap(wait=True)
            if self.peer is not None:
                idle = self.peer.close(timeout)
            if self.saver is not None:
                self.saver.close()
        finally:
            self.notice.close()
            if idle:
                self.comm.close()
            else:
                log.warning("unickpt: a peer copy is still blocked (a peer is gone); its group is left open")
            _LIVE.discard(self)

    def clear_memory(self) -> None:
        """Remove this rank's memory copies and those it holds for its senders (no collective)."""
        remove_tree(self.layout.rank_root("own", self.rank, self.world_size))
        if self.peer is not None:
            for s in self.peer.senders:
                remove_tree(self.layout.rank_root("peer", s, self.world_size))


def finish_all() -> None:
    """Close every live :class:`Tiers` of this process (before its process group goes:
    ``destroy_process_group`` and interpreter exit, :mod:`unickpt.teardown`)."""
    for tiers in list(_LIVE):
        try:
            tiers.close(timeout=30.0)
        except Exception as e:  # pragma: no cover - teardown goes on
            log.error("unickpt: closing the memory tiers failed: %s", e)


def _remove_newer(tiers: Tiers, step: int) -> None:
    """After a recovery of ``step`` or its load from storage (every rank, **1 barrier**): the node's
    lowest rank removes the node's copies newer than ``step`` and those of other world sizes, and no
    rank goes on before that. Else a rank whose stale copy of the next step is still there takes it for
    this run's save of that step, and the leader removes it a moment later (seen in
    tests/tiers/test_tiers_kill_loop.py: a rank's memory lost the job's last common step)."""
    import torch.distributed as dist

    if tiers.placement.leader(tiers.rank) == tiers.rank:
        tiers.layout.remove_newer(tiers.world_size, step)
        tiers.layout.remove_other_layouts(tiers.world_size)
    if tiers.comm.world_size > 1:
        dist.barrier(group=tiers.comm.plan_group)
