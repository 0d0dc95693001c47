"""The merge transfers of a save on one rank: irregular (flat-range) shards merged into regular row
boxes by moving only the missing row tails, point to point (ByteCheckpoint's asynchronous irregular
tensor merging, NSDI '25; the geometry is :mod:`unickpt.plan.merge`, the plan's sends and receives
:mod:`unickpt.plan.save_plan`).

Who does what: the save thread posts every send of a save first, from a snapshot copy in the ring's
send buffer (no send waits for ring space), then each receive into the ring when staging reaches its
bytes; the hasher thread waits for a receive just before the merged chunk is checksummed; the commit
thread waits for the sends. After a failure the save thread still posts what it owes (zeros into the
peers' receives, scratch for its own), so that no peer waits forever: the peers learn of the failure
at the commit. No collective: one point-to-point message per transfer, on a private gloo group.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..dist.p2p import P2P, wait_all
from ..plan.save_plan import WriteChunk, RecvFill, SendOp
from .staging import CudaStager, StagingPool, byte_view, copy_bytes

__all__ = ["MergeTransfers", "TransferLog"]


@dataclass
class TransferLog:
    """What one save posted on this rank (written by the save thread only; read by the commit thread
    once staging has ended): the indexes of posted sends and receives (so that
    :meth:`MergeTransfers.settle` knows what is still owed), the send works to wait for, and the counts
    merged into the save's stats at the end (``p2p_sends``, ``merge_bytes_sent``, ...)."""

    posted_sends: set[int] = field(default_factory=set)
    posted_recvs: set[int] = field(default_factory=set)
    send_works: list = field(default_factory=list)
    sends: int = 0
    recvs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class MergeTransfers:
    """The transfers of one engine's saves (``p2p`` None: a world of one, nothing to transfer). Each
    save's :class:`TransferLog` records what was posted."""

    def __init__(self, p2p: P2P | None, rank: int):
        self.p2p, self.rank = p2p, rank

    def post_sends(self, seq: int, pool: StagingPool, leaves: dict[str, torch.Tensor], sends: list[SendOp],
                   cuda: CudaStager | None, log: TransferLog) -> None:
        """Snapshot every merge send of save ``seq`` (its tensors: ``leaves``) into ``pool``'s send
        buffer, then post them all."""
        assert self.p2p is not None
        total = sum(s.nbytes for s in sends)
        pin = any(leaves[s.fqn].is_cuda for s in sends)
        buf = pool.send_buffer(total, pin=pin and torch.cuda.is_available())
        pos, slots = 0, []
        for s in sends:
            src = byte_view(leaves[s.fqn])
            dst = buf[pos : pos + s.nbytes]
            if src.is_cuda and cuda is not None:
                stream = cuda.stream_for(src.device)
                with torch.cuda.stream(stream):
                    copy_bytes([dst], src, s.src_byte, s.nbytes, stream)
            else:
                copy_bytes([dst], src, s.src_byte, s.nbytes)
            slots.append((s, dst))
            pos += s.nbytes
        if pin:
            torch.cuda.synchronize()
        for s, dst in slots:
            log.send_works.append(self.p2p.isend(dst, s.dst, P2P.tag(seq, s.index)))
            log.posted_sends.add(s.index)
            log.sends += 1
            log.bytes_sent += s.nbytes

    def post_recv(self, seq: int, fill: RecvFill, dst: torch.Tensor, log: TransferLog) -> Callable[[], object]:
        """Post the receive of ``fill`` of save ``seq`` into ``dst`` (a region of the ring); returns
        the wait of its work (the hasher calls it)."""
        assert self.p2p is not None
        work = self.p2p.irecv(dst, fill.src, P2P.tag(seq, fill.index))
        log.posted_recvs.add(fill.index)
        log.recvs += 1
        log.bytes_received += fill.nbytes
        return work.wait

    def settle(self, seq: int, sends: list[SendOp], mine: list[WriteChunk], log: TransferLog,
               fail: Callable[[str], None]) -> None:
        """After a failure of save ``seq``: post the sends (of ``sends``) and receives (of this rank's
        chunks ``mine``) it still owes (zeros / scratch) and wait for them, so that no peer waits
        forever. Never raises (a transfer that cannot be settled is passed to ``fail``)."""
        if self.p2p is None:
            return
        try:
            self._settle(seq, sends, mine, log)
        except BaseException as e:
            fail("merge transfers (settling after a failure): "
                 + "".join(traceback.format_exception(type(e), e, e.__traceback__)))

    def _settle(self, seq: int, sends: list[SendOp], mine: list[WriteChunk], log: TransferLog) -> None:
        assert self.p2p is not None
        owed_sends = [s for s in sends if s.index not in log.posted_sends]
        owed_recvs = [f for c in mine for f in c.fills if isinstance(f, RecvFill) and f.index not in log.posted_recvs]
        if not owed_sends and not owed_recvs:
            return
        scratch = torch.zeros(max([s.nbytes for s in owed_sends] + [f.nbytes for f in owed_recvs]), dtype=torch.uint8)
        works = []
        for s in owed_sends:
            works.append(self.p2p.isend(scratch[: s.nbytes], s.dst, P2P.tag(seq, s.index)))
            log.posted_sends.add(s.index)
        recv_scratch = torch.empty_like(scratch)
        for f in owed_recvs:  # one at a time: they share the scratch buffer
            log.posted_recvs.add(f.index)
            self.p2p.irecv(recv_scratch[: f.nbytes], f.src, P2P.tag(seq, f.index)).wait()
        wait_all(works)
