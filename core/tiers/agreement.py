"""The per-step agreement of the memory tiers: one all-reduce of three integers per step, pipelined.

Every rank of the checkpointer's group, caller's thread: :meth:`StepAgreement.start` posts this step's
all-reduce (``[preemption flag, -newest finished step, -watermark]``, MAX: the minimum of the steps
over the ranks) and returns the one posted a step ago; :meth:`StepAgreement.finish` waits for it
(normally complete) and gives the :class:`Agreement`. ``retain`` (the tiers' retention) runs with each
outcome. Before the group goes, :meth:`StepAgreement.drain` waits for the all-reduce still in flight.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..dist.comm import Comm
from .signals import PreemptionNotice

__all__ = ["Agreement", "StepAgreement"]

log = logging.getLogger("unickpt")


@dataclass(frozen=True)
class Agreement:
    """The outcome of one step's agreement: ``preempt`` (some rank received a preemption notice; equal
    on every rank), ``watermark`` (the newest step that every rank has committed in tier 0 and, with
    tier 1, whose peer copy its holder has received; or None), ``seconds`` (this rank's time in the
    call) and ``finished`` (the newest step every rank has committed in tier 0, or None; at least
    ``watermark``). The two steps are lower bounds, at most a step old (pipelined; a rank may see the
    newer of two all-reduces, so they may differ by a step between ranks), and only grow."""

    preempt: bool
    watermark: int | None
    seconds: float
    finished: int | None = None


def _agreement(t: torch.Tensor, seconds: float) -> Agreement:
    """An :class:`Agreement` from an all-reduced ``[flag, -finished, -watermark]`` (MAX of the negated
    contributions: the minimum over the ranks)."""
    flag, finished, watermark = bool(t[0].item()), -int(t[1].item()), -int(t[2].item())
    return Agreement(flag, watermark if watermark >= 0 else None, seconds, finished if finished >= 0 else None)


class StepAgreement:
    """The per-step agreement of one :class:`~unickpt.tiers.manager.Tiers` (see the module docstring).

    Args:
        comm: the tiers' private groups (the all-reduce runs on ``comm.plan_group``).
        notice: this rank's preemption notice (its flag is this rank's contribution).
        contribution: ``() -> (newest committed own step, newest step whose peer copy landed)``, -1: none.
        retain: retention with an agreement (None: no memory tiers, nothing to retain).
        lock: guards :attr:`last` and :attr:`agreeing` (shared with the caller's commit-thread state).

    Attributes:
        last: the newest :class:`Agreement`, or None before the first.
        agreeing: True between :meth:`start` and :meth:`finish` (:attr:`last` is about to change).
        seconds: the recent agreements' seconds (the last 1000).
    """

    def __init__(self, comm: Comm, notice: PreemptionNotice, contribution: Callable[[], tuple[int, int]],
                 retain: Callable[[Agreement], None] | None, lock: threading.Lock) -> None:
        self.comm, self.notice, self.contribution, self.retain, self.lock = comm, notice, contribution, retain, lock
        self.last: Agreement | None = None
        self.agreeing = False
        self.seconds: deque = deque(maxlen=1000)
        self._in_flight: tuple | None = None  # (tensor, work): the all-reduce posted for the next step

    def start(self) -> tuple:
        """Post this step's all-reduce (asynchronously) with this rank's flag and contribution now;
        returns what :meth:`finish` takes.

        Pipelined (more than one rank): the all-reduce posted at one step is finished at the *next*
        step's :meth:`finish`, so its latency (about 1 ms for 4 gloo ranks on this machine's 2 cores)
        hides behind a training step instead of adding to it; a notice is acted on by every rank at the
        same step, one step after it entered an all-reduce, and the watermarks are a step old (older is
        safe: retention only keeps more copies). The first call also posts one that it finishes itself
        (so the first step's agreement is current). One rank: no collective, current values. When the
        due all-reduce has completed (normally), retention runs here already, before this step's memory
        save (and again in :meth:`finish`)."""
        t0 = time.perf_counter()
        with self.lock:
            self.agreeing = True
        own, both = self.contribution()
        t = torch.tensor([1 if self.notice.flag else 0, -own, -both], dtype=torch.int64)
        if self.comm.world_size == 1:
            return t0, t, None, time.perf_counter() - t0
        import torch.distributed as dist

        if self._in_flight is None:  # the first step: one to finish now, one for the next step
            now = t.clone()
            due = (now, dist.all_reduce(now, op=dist.ReduceOp.MAX, group=self.comm.plan_group, async_op=True))
        else:
            due = self._in_flight
        nxt = t.clone()
        self._in_flight = (nxt, dist.all_reduce(nxt, op=dist.ReduceOp.MAX, group=self.comm.plan_group,
                                                async_op=True))
        posted = time.perf_counter() - t0
        if self.retain is not None and due[1].is_completed():
            # normally complete (posted a step ago): retention now, before this step's copy, which then
            # reuses a removed copy's file instead of new memory
            due[1].wait()
            self.retain(_agreement(due[0], 0.0))
        return t0, due[0], due[1], posted

    def finish(self, pending: tuple) -> Agreement:
        """Wait for the due all-reduce (posted a step ago: normally complete), then retention.
        ``seconds`` of the agreement counts the posting and this wait, not what ran between them. The
        watermarks come from the all-reduce posted at this step instead when it has completed already
        (the ranks are in step): fresher lower bounds, so that retention keeps fewer copies; the flag is
        always the due one's (every rank acts on a notice at the same step)."""
        _, t, work, posted = pending
        t1 = time.perf_counter()
        if work is not None:
            work.wait()
        fresh = self._in_flight
        if work is not None and fresh is not None and fresh[1].is_completed():
            fresh[1].wait()  # complete: returns at once
            t = torch.cat([t[:1], torch.minimum(t[1:], fresh[0][1:])])  # the newer steps (negated)
        seconds = posted + time.perf_counter() - t1
        self.seconds.append(seconds)
        agreement = _agreement(t, seconds)
        with self.lock:
            self.last, self.agreeing = agreement, False
        if self.retain is not None:
            self.retain(agreement)
        return agreement

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait for the all-reduce posted for the next step (every rank posted it), before the group goes."""
        pending: Any
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            import datetime

            try:
                pending[1].wait(datetime.timedelta(seconds=timeout_s))
            except Exception as e:  # a peer is gone: its group is closed below anyway
                log.warning("unickpt: the last tier agreement did not complete: %s", e)
