"""``DistPool``: N long-lived CPU processes in one gloo process group, for tests and benchmarks.

Starting processes and importing torch costs seconds, so a pool is started once and runs many
functions: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank (``fn`` must be importable:
a module-level function) and returns the list of results by rank. An exception on any rank
becomes :class:`RemoteError` carrying every failed rank's traceback; a rank that does not answer
within ``timeout_s`` gets the pool killed (a hung collective cannot be recovered).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

__all__ = ["DistPool", "RemoteError"]


class RemoteError(RuntimeError):
    """A function failed on one or more ranks of a :class:`DistPool`.

    Attributes:
        failures: ``{rank: (exception type name, message, formatted traceback)}``.
    """

    def __init__(self, failures: dict[int, tuple[str, str, str]]):
        self.failures = failures
        body = "\n".join(f"--- rank {r}: {t}: {m}\n{tb}" for r, (t, m, tb) in sorted(failures.items()))
        super().__init__(f"failed on rank(s) {sorted(failures)}\n{body}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, inbox: Any, outbox: Any, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        while True:
            task = inbox.get()
            if task is None:
                break
            fn, args, kwargs = task
            try:
                outbox.put((rank, True, fn(*args, **kwargs)))
            except BaseException as e:  # report, keep serving
                outbox.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


class DistPool:
    """``world_size`` spawned processes forming a gloo process group on 127.0.0.1.

    Args:
        world_size: number of ranks (processes).
        timeout_s: per-call deadline, and the process group's collective timeout.
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_worker_main, args=(r, world_size, port, self._inboxes[r], self._outbox, timeout_s),
                        daemon=True, name=f"unickpt-rank{r}")
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; results by rank. Raises RemoteError."""
        for box in self._inboxes:
            box.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str, str]] = {}
        deadline = time.monotonic() + self.timeout_s
        dead: list[int] = []
        while len(results) + len(failures) < self.world_size - len(dead):
            try:
                rank, ok, value = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if not dead:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    if dead:  # give the survivors a moment to report how the death hit them
                        deadline = min(deadline, time.monotonic() + 15.0)
                if time.monotonic() > deadline:
                    break
                continue
            (results if ok else failures)[rank] = value
        if dead or len(results) + len(failures) < self.world_size:
            self.close(kill=True)
            why = f"rank(s) {dead} died" if dead else f"not all ranks finished within {self.timeout_s} s"
            raise TimeoutError(f"{fn.__name__}: {why}; the pool was killed")
        if failures:
            raise RemoteError(failures)
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        for p, box in zip(self._procs, self._inboxes):
            if p.is_alive() and not kill:
                box.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 30)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
