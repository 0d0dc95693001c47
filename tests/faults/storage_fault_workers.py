"""Worker functions for test_storage_faults.py (run on every rank of a DistPool, world size 2)."""
from __future__ import annotations

import errno

import torch
import torch.distributed as dist

import unickpt
from unickpt.testing import Fault, install

N = 1024


def value(step: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * step + rank))


def state(step: int) -> dict:
    r, n = dist.get_rank(), dist.get_world_size()
    return {"w": unickpt.Shard(value(step, r), (n * N,), offsets=(r * N,)), "step": step}


def load_into(ck) -> tuple[int | None, bool]:
    r, n = dist.get_rank(), dist.get_world_size()
    out = {"w": unickpt.Shard(torch.zeros(N), (n * N,), offsets=(r * N,)), "step": -1}
    step = ck.load(out)
    return step, step is not None and out["step"] == step and torch.equal(out["w"].tensor, value(step, r))


def save_steps(root: str, steps: list[int]) -> None:
    ck = unickpt.Checkpointer(root, async_save=False)
    for s in steps:
        ck.save(s, state(s))
    ck.close()


def load_with_rank0_listing_failing(root: str) -> dict:
    """Rank 0's listings of ``root`` fail with EIO (the others' would work): every rank raises the same
    StorageError at load (not "no checkpoint", no rank left waiting); then, with storage well again,
    every rank loads the newest step bitwise."""
    uninstall = install(Fault("list", nth=None, errno=errno.EIO)) if dist.get_rank() == 0 else (lambda: None)
    try:
        ck = unickpt.Checkpointer(root)
        out = {"w": unickpt.Shard(torch.zeros(N), (2 * N,), offsets=(dist.get_rank() * N,)), "step": -1}
        try:
            ck.load(out)
            error = None
        except unickpt.errors.StorageError as e:
            error = (type(e).__name__, str(e), e.errno, out["step"], bool(out["w"].tensor.any()))
    finally:
        uninstall()
    return {"error": error, "after": load_into(unickpt.Checkpointer(root))}


def die_during_step_2(root: str, report: str) -> None:
    """Step 1 commits; rank 1 dies (os._exit) while step 2 drains. Rank 0 (alive) writes to
    ``report``: what its wait raised, whether step 2's writer record says failed, and what
    ``unickpt prune`` (run by rank 0 itself, the live writer) removes."""
    import json
    import os

    from unickpt.lifecycle.root import prune_checkpoints

    rank = dist.get_rank()
    ck = unickpt.Checkpointer(root, async_save=True)
    ck.save(1, state(1)).wait()
    handle = ck.save(2, {"w": unickpt.Shard(torch.ones(1 << 20), (2 << 20,), offsets=(rank << 20,))})
    if rank == 1:
        os._exit(3)
    try:
        handle.wait(timeout=120)
        error = "no error"
    except unickpt.SaveFailedError as e:
        error = f"SaveFailedError: {e}"
    step2 = os.path.join(root, "step_2")
    record = json.loads(open(os.path.join(step2, ".unickpt-writer")).read()) if os.path.isdir(step2) else None
    removed = [(r.step, r.reason) for r in prune_checkpoints(root, 1)]
    with open(report, "w") as f:
        json.dump({"error": error, "record_failed": record and record.get("failed"),
                   "record_pid_is_mine": record and record.get("pid") == os.getpid(), "removed": removed,
                   "left": sorted(os.listdir(root))}, f)


def short_index_write(root: str) -> dict:
    """A DTensor split over both ranks (format v2: each rank writes ``index/<rank>.idx``); rank 1's index
    file of step 2 is cut to half by a lying disk: the save fails on every rank before the commit, and
    retention (keep_last=1) keeps step 1, which loads bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = lambda step: torch.arange(64 * 100, dtype=torch.float32).reshape(64, 100) * step  # noqa: E731
    cut = Fault("write", match="*/step_2/index/*", action="truncate", keep=0.5, enabled=False)
    uninstall = install(cut) if dist.get_rank() == 1 else (lambda: None)
    try:
        ck = unickpt.Checkpointer(root, keep_last=1, async_save=False)
        ck.save(1, {"t": distribute_tensor(full(1), mesh, [Shard(0)])})
        cut.enabled = True
        try:
            ck.save(2, {"t": distribute_tensor(full(2), mesh, [Shard(0)])})
            error = None
        except unickpt.SaveFailedError as e:
            error = str(e)
        cut.enabled = False
        back = distribute_tensor(torch.zeros(64, 100), mesh, [Shard(0)])
        step = ck.load({"t": back})
        ck.close()
    finally:
        uninstall()
    return {"fired": cut.fired, "error": error, "step": step, "equal": torch.equal(back.full_tensor(), full(1))}


def load_with_rank1_metadata_read_failing(root: str) -> list:
    """Rank 1's reads of metadata.json fail with EIO: every rank raises a StorageError naming the file
    (the failing rank its own, the others the same type naming rank 1), and nothing is loaded."""
    fault = Fault("read", match="*metadata.json", nth=None, errno=errno.EIO)
    uninstall = install(fault) if dist.get_rank() == 1 else (lambda: None)
    r, n = dist.get_rank(), dist.get_world_size()
    out = {"w": unickpt.Shard(torch.zeros(N), (n * N,), offsets=(r * N,)), "step": -1}
    try:
        unickpt.load(f"{root}/step_1", out)
        error = None
    except Exception as e:  # noqa: BLE001 - compared by the test
        error = (type(e).__name__, str(e))
    finally:
        uninstall()
    return [error, out["step"], bool(out["w"].tensor.any())]
