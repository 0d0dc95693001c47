"""Two jobs in one test: a "training" job and an "inference" job, each a group of processes with its own
``torch.distributed`` world (gloo, CPU), joined only by the weight sync's rendezvous address."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, job: str, rank: int, world: int, init: str, args: tuple, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        out.put((job, rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((job, rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run_jobs(jobs: dict[str, tuple[Callable, int, tuple]], timeout: float = 240.0,
             allow_exit: frozenset = frozenset()) -> dict[str, list]:
    """Run each job ``name -> (fn, world size, args)`` (``fn(rank, world, *args)`` in every process);
    returns ``name -> [result per rank]``. Raises AssertionError with the failing rank's traceback. Ranks
    in ``allow_exit`` (``(job, rank)``) may die without a result (a test's crash)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    tmp = tempfile.mkdtemp(prefix="unickpt-sync-")
    for name, (fn, world, args) in jobs.items():
        init = f"file://{tmp}/{name}.init"
        for r in range(world):
            p = ctx.Process(target=_entry, args=(fn, name, r, world, init, args, out), daemon=True)
            p.start()
            procs.append((name, r, p))
    expected = sum(w for _, w, _ in jobs.values()) - len(allow_exit)
    results: dict[str, list] = {name: [None] * w for name, (_, w, _) in jobs.items()}
    errors = []
    import queue
    got = 0
    try:
        while got < expected:
            try:
                job, rank, status, value = out.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"jobs timed out after {timeout} s; results so far: {results}") from None
            got += (job, rank) not in allow_exit
            if status == "error":
                errors.append(f"[{job} rank {rank}] {value}")
            results[job][rank] = value
    finally:
        for _, _, p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return results
