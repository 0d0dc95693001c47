"""Worker functions for test_dcp_async.py (run on every rank of a DistPool: gloo, CPU): overlapping
``dcp.async_save`` calls through unickpt's StorageWriter, FSDP2 training between them."""
from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import unickpt
import unickpt.fsdp


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _upload(fut):
    return getattr(fut, "upload_completion", None) or fut


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"


def _wait(futures: list, wait_s: float) -> list | None:
    """What each future raised (None: saved), waiting ``wait_s`` seconds in all; None when one is
    not done by then (a hung save)."""
    deadline = time.monotonic() + wait_s
    errors = []
    for fut in futures:
        try:
            _upload(fut).result(timeout=max(0.0, deadline - time.monotonic()))
            errors.append(None)
        except TimeoutError:
            return None
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            errors.append(_error(e))
    return errors


def _dcp_threads() -> list[str]:
    """DCP's save threads still alive (each one keeps the process from exiting)."""
    time.sleep(0.2)  # the executor's thread exits right after its future is done
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("AsyncCheckpointExecutor"))


def overlapping_saves_run(root: str, steps: int, writer_kind: str, group_kind: str, wait_s: float) -> dict:
    """FSDP2 (``fully_shard``) trains ``steps`` steps; after each one ``dcp.async_save`` of the model,
    the optimizer and the step, without waiting for the previous save. ``writer_kind="new"``: a new
    ``StorageWriter(<root>/ckpt)`` per call, every save to the same directory; ``"reused"``: one
    writer, each save to ``<root>/step<n>`` (``checkpoint_id``). DCP's group: the default one
    (``group_kind="default"``, which FSDP2's world mesh trains on) or a gloo group of its own
    (``"own"``). Every future is then waited for, ``wait_s`` seconds in all.

    Returns ``{"hung": True}`` when one is not done by then (the caller kills the pool), else what
    each save raised (None: saved), the order in which they completed, DCP's save threads left
    alive, and, per checkpoint read back (the last one for ``"new"``, every step's for
    ``"reused"``), its step and whether its model bits equal this rank's shards at that step."""
    import fsdp_workers as w
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = w.build("fsdp2")
    group = dist.new_group(backend="gloo") if group_kind == "own" else None
    writer = unickpt.fsdp.StorageWriter() if writer_kind == "reused" else None
    futures, done, shards = [], [], []
    for step in range(steps):
        w.train(model, optim, 1, seed=step)
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd, "step": step}
        if writer is None:
            fut = dcp.async_save(sd, storage_writer=unickpt.fsdp.StorageWriter(os.path.join(root, "ckpt")),
                                 process_group=group)
        else:
            fut = dcp.async_save(sd, checkpoint_id=os.path.join(root, f"step{step}"), storage_writer=writer,
                                 process_group=group)
        _upload(fut).add_done_callback(lambda _, i=step: done.append(i))
        futures.append(fut)
        shards.append({k: _local(v).clone() for k, v in msd.items()})  # this rank's shards: no collective
    errors = _wait(futures, wait_s)
    if errors is None:
        return {"hung": True}
    threads = _dcp_threads()
    if writer is not None:
        writer.close()
    read = []
    for step in ([steps - 1] if writer is None else range(steps)):
        msd, osd = get_state_dict(model, optim)
        loaded = {"model": msd, "optim": osd, "step": -1}
        path = os.path.join(root, "ckpt" if writer is None else f"step{step}")
        dcp.load(loaded, storage_reader=unickpt.fsdp.StorageReader(path), process_group=group)
        read.append((loaded["step"], all(torch.equal(_local(loaded["model"][k]), v) for k, v in shards[step].items())))
    return {"hung": False, "errors": errors, "order": done, "threads": threads, "read": read}


def failed_then_sync_run(path: str, wait_s: float) -> dict:
    """Without waiting: ``dcp.async_save`` of a state rank 1 cannot save (a lambda), an async save of
    step 1, then ``dcp.save`` of step 2 on this thread, all to ``path`` over the default group.
    Returns what each raised (``{"hung": True}`` when a save is not done within ``wait_s``), the step
    ``path`` holds at the end, and DCP's save threads left alive."""
    rank = dist.get_rank()

    def state(step: int) -> dict:
        return {"w": torch.arange(6.0) * (step + 1), "step": step}

    bad = {**state(0), "fn": (lambda: 0) if rank == 1 else 0}
    futures = [dcp.async_save(bad, storage_writer=unickpt.fsdp.StorageWriter(path)),
               dcp.async_save(state(1), storage_writer=unickpt.fsdp.StorageWriter(path))]
    sync = None
    try:
        dcp.save(state(2), storage_writer=unickpt.fsdp.StorageWriter(path))
    except BaseException as e:
        sync = _error(e)
    errors = _wait(futures, wait_s)
    if errors is None:
        return {"hung": True}
    t = {"w": torch.zeros(6), "step": -1}
    dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(path))
    return {"hung": False, "errors": errors, "sync": sync, "step": t["step"], "w": t["w"].tolist(),
            "threads": _dcp_threads()}


def process_executor_run(path: str, wait_s: float) -> dict:
    """``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` through a
    StorageWriter: what it raises (and where: at the call or from the future), within ``wait_s``."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    sd = {"w": torch.arange(6.0) + dist.get_rank(), "step": 3}
    try:
        fut = dcp.async_save(sd, storage_writer=unickpt.fsdp.StorageWriter(path),
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    except Exception as e:
        return {"at_call": f"{type(e).__name__}: {e}"}
    errors = _wait([fut], wait_s)
    return {"hung": True} if errors is None else {"from_future": errors[0]}


def storage_fails_on_rank_1_run(root: str, mode: str, wait_s: float) -> dict:
    """Three saves (``mode``: ``"sync"`` dcp.save, ``"async"`` dcp.async_save without waiting) to
    ``root/p<i>``; rank 1's writes of the second fail (EIO). DCP gathers rank 1's exception to the
    coordinator by pickling it: unickpt's SaveFailedError must survive that (it did not: rank 0 raised a
    TypeError, rank 1 waited for rank 0's broadcast forever). Returns what each save raised."""
    import errno

    from unickpt.testing import Fault, install

    uninstall = install(Fault("write", match=f"{root}/p1/*", nth=None, errno=errno.EIO)) if dist.get_rank() == 1 \
        else (lambda: None)
    try:
        def state(step: int) -> dict:  # replicated tensors: the writes are balanced over both ranks
            return {**{f"w{i}": torch.arange(100_000.0) * (step + 1) + i for i in range(4)}, "step": step}

        if mode == "sync":
            errors = []
            for s in range(3):
                try:
                    dcp.save(state(s), storage_writer=unickpt.fsdp.StorageWriter(f"{root}/p{s}"))
                    errors.append(None)
                except BaseException as e:  # DCP's CheckpointException is a BaseException
                    errors.append(_error(e))
        else:
            futures = [dcp.async_save(state(s), storage_writer=unickpt.fsdp.StorageWriter(f"{root}/p{s}"))
                       for s in range(3)]
            errors = _wait(futures, wait_s)
            if errors is None:
                return {"hung": True}
    finally:
        uninstall()
    t = {**{f"w{i}": torch.zeros(100_000) for i in range(4)}, "step": -1}
    dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(f"{root}/p2"))
    ok = all(torch.equal(t[f"w{i}"], torch.arange(100_000.0) * 3 + i) for i in range(4))
    return {"hung": False, "errors": errors, "step": t["step"], "w_ok": ok}
