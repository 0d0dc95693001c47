"""Failures of asynchronous saves, reported once on every rank (docs/design.md, "Failures of
asynchronous saves"): which earlier saves have finished on every rank (:func:`agree_finished`,
**1 collective**), and the report of their failures not raised yet (:func:`report_unreported`). Used
by :class:`~unickpt.saving.saver.Saver` on the caller's thread; every rank calls them at the same point.
"""
from __future__ import annotations

from ..dist.comm import Comm
from ..errors import EarlierSaveFailedError
from .request import SaveHandle

__all__ = ["agree_finished", "report_unreported"]


def agree_finished(comm: Comm, agreed: int, started: int, pending: list[SaveHandle]) -> int:
    """The number of saves (a prefix: saves finish in order, one commit thread) that have finished on
    every rank, given that the first ``agreed`` had and ``started`` were started; ``pending``: the
    handles not yet reported. **1 collective** in a world of more than one (an all-reduce, on the plan
    group; the caller waits for pending plans first), none in a world of one.

    With the count goes, per save since the last agreement, whether its failure was raised here
    already (its handle's ``wait()``): raised on every rank, it is not raised again; raised on some
    ranks only, its ``error_reported`` is cleared so that it is raised again on every rank, and the
    ranks never part ways (each would plan a different step next)."""
    upto = min([h.seq for h in pending if not h.done()], default=started)
    if comm.world_size == 1:
        return upto
    import torch
    import torch.distributed as dist

    by_seq = {h.seq: h for h in pending}
    seqs = range(agreed, started)
    said = [int(s in by_seq and by_seq[s].done() and by_seq[s].error_reported) for s in seqs]
    flags = torch.tensor([upto, *said], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=comm.plan_group)
    upto = int(flags[0].item())
    for s, everywhere in zip(seqs, flags[1:].tolist()):
        if s < upto and s in by_seq and not everywhere:
            by_seq[s].error_reported = False
    return upto


def report_unreported(finished: list[SaveHandle]) -> None:
    """Report the failures of ``finished`` saves (finished on every rank) not raised yet: each to its
    handle's ``on_error`` hook, the rest raised as one EarlierSaveFailedError naming every failed
    save's step (or path), oldest first, with the oldest one's error as ``__cause__``; a save whose
    hook returns True is left out."""
    failed = []
    for h in finished:
        error = h.outcome()
        if error is not None and not h.error_reported:
            h.error_reported = True
            failed.append((h.stats.step, h.path, error, h.on_error))
    raised = []
    for step, path, error, hook in failed:
        if hook is not None:
            one = EarlierSaveFailedError([(step, path, error)])
            one.__cause__ = error
            if hook(one):
                continue
        raised.append((step, path, error))
    if raised:
        raise EarlierSaveFailedError(raised) from raised[0][2]
