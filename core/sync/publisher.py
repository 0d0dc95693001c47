"""The training side of a live weight sync: :class:`Publisher`.

Who does what, per :meth:`Publisher.publish` on every training rank (the caller's thread; gloo's own
threads move the bytes):

1. flatten the state (``get_model_state_dict`` for a module: no communication) into this rank's boxes;
2. rank 0 looks at the newest subscriber generation on the store and the training ranks agree on it
   (one all-reduce of two int64 on the training job's private gloo group, :mod:`unickpt.sync.group`);
3. on a new generation only: create the pair group, exchange layouts (two all-gathers on it) and plan
   (:func:`~unickpt.plan.transfer.plan_transfers`, computed alike on every rank of both jobs, no further
   message); the plan is reused for every later version of that generation;
4. pack each receiver's message (a copy of this rank's boxes into one reused buffer per receiver:
   after this the trainer may change its weights), checksum it, and send it; in delta mode, compare the
   live boxes with that buffer (which holds the version the receiver acknowledged last), send only the
   words that changed and write them into the buffer (:mod:`unickpt.sync.wire`);
5. wait for each receiver's acknowledgement; resend a message in full when asked (checksum mismatch).

No gather on one rank: each rank sends only the bytes it holds, straight to the inference ranks that
need them, each byte once per inference rank that needs it, replicas balanced over their holders.

Failures on the inference side (its tensors do not match, it leaves or dies mid-version) drop the
generation on every training rank; by default they are logged as a warning and recorded in
:attr:`PublishReport.error`, so that training goes on and a new inference job can join
(``strict=True`` raises them instead).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..dist.comm import Comm
from ..errors import StateMismatchError, SyncError
from ..format.dtypes import str_to_dtype
from ..plan.transfer import (PairPlan, SourceEntry, needs_from_json, plan_transfers, sources_from_json,
                             sources_to_json)
from . import wire
from .group import Generations, PairGroup, max_ints, open_store
from .tensors import Held, local_view, published, state_of

__all__ = ["Publisher", "PublishReport"]

log = logging.getLogger(__name__)

TAG_HEADER, TAG_PAYLOAD, TAG_ACK = 1, 2, 3


@dataclass
class PublishReport:
    """One :meth:`Publisher.publish` on one training rank.

    ``subscribers``: inference ranks served (0: no inference job has joined); ``bytes_sent``: payload
    bytes this rank sent (resends included); ``full_bytes``: what a full version costs this rank;
    ``delta_pairs`` / ``full_pairs`` / ``resent_pairs``: messages by kind; ``seconds``: the whole call,
    ``plan_seconds`` (of it: joining a new generation, exchanging layouts and planning; 0.0 when the plan
    was reused), ``pack_seconds`` (copying the weights into the send buffers: the part that blocks the
    trainer's weights); ``history_bytes``: memory the delta mode keeps (the last acknowledged version of
    each message); ``error``: why the inference ranks did not get this version (None: they did, or none
    has joined), with ``strict=False``.
    """

    version: int
    subscribers: int = 0
    generation: int = 0
    bytes_sent: int = 0
    full_bytes: int = 0
    full_pairs: int = 0
    delta_pairs: int = 0
    resent_pairs: int = 0
    seconds: float = 0.0
    plan_seconds: float = 0.0
    pack_seconds: float = 0.0
    history_bytes: int = 0
    error: str | None = None


class _Pair:
    """One receiver's message buffer on this sender, ``buf``: the version sent last. ``base``: the version
    the receiver acknowledged last (-1: none yet), which a delta applies to. On the CUDA path a delta also
    keeps ``prev``, the base's bytes (it packs first and compares the two buffers on the device)."""

    def __init__(self, plan: PairPlan, receiver: int, delta: bool, device: torch.device):
        self.plan, self.receiver = plan, receiver
        self.buf = torch.zeros(plan.nbytes, dtype=torch.uint8, device=device)
        self.spare = torch.zeros(plan.nbytes, dtype=torch.uint8, device=device) if delta and device.type == "cuda" else None
        self.prev: torch.Tensor | None = None
        self.base = -1


class Publisher:
    """Publishes a training job's weights to an inference job's ranks, in memory, each version.

    Args:
        state: what to publish: an ``nn.Module`` (plain, DDP, FSDP2: its ``get_model_state_dict``), a dict
            ``{name: Tensor | DTensor | unickpt.Shard | [Shard, ...]}``, or a callable returning one
            (called at each publish). Every training rank passes its own part.
        address: the rendezvous, ``"host:port"`` (hosted by training rank 0) or a ``torch.distributed.Store``.
        dtype: publish floating-point tensors in this dtype (cast while packing, e.g. fp32 master weights
            to a bf16 inference model); None: as they are (the subscriber's dtypes must then match).
        delta: send only the words changed since the receiver's last version (full on the first version
            of a generation, when the change is not under half the message, and on a checksum mismatch).
        process_group: the training ranks (default: the world; ``unickpt.ext.THIS_PROCESS``: this process alone).
        timeout_s: deadline of each message and of joining a generation (seconds).
        strict: raise the inference side's failures from :meth:`publish` (SyncError, StateMismatchError);
            False (default): log them, record them in :attr:`PublishReport.error` and go on.

    Raises ValueError for a malformed address. Call :meth:`close` when done (also a context manager).
    """

    def __init__(self, state: Any, address: Any, *, dtype: torch.dtype | None = None, delta: bool = False,
                 process_group: Any = None, timeout_s: float = 300.0, strict: bool = False):
        self.state, self.dtype, self.delta, self.timeout_s, self.strict = state, dtype, delta, timeout_s, strict
        self.comm = Comm(process_group, timeout_s=timeout_s)
        self.rank, self.world = self.comm.rank, self.comm.world_size
        self.store = open_store(address, host=self.rank == 0, timeout_s=timeout_s)
        self.gens = Generations(self.store)
        self.generation = 0
        self.group: PairGroup | None = None
        self.subscribers = 0
        self._entries: list[SourceEntry] = []
        self._pairs: list[_Pair] = []
        self._seq = 0  # versions sent in this generation

    # -- the generation ---------------------------------------------------------------------------------
    def _decide(self, device: str) -> int:
        """The generation to serve (0: none), agreed by the training ranks: rank 0's choice (a newer
        generation it claimed, none when the inference job closed the current one), and none when any
        rank lost the current one. A fresh trainer that finds the newest generation claimed by another
        marks it abandoned (the other is a predecessor that died: one trainer per address)."""
        choice = 0
        if self.rank == 0:
            choice = self.generation
            newest = self.gens.newest()
            if newest > self.generation:
                if self.gens.claim(newest, self.world, device):
                    choice = newest
                elif self.generation == 0 and not self.gens.abandoned(newest):
                    self.gens.abandon(newest)
            elif self.generation and self.gens.closed(self.generation):
                choice = 0
        lost = int(bool(self.generation) and self.group is None)
        choice, lost = max_ints(self.comm, [choice, lost])
        return 0 if lost and choice == self.generation else choice

    def _join(self, g: int, entries: list[SourceEntry], aliases: dict[str, str], device: torch.device) -> None:
        subs = self.gens.subscribers(g, self.timeout_s)
        if self.gens.data_device(g) != "cuda":
            device = torch.device("cpu")
        group = PairGroup(self.store, g, self.rank, self.world + subs, device, self.timeout_s)
        self.group, self.generation, self.subscribers, self._seq = group, g, subs, 0
        docs = group.allgather_bytes(sources_to_json(entries, aliases))
        sources = [sources_from_json(d)[0] for d in docs[: self.world]]
        answers = [needs_from_json(d) for d in group.allgather_bytes(b"")[self.world:]]
        for r, (_, error) in enumerate(answers):
            if error is not None:
                raise StateMismatchError(f"inference rank {r}: {error}")
        plan = plan_transfers(sources, [n for n, _ in answers])
        self._entries = entries
        self._pairs = [_Pair(plan.pairs[(self.rank, r)], r, self.delta, device) for r in plan.receivers_of(self.rank)]

    def _drop(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self._pairs, self.subscribers = None, [], 0

    def _leave(self) -> None:
        """Drop the current generation and mark it abandoned, so that its inference job joins again."""
        if self.generation and self.rank == 0:
            try:
                self.gens.abandon(self.generation)
            except RuntimeError:  # the store is gone: nobody is waiting on it
                pass
        self._drop()

    # -- one version --------------------------------------------------------------------------------------
    def publish(self, version: int) -> PublishReport:
        """Send the current weights as ``version`` (an int that grows) to the inference job, if one has
        joined; returns when every receiver acknowledged it. Collective over the training ranks.

        Failures, agreed by the training ranks (all drop the generation; a new one joins at a later
        publish): an inference rank that fails or leaves mid-version, inference tensors that do not match
        what is published (StateMismatchError, named), this rank's layout changed under the plan. With
        ``strict`` every rank raises (SyncError, or StateMismatchError); without, every rank logs a warning
        and returns the message in :attr:`PublishReport.error`.
        """
        t0 = time.perf_counter()
        entries, held, aliases = published(state_of(self.state), self.dtype)
        device = held[0].tensor.device if held else torch.device("cpu")
        report = PublishReport(version)
        g = self._decide("cuda" if device.type == "cuda" else "cpu")
        if g != self.generation:
            self._leave()
            self.generation = g
        if not g:
            report.seconds = time.perf_counter() - t0
            return report
        error: BaseException | None = None
        try:
            if self.group is None:
                self._join(g, entries, aliases, device)
                report.plan_seconds = time.perf_counter() - t0
            if entries != self._entries:
                changed = sorted({e.name for e in set(entries) ^ set(self._entries)})[:5]
                raise SyncError(f"training rank {self.rank}'s published layout changed since generation {g} was "
                                f"planned (first tensors that differ: {changed}); keep it fixed or make a new Publisher")
            report.generation, report.subscribers = g, self.subscribers
            self._send(version, held, report)
        except Exception as e:  # noqa: BLE001 - agreed below, then raised or reported
            error = e
        # every training rank learns whether any failed (one all-reduce of one int64): all drop the generation
        # together, and with strict all raise, so the ranks never diverge
        try:
            failed = max_ints(self.comm, [int(error is not None)])[0]
        except RuntimeError as e:  # a training rank is gone: the training job's own group is broken
            self._leave()
            raise SyncError(f"version {version}: a training rank is gone ({e}); not delivered") from (error or e)
        if failed:
            closed = self.gens.closed(g)
            self._leave()
            if closed and not isinstance(error, StateMismatchError):  # (a mismatch is the same on every rank)
                report.subscribers, report.seconds = 0, time.perf_counter() - t0
                return report  # the inference job closed while this version was on its way: alike on every rank
            if error is None:
                error = SyncError(f"version {version} not delivered: another training rank's transfer failed")
            elif not isinstance(error, (StateMismatchError, SyncError)):
                error = SyncError(f"version {version} not delivered to the inference ranks of generation {g}: "
                                  f"{type(error).__name__}: {error}")
            return self._failed(report, error, t0)
        report.seconds = time.perf_counter() - t0
        return report

    def _failed(self, report: PublishReport, error: BaseException, t0: float) -> PublishReport:
        """A failure on the inference side: raised with ``strict``, else logged and reported."""
        if self.strict:
            raise error
        log.warning("unickpt.sync: %s (training goes on; a new inference job can join)", error)
        report.error, report.subscribers, report.seconds = str(error), 0, time.perf_counter() - t0
        return report

    def _items(self, pair: _Pair, held: list[Held]):
        """``(item, its elements on this rank in the published dtype)`` of ``pair``'s message, each buffer
        region once (two targets of one receiver may share one)."""
        packed: set[int] = set()
        for it in pair.plan.items:
            if it.offset in packed:
                continue
            packed.add(it.offset)
            src = local_view(held[it.entry], it.at)
            dtype = str_to_dtype(self._entries[it.entry].dtype)
            yield it, (src if src.dtype == dtype else src.to(dtype))

    @staticmethod
    def _pack(pair: _Pair, items: Any) -> None:
        """Copy ``items`` (:meth:`_items`) into ``pair``'s buffer."""
        for it, src in items:
            pair.buf[it.offset:it.offset + it.nbytes].view(src.dtype).view(it.at.lengths).copy_(src)

    def _diff(self, pair: _Pair, held: list[Held]) -> tuple[torch.Tensor, int] | None:
        """The delta from ``pair.buf`` (the base version) to this rank's weights, written into ``buf`` as
        it goes, as ``(payload, changed words)``; None when it would not be under half the message (``buf``
        is then packed whole). On the CPU the live tensors are compared with the buffer directly (no pack:
        one pass over two versions), on CUDA packed first and compared buffer to buffer."""
        word = pair.plan.word
        if pair.buf.device.type != "cpu":  # pragma: no cover - CUDA
            assert pair.spare is not None
            pair.prev, pair.buf, pair.spare = pair.buf, pair.spare, pair.buf
            self._pack(pair, self._items(pair, held))
            got = wire.encode_delta(pair.buf, pair.prev, word)
            return None if got is None else (got[0], got[2])
        limit = wire.max_delta_words(pair.plan.nbytes, word)
        items = list(self._items(pair, held))
        guess = sum(wire.sampled_changes(src, pair.buf[it.offset:it.offset + it.nbytes], word) for it, src in items)
        if guess > 2 * limit:  # most values changed: send it whole, at the cost of a pack
            self._pack(pair, items)
            return None
        idxs, values = [], []
        for it, src in items:
            found = wire.changed_words(src, pair.buf[it.offset:it.offset + it.nbytes], word, limit)
            if found is None:
                self._pack(pair, items)
                return None
            where, new = found
            limit -= where.size
            if where.size:
                idxs.append(where + it.offset // word)
                values.append(new)
        idx = torch.from_numpy(np.concatenate(idxs)) if idxs else torch.zeros(0, dtype=torch.int64)
        vals = torch.from_numpy(np.concatenate(values)) if values else torch.zeros(0, dtype=wire.WORD_DTYPES[word])
        pair.buf.view(wire.WORD_DTYPES[word])[idx] = vals  # the buffer now holds this version
        return wire.delta_payload(idx, vals, word), idx.numel()

    def _message(self, pair: _Pair, held: list[Held]) -> tuple[int, torch.Tensor, int]:
        """``(kind, payload, changed words)`` of this version's message to ``pair``'s receiver; ``buf``
        holds the version afterwards."""
        if self.delta and pair.base >= 0:
            got = self._diff(pair, held)
            if got is not None:
                return wire.DELTA, got[0], got[1]
        else:
            self._pack(pair, self._items(pair, held))
        return wire.FULL, pair.buf, 0

    def _post(self, payload: torch.Tensor, dst: int) -> Any:
        """Send one message's payload to pair-group rank ``dst`` (the transport step)."""
        assert self.group is not None
        return self.group.send_data(payload, dst, TAG_PAYLOAD)

    def _send(self, version: int, held: list[Held], report: PublishReport) -> None:
        group = self.group
        assert group is not None
        t = time.perf_counter()
        messages = [self._message(pair, held) for pair in self._pairs]
        report.pack_seconds = time.perf_counter() - t
        self._seq += 1
        if self.rank == 0:
            self.gens.announce(self.generation, self._seq, version)
        works, acks = [], []
        for pair, (kind, payload, changed) in zip(self._pairs, messages):
            dst = self.world + pair.receiver
            hdr = wire.header(version, kind, payload.numel(), wire.digest(payload), changed, pair.base)
            works.append(group.send_control(hdr, dst, TAG_HEADER))
            if payload.numel():
                works.append(self._post(payload, dst))
            ack = torch.empty(1, dtype=torch.int64)
            acks.append((pair, ack, group.recv_control(ack, dst, TAG_ACK)))
            report.bytes_sent += payload.numel()
            report.full_bytes += pair.plan.nbytes
            report.delta_pairs += kind == wire.DELTA
            report.full_pairs += kind == wire.FULL
        for w in works:
            w.wait(group.timeout)
        failed: list[int] = []
        for pair, ack, work in acks:
            work.wait(group.timeout)
            dst = self.world + pair.receiver
            if int(ack.item()) == wire.RESEND:
                report.resent_pairs += 1
                report.bytes_sent += pair.plan.nbytes
                group.send_control(wire.header(version, wire.FULL, pair.plan.nbytes, wire.digest(pair.buf), 0), dst,
                                   TAG_HEADER).wait(group.timeout)
                self._post(pair.buf, dst).wait(group.timeout)
                group.recv_control(ack, dst, TAG_ACK).wait(group.timeout)
            if int(ack.item()) != wire.OK:  # answered every receiver first: none is left waiting for a resend
                failed.append(pair.receiver)
                continue
            pair.base = version  # the acknowledged version: the next delta's base
        if failed:
            raise SyncError(f"version {version}: inference rank(s) {failed} could not verify this rank's message "
                            "even after a full resend")
        report.history_bytes = sum(p.plan.nbytes * (1 + (p.spare is not None)) for p in self._pairs) if self.delta else 0

    def close(self) -> None:
        """Leave the current generation: it is marked abandoned, so the inference ranks waiting for a
        version join again (and wait for a trainer) instead of waiting for this one."""
        self._leave()
        self.comm.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
