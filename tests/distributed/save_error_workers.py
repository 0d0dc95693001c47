"""Worker functions for test_save_errors_dist.py (run on every rank of a DistPool)."""
from __future__ import annotations

import errno
import os
import time

import torch
import torch.distributed as dist

import unickpt
from unickpt.testing import Fault, inject


def _state(step: int) -> dict:
    rank = dist.get_rank()
    w = torch.arange(1000, dtype=torch.float32) + 1000 * rank + step
    return {"w": unickpt.Shard(w, (2000,), offsets=(1000 * rank,)), "step": step}


def _outcome(fn) -> list:
    try:
        fn()
    except unickpt.EarlierSaveFailedError as e:
        return ["EarlierSaveFailedError", e.steps, type(e.__cause__).__name__, str(e).splitlines()[0],
                "No space left on device" in str(e.__cause__)]
    except BaseException as e:  # the test compares every rank's outcome
        return [type(e).__name__, str(e)]
    return ["ok"]


def one_rank_fails(root: str, fail_rank: int, on_error: str = "raise") -> dict:
    """Only ``fail_rank``'s data-file writes of step 1 fail (ENOSPC): after save 1 has finished on this
    rank (the other may lag), every rank's save(2) raises, or with on_error="warn" warns; steps 2 and 3
    commit; nothing is raised twice."""
    import warnings

    rank = dist.get_rank()
    ckpt = unickpt.Checkpointer(root, **({} if on_error == "raise" else {"on_error": on_error}))  # default: raise
    faults = [Fault("write", match="*step_1/data/*", nth=None, errno=errno.ENOSPC)] if rank == fail_rank else []
    with inject(*faults):
        h1 = ckpt.save(1, _state(1))
        while not h1.done():
            time.sleep(0.01)
    if rank != fail_rank:
        time.sleep(0.3)  # the ranks reach the next save at different times
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = _outcome(lambda: ckpt.save(2, _state(2)))
        if second[0] != "ok":  # raised: step 2 was not started; save it now
            ckpt.save(2, _state(2))
        ckpt.save(3, _state(3))
        last = _outcome(ckpt.close)
    out = {"w": unickpt.Shard(torch.zeros(1000), (2000,), offsets=(1000 * rank,)), "step": -1}
    loaded = unickpt.Checkpointer(root).load(out)
    warned = [str(w.message).split(" failed (")[0] + " failed" for w in caught]
    return {"second": second, "last": last, "warnings": warned,
            "failed_saves": getattr(ckpt, "failed_saves", None), "loaded": loaded, "step": out["step"],
            "bitwise": torch.equal(out["w"].tensor, _state(3)["w"].tensor),
            "listing": unickpt.list_checkpoints(root)}


def lagging_rank(root: str, lag_rank: int) -> dict:
    """Step 1 fails on every rank (rank 0's write); ``lag_rank`` calls save(2) at once, the other only
    after save 1 has finished on it: whichever call raises, it is the same call on every rank."""
    rank = dist.get_rank()
    ckpt = unickpt.Checkpointer(root)
    hold = Fault("write", match="*step_1/data/*", action="hold", delay_s=1.0)
    fail = Fault("write", match="*step_1/data/*", nth=None, errno=errno.ENOSPC)
    with inject(*([hold, fail] if rank == 0 else [])):
        h1 = ckpt.save(1, _state(1))
        if rank != lag_rank:
            while not h1.done():
                time.sleep(0.01)
        calls = [_outcome(lambda: ckpt.save(2, _state(2))), _outcome(ckpt.wait)]
    ckpt.close()
    return {"calls": calls, "committed": [s for s, ok in unickpt.list_checkpoints(root) if ok]}


def wait_on_one_rank(root: str) -> list:
    """Only rank 0 waits for the engine's saves between two saves: the next save still takes the same
    path on every rank (no rank skips the agreement the others run), and everything commits."""
    from unickpt.engine import get_engine

    ckpt = unickpt.Checkpointer(root)
    ckpt.save(1, _state(1))
    if dist.get_rank() == 0:
        get_engine().wait()
    ckpt.save(2, _state(2))
    ckpt.save(3, _state(3))
    ckpt.close()
    return [s for s, ok in unickpt.list_checkpoints(root) if ok]


def handle_wait_on_rank_0_only(root: str) -> dict:
    """Step 1's writes fail on every rank; only rank 0 waits for its handle (to log it) and sees the
    failure there. The next save must raise on every rank alike (rank 0 again), then saves go on: before,
    rank 1 raised alone, and from then on the ranks planned different steps and never saved again."""
    rank = dist.get_rank()
    ckpt = unickpt.Checkpointer(root)
    with inject(Fault("write", match="*step_1/data/*", nth=None, errno=errno.ENOSPC)):
        handle = ckpt.save(1, _state(1))
        first = _outcome(handle.wait) if rank == 0 else ["not waited"]
        handle.outcome()  # the failure is over on this rank (not reported)
    calls = [_outcome(lambda s=s: ckpt.save(s, _state(s))) for s in (2, 3, 4)]
    calls.append(_outcome(ckpt.close))
    return {"first": first, "calls": calls, "committed": [s for s, ok in unickpt.list_checkpoints(root) if ok]}


def handle_wait_on_every_rank(root: str) -> dict:
    """Every rank waited for the failed save's handle (it raised there): the next save does not raise it
    again."""
    ckpt = unickpt.Checkpointer(root)
    with inject(Fault("write", match="*step_1/data/*", nth=None, errno=errno.ENOSPC)):
        first = _outcome(ckpt.save(1, _state(1)).wait)
    calls = [_outcome(lambda s=s: ckpt.save(s, _state(s))) for s in (2, 3)]
    calls.append(_outcome(ckpt.close))
    return {"first": first, "calls": calls, "committed": [s for s, ok in unickpt.list_checkpoints(root) if ok]}
