"""Tier 1: each memory save is copied, in the background, into the shared memory of a rank on another
node (:mod:`.placement`), point to point on a private gloo group, off the training thread.

Threads (per rank, daemon): the **send thread** sends this rank's memory copies to its holder; the
**receive thread** receives its senders' copies into this node's memory directory. No collective.

The schedule is deterministic, so that no thread waits for a message nobody will send: every memory
step ``N`` of the schedule (``Tiers.memory_save`` calls :meth:`PeerCopier.schedule` on every rank for
the same steps) is one exchange per (sender, holder) pair, in step order:

1. sender -> holder: a header ``[N, status, manifest bytes]`` (``status``: copied, skipped, failed).
   The sender waits for its save of ``N`` to commit first; a save that failed or was skipped, or a
   copy that a newer committed save makes moot while it waits (the sender is behind), sends the
   header alone.
2. sender -> holder: the manifest (JSON ``[[relative path, bytes], ...]``, ``metadata.json`` last).
3. holder -> sender: a reply, 1 to accept, 0 to refuse (no room: ``TierOptions.memory_limit_bytes``
   or the tmpfs is full; the holder reserves every file with ``posix_fallocate`` before it accepts,
   so a full tmpfs is a refusal, never a SIGBUS in the middle of a copy).
4. sender -> holder: the files, each straight from the sender's tmpfs pages (mapped, no copy) into
   the holder's (mapped), into ``peer/rank_<q>_of_<W>/.incoming-<N>/``, renamed to ``step_<N>`` when
   whole: a half-received copy is never a committed one.

A transfer failure (a peer died, a message out of order) stops this rank's peer copying with an
error in the log (:attr:`PeerCopier.broken`): the memory tier keeps working without tier 1.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from .node_dirs import SENDING_DIR, MemoryLayout, copy_files, remove_tree

__all__ = ["PeerCopier", "map_file", "reserve_file", "COPIED", "SKIPPED", "FAILED"]

log = logging.getLogger("unickpt")

COPIED, SKIPPED, FAILED = 0, 1, 2
HEADER_TAG, MANIFEST_TAG, REPLY_TAG, DATA_TAG = 0x7101, 0x7102, 0x7103, 0x7104


def map_file(path: str, size: int) -> torch.Tensor:
    """The first ``size`` bytes of the file ``path`` as a shared mapping (uint8), no copy."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def reserve_file(path: str, size: int) -> None:
    """Create ``path`` with ``size`` bytes allocated (``posix_fallocate``: raises OSError ENOSPC now,
    rather than a SIGBUS at the first write into a mapping of a full tmpfs)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


class _Jobs:
    """A FIFO of jobs with a count of those not finished (for :meth:`PeerCopier.wait_idle`)."""

    def __init__(self) -> None:
        self.items: deque = deque()
        self.cond = threading.Condition()
        self.unfinished = 0

    def put(self, item: Any) -> None:
        with self.cond:
            self.items.append(item)
            if item is not None:
                self.unfinished += 1
            self.cond.notify_all()

    def get(self) -> Any:
        with self.cond:
            while not self.items:
                self.cond.wait()
            return self.items.popleft()

    def done(self) -> None:
        with self.cond:
            self.unfinished -= 1
            self.cond.notify_all()

    def newer_copy_queued(self) -> bool:
        with self.cond:
            return any(it is not None and it[1] is not None for it in self.items)

    def wait_idle(self, timeout: float | None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.unfinished == 0, timeout)


class PeerCopier:
    """This rank's side of tier 1 (see the module docstring).

    Args:
        group: the private gloo group of the peer copies; ``ranks``: the global rank of each group rank.
        rank: this group rank; ``world_size``: the group's size (names the copies' directories).
        holder: the group rank holding this rank's copies (None: no peer tier).
        senders: the group ranks whose copies this rank holds.
        layout: this node's memory directory.
        may_hold: ``may_hold(sender, nbytes)``: whether this rank may take a copy of ``nbytes`` more
            (the memory bound); called on the receive thread.
        on_received: ``on_received(sender)``, on the receive thread after a copy landed (retention).
    """

    def __init__(self, group: Any, ranks: list[int], rank: int, world_size: int, holder: int | None,
                 senders: list[int], layout: MemoryLayout, may_hold: Callable[[int, int], bool],
                 on_received: Callable[[int], None] = lambda sender: None):
        self.group, self.ranks, self.rank, self.world_size = group, ranks, rank, world_size
        self.holder, self.senders, self.layout = holder, list(senders), layout
        self.may_hold, self.on_received = may_hold, on_received
        self.sent_newest = -1  # newest step whose copy the holder has accepted and received
        self.held_newest: dict[int, int] = {s: -1 for s in self.senders}
        self.bytes_sent = self.bytes_received = 0
        self.send_s = self.recv_s = 0.0
        self.broken: str | None = None
        self.sending: str | None = None  # the copy the send thread is reading (retention leaves it)
        self._sends, self._recvs = _Jobs(), _Jobs()
        self._threads = []
        if holder is not None:
            self._threads.append(threading.Thread(target=self._loop, args=(self._sends, self._send_one),
                                                  name="unickpt-peer-send", daemon=True))
        if self.senders:
            self._threads.append(threading.Thread(target=self._loop, args=(self._recvs, self._recv_one),
                                                  name="unickpt-peer-recv", daemon=True))
        for t in self._threads:
            t.start()

    @property
    def active(self) -> bool:
        return bool(self._threads) and self.broken is None

    # -- the caller's thread --------------------------------------------------------------------------
    def schedule(self, step: int, handle: Any, path: str | None) -> None:
        """Memory step ``step`` is due (every rank calls this for the same steps, in order): send this
        rank's copy once ``handle`` (its save; None: skipped) commits, and receive the senders' copies."""
        if self.holder is not None:
            self._sends.put((int(step), handle, path))
        if self.senders:
            self._recvs.put(int(step))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every scheduled copy is sent and received (or the copier broke). False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for jobs in (self._sends, self._recvs):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not jobs.wait_idle(left):
                return False
        return True

    def close(self, timeout: float = 60.0) -> bool:
        """Finish the scheduled copies (at most ``timeout`` seconds), then stop the threads. Returns
        False if a thread is still blocked (a peer that is gone; the daemon thread is abandoned)."""
        idle = self.wait_idle(timeout)
        for jobs in (self._sends, self._recvs):
            jobs.put(None)
        for t in self._threads:
            t.join(timeout=5 if idle else 0.1)
        return idle and not any(t.is_alive() for t in self._threads)

    # -- the threads ----------------------------------------------------------------------------------
    def _loop(self, jobs: _Jobs, serve: Callable[[Any], None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                if self.broken is None:
                    serve(job)
            except BaseException as e:
                if self.broken is None:
                    self.broken = f"{threading.current_thread().name}: {type(e).__name__}: {e}"
                    log.error("unickpt: peer copies (tier 1) stopped on rank %d: %s", self.ranks[self.rank], self.broken)
            finally:
                jobs.done()

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        import torch.distributed as dist

        dist.send(t, dst=self.ranks[dst], group=self.group, tag=tag)

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> None:
        import torch.distributed as dist

        dist.recv(t, src=self.ranks[src], group=self.group, tag=tag)

    def _send_one(self, job: tuple) -> None:
        step, handle, path = job
        status, files, maps = COPIED, [], []
        if handle is None:
            status = SKIPPED
        else:
            try:
                handle.wait()
            except BaseException:
                status = FAILED
        if status == COPIED and self._sends.newer_copy_queued():
            status = SKIPPED  # behind: the newer copy goes instead
        links: list[str] = []
        if status == COPIED:
            self.sending = path
            try:
                files = copy_files(path)
                # a second link per data file: in-place staging never reuses a file while it is sent
                sending = os.path.join(os.path.dirname(path), SENDING_DIR)
                os.makedirs(sending, exist_ok=True)
                for rel, _ in files:
                    if rel.startswith("data/"):
                        link = os.path.join(sending, f"{step}-{os.path.basename(rel)}")
                        if os.path.lexists(link):
                            os.remove(link)
                        os.link(os.path.join(path, rel), link)
                        links.append(link)
                maps = [map_file(os.path.join(path, rel), n) if n else None for rel, n in files]
            except (OSError, RuntimeError) as e:  # removed meanwhile (a recovery), or unreadable
                log.warning("unickpt: peer copy of %s skipped: %s", path, e)
                status, maps = FAILED, []
            finally:
                self.sending = None  # mapped and linked: a removal now leaves the pages alive
        try:
            self._send_copy(step, status, files, maps)
        finally:
            maps = []
            for link in links:
                try:
                    os.remove(link)
                except OSError:
                    pass

    def _send_copy(self, step: int, status: int, files: list, maps: list) -> None:
        """Steps 1-4 of the module docstring, sender side."""
        assert self.holder is not None
        manifest = json.dumps(files).encode() if status == COPIED else b""
        self._send(torch.tensor([step, status, len(manifest)], dtype=torch.int64), self.holder, HEADER_TAG)
        if status != COPIED:
            return
        t0 = time.perf_counter()
        self._send(torch.frombuffer(bytearray(manifest), dtype=torch.uint8), self.holder, MANIFEST_TAG)
        reply = torch.zeros(1, dtype=torch.int64)
        self._recv(reply, self.holder, REPLY_TAG)
        if int(reply.item()) != 1:
            log.warning("unickpt: rank %d refused the peer copy of step %d (no room)", self.ranks[self.holder], step)
            return
        for (rel, n), t in zip(files, maps):
            if t is not None:
                self._send(t, self.holder, DATA_TAG)
                self.bytes_sent += n
        self.send_s += time.perf_counter() - t0
        self.sent_newest = max(self.sent_newest, step)

    def _recv_one(self, step: int) -> None:
        for s in self.senders:
            header = torch.zeros(3, dtype=torch.int64)
            self._recv(header, s, HEADER_TAG)
            got, status, mlen = (int(x) for x in header.tolist())
            if got != step:
                raise RuntimeError(f"rank {self.ranks[s]} sent step {got}'s copy header, step {step} was due "
                                   "(the ranks called save with different steps)")
            if status != COPIED:
                continue
            t0 = time.perf_counter()
            raw = torch.empty(mlen, dtype=torch.uint8)
            self._recv(raw, s, MANIFEST_TAG)
            files = json.loads(raw.numpy().tobytes())
            total = sum(int(n) for _, n in files)
            root = self.layout.rank_root("peer", s, self.world_size)
            tmp = os.path.join(root, f".incoming-{step}")
            accept = self.may_hold(s, total)
            if accept:
                try:
                    remove_tree(tmp)
                    for rel, n in files:
                        reserve_file(os.path.join(tmp, rel), int(n))
                except OSError as e:
                    log.warning("unickpt: no room for rank %d's peer copy of step %d in %s: %s",
                                self.ranks[s], step, root, e)
                    remove_tree(tmp)
                    accept = False
            self._send(torch.tensor([1 if accept else 0], dtype=torch.int64), s, REPLY_TAG)
            if not accept:
                continue
            for rel, n in files:
                if n:
                    t = map_file(os.path.join(tmp, rel), int(n))
                    self._recv(t, s, DATA_TAG)
                    del t
                    self.bytes_received += int(n)
            final = os.path.join(root, f"step_{step}")
            remove_tree(final)
            os.rename(tmp, final)
            self.recv_s += time.perf_counter() - t0
            self.held_newest[s] = max(self.held_newest[s], step)
            self.on_received(s)
