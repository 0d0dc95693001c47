"""Joining a training job and an inference job: the rendezvous store, subscriber generations and the
process group both jobs share.

The two jobs are launched separately (each with its own ``torch.distributed`` world, or none) and meet
at one TCP store (``"host:port"``; the publisher's rank 0 hosts it, every other process connects to it).

**Generations.** Each time an inference job joins (at its first receive, or again after a failed
version) its rank 0 registers a new generation ``g`` (one ``store.add``) with the job's size. At each
publish the training job's rank 0 looks at the newest generation (one ``store.add(key, 0)``); a newer
one than it serves is *claimed* with a ``compare_set`` of a random token (so a restarted trainer never
joins a generation another trainer already formed) and agreed by the training ranks with one all-reduce
of two integers on the training job's private gloo group (:class:`~unickpt.dist.comm.Comm`): rank 0's
choice, and whether any rank lost the current generation (a failed version), which then drops it on
every rank.
Both jobs then create the pair group of generation ``g`` over the store (prefix ``unickpt_sync/g<g>/``):
training ranks ``0..T-1``, inference ranks ``T..T+S-1``. That is how a subscriber that joins late gets
its first version, which is always full (the sender's delta history belongs to the previous generation).

A trainer that leaves a generation (a failed version, ``close()``, a layout change) marks it abandoned, and
so does a new trainer that finds the newest generation claimed by another (a restarted job: one trainer
per rendezvous address); the inference job, polling the store for the next version, sees the mark and
joins again. Each side records where its tensors are; the weights go over NCCL only when both are on CUDA.

**The pair group** is a gloo group for control messages (the layout exchange: two all-gathers; headers
and acknowledgements: one message each per pair and version) and, for the weights, the same gloo group
on the CPU or an NCCL group when the tensors are on CUDA. Neither is the training job's default group:
a sync never runs a collective on the training group.
"""
from __future__ import annotations

import secrets
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..dist.comm import Comm

__all__ = ["KEY", "open_store", "Generations", "PairGroup", "max_ints"]

KEY = "unickpt_sync"


def open_store(address: Any, host: bool, timeout_s: float) -> Any:
    """The rendezvous store: ``address`` itself when it is a ``torch.distributed.Store``, else a
    ``TCPStore`` at ``"host:port"`` hosted by this process when ``host``. Raises ValueError for an
    address without a port."""
    if isinstance(address, dist.Store):
        return address
    hostname, sep, port = str(address).rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"rendezvous address {address!r}: expected 'host:port'")
    return dist.TCPStore(hostname, int(port), None, host, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def max_ints(comm: Comm, values: list[int]) -> list[int]:
    """The element-wise maximum of every rank's ``values`` (one all-reduce of a few int64 on ``comm``'s
    private gloo group)."""
    if comm.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.plan_group)
    return [int(x) for x in t.tolist()]


class Generations:
    """The generation counter and records on the store (see the module docstring)."""

    def __init__(self, store: Any):
        self.store = store

    def register(self, size: int, device: str) -> int:
        """A new generation for an inference job of ``size`` ranks whose tensors are on ``device`` ("cpu" /
        "cuda"); its rank 0 calls this."""
        g = int(self.store.add(f"{KEY}/gen", 1))
        self.store.set(f"{KEY}/g{g}/subscriber_device", device)
        self.store.set(f"{KEY}/g{g}/subscribers", str(size))
        return g

    def newest(self) -> int:
        return int(self.store.add(f"{KEY}/gen", 0))

    def claim(self, g: int, publishers: int, device: str) -> bool:
        """True if this caller forms generation ``g`` (no other trainer has), recording its size and device."""
        token = secrets.token_hex(8)
        won = self.store.compare_set(f"{KEY}/g{g}/claimed", "", token) == token.encode()
        if won:
            self.store.set(f"{KEY}/g{g}/publisher_device", device)
            self.store.set(f"{KEY}/g{g}/publishers", str(publishers))
        return won

    def data_device(self, g: int) -> str:
        """Where generation ``g``'s weights travel: "cuda" (NCCL) when both jobs hold them on CUDA, else
        "cpu" (gloo; a CUDA side stages through host buffers). Both records exist once ``g`` is claimed."""
        both = {self.store.get(f"{KEY}/g{g}/{side}_device").decode() for side in ("publisher", "subscriber")}
        return "cuda" if both == {"cuda"} else "cpu"

    def abandon(self, g: int) -> None:
        """The trainer's mark: it left generation ``g`` (a failed version, a layout change, ``close()``, or a
        newer trainer took over); its inference job joins again instead of waiting for versions."""
        self.store.set(f"{KEY}/g{g}/abandoned", "1")

    def abandoned(self, g: int) -> bool:
        return bool(self.store.check([f"{KEY}/g{g}/abandoned"]))

    def subscribers(self, g: int, timeout_s: float) -> int:
        self.store.wait([f"{KEY}/g{g}/subscribers"], timedelta(seconds=timeout_s))
        return int(self.store.get(f"{KEY}/g{g}/subscribers"))

    def publishers(self, g: int, timeout_s: float) -> int:
        """The training job's size for generation ``g``, once a trainer claimed it (TimeoutError otherwise)."""
        try:
            self.store.wait([f"{KEY}/g{g}/publishers"], timedelta(seconds=timeout_s))
        except RuntimeError as e:  # DistStoreError: the store's timeout
            raise TimeoutError(f"no trainer joined weight-sync generation {g} within {timeout_s:g} s") from e
        return int(self.store.get(f"{KEY}/g{g}/publishers"))

    def announce(self, g: int, seq: int, version: int) -> None:
        """The trainer's rank 0: the ``seq``-th version of generation ``g`` (``version``) is on its way."""
        self.store.set(f"{KEY}/g{g}/seq{seq}", str(version))

    def announced(self, g: int, seq: int, timeout_s: float) -> int | None:
        """The version announced as the ``seq``-th of generation ``g``, or None when the trainer abandoned
        ``g``; TimeoutError when neither happens within ``timeout_s``. The store is polled (every 10-50 ms),
        not the pair group: a gloo receive that times out closes its connection."""
        key, gone = f"{KEY}/g{g}/seq{seq}", f"{KEY}/g{g}/abandoned"
        deadline, pause = time.monotonic() + timeout_s, 0.01
        while True:
            if self.store.check([key]):
                return int(self.store.get(key))
            if self.store.check([gone]):
                return None
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no weight version published within {timeout_s:g} s")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)

    def close(self, g: int) -> None:
        """Mark generation ``g`` ended by its inference job (the trainer drops it at its next publish)."""
        self.store.set(f"{KEY}/g{g}/closed", "1")

    def closed(self, g: int) -> bool:
        return bool(self.store.check([f"{KEY}/g{g}/closed"]))


class PairGroup:
    """The process group of one generation: ``size`` ranks, training ranks first.

    Args:
        store, g: the rendezvous store and the generation.
        rank, size: this process's rank in the pair group and its size.
        device: where the weights live (``cuda`` selects NCCL for them).
        timeout_s: deadline of the group's creation and of each message.
    """

    def __init__(self, store: Any, g: int, rank: int, size: int, device: torch.device, timeout_s: float):
        self.rank, self.size, self.device = rank, size, device
        self.timeout = timedelta(seconds=timeout_s)
        prefix = dist.PrefixStore(f"{KEY}/g{g}/", store)
        # backend objects, used directly (they are not registered with torch.distributed's default world);
        # typed Any: torch's stubs omit their point-to-point methods
        self.control: Any = dist.ProcessGroupGloo(dist.PrefixStore("control/", prefix), rank, size, self.timeout)
        if device.type == "cuda":  # pragma: no cover - needs a GPU
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.data: Any = dist.ProcessGroupNCCL(dist.PrefixStore("data/", prefix), rank, size, opts)
        else:
            self.data = self.control

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (two all-gathers on the control group: the lengths, then the padded bytes)."""
        n = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.empty_like(n) for _ in range(self.size)]
        self.control.allgather([lengths], [n]).wait(self.timeout)
        sizes = [int(x.item()) for x in lengths]
        width = max(sizes + [1])
        buf = torch.zeros(width, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(buf) for _ in range(self.size)]
        self.control.allgather([out], [buf]).wait(self.timeout)
        return [o[:k].numpy().tobytes() for o, k in zip(out, sizes)]

    def send_control(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        return self.control.send([t], dst, tag)

    def recv_control(self, t: torch.Tensor, src: int, tag: int) -> Any:
        return self.control.recv([t], src, tag)

    def send_data(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        return self.data.send([t], dst, tag)

    def recv_data(self, t: torch.Tensor, src: int, tag: int) -> Any:
        return self.data.recv([t], src, tag)

    def close(self) -> None:
        """Drop the group: its connections close, so a peer blocked on this process fails instead of hanging."""
        for pg in {id(self.control): self.control, id(self.data): self.data}.values():
            abort = getattr(pg, "abort", None)
            try:
                if abort is not None:
                    abort()
            except (RuntimeError, NotImplementedError):  # already broken, or a backend without abort
                pass
        self.control = self.data = None
