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
from typing import Any

import torch

from ..dist.p2p import P2P
from ..plan.save_plan import RecvFill, SendOp
from .staging import CudaStager, byte_view, copy_bytes

__all__ = ["MergeTransfers"]


class MergeTransfers:
    """The transfers of one engine's saves (``p2p`` None: a world of one, nothing to transfer).

    A run (:class:`unickpt.saving.pipeline._Run`) records what was posted (``posted_sends``,
    ``posted_recvs``, ``send_works``), so that :meth:`settle` knows what is still owed.
    """

    def __init__(self, p2p: P2P | None, rank: int):
        self.p2p, self.rank = p2p, rank

    def post_sends(self, run: Any, sends: list[SendOp], cuda: CudaStager | None) -> None:
        """Snapshot every merge send of ``run`` into its ring's send buffer, then post them all."""
        assert run.pool is not None and self.p2p is not None
        total = sum(s.nbytes for s in sends)
        pin = any(run.leaves[s.fqn].is_cuda for s in sends)
        buf = run.pool.send_buffer(total, pin=pin and torch.cuda.is_available())
        pos, slots = 0, []
        for s in sends:
            src = byte_view(run.leaves[s.fqn])
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
            run.send_works.append(self.p2p.isend(dst, s.dst, P2P.tag(run.seq, s.index)))
            run.posted_sends.add(s.index)
            run.stats.p2p_sends += 1
            run.stats.merge_bytes_sent += s.nbytes

    def post_recv(self, run: Any, fill: RecvFill, dst: torch.Tensor) -> Any:
        """Post the receive of ``fill`` into ``dst`` (a region of the ring); returns its work (the
        hasher waits for it)."""
        assert self.p2p is not None
        work = self.p2p.irecv(dst, fill.src, P2P.tag(run.seq, fill.index))
        run.posted_recvs.add(fill.index)
        run.stats.p2p_recvs += 1
        run.stats.merge_bytes_received += fill.nbytes
        return work

    def settle(self, run: Any) -> None:
        """After a failure: post the sends and receives this rank still owes (zeros / scratch) and wait
        for them, so that no peer waits forever. Never raises (a transfer that cannot be settled is
        added to the save's failure)."""
        if self.p2p is None:
            return
        try:
            self._settle(run)
        except BaseException as e:
            run.fail("merge transfers (settling after a failure): "
                     + "".join(traceback.format_exception(type(e), e, e.__traceback__)))

    def _settle(self, run: Any) -> None:
        assert self.p2p is not None
        owed_sends = [s for s in run.plan.sends[self.rank] if s.index not in run.posted_sends]
        owed_recvs = [f for c in run.mine for f in c.fills
                      if isinstance(f, RecvFill) and f.index not in run.posted_recvs]
        if not owed_sends and not owed_recvs:
            return
        scratch = torch.zeros(max([s.nbytes for s in owed_sends] + [f.nbytes for f in owed_recvs]), dtype=torch.uint8)
        works = []
        for s in owed_sends:
            works.append(self.p2p.isend(scratch[: s.nbytes], s.dst, P2P.tag(run.seq, s.index)))
            run.posted_sends.add(s.index)
        recv_scratch = torch.empty_like(scratch)
        for f in owed_recvs:  # one at a time: they share the scratch buffer
            run.posted_recvs.add(f.index)
            self.p2p.irecv(recv_scratch[: f.nbytes], f.src, P2P.tag(run.seq, f.index)).wait()
        for w in works:
            w.wait()
