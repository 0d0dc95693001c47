"""The drain in a worker process (``SaveOptions.writer="process"``): :class:`HashWriter` runs in a
process of its own that maps the staging rings as shared memory, so that checksumming and writing
never take the training process's GIL.

The process imports no torch (:mod:`unickpt.saving.drain` and what it imports are torch-free, and
unickpt's package ``__init__`` files import nothing heavy), so it starts in a fraction of a second and
adds little memory. Rings are ``memfd`` file descriptors passed over a Unix socket (``SCM_RIGHTS``);
messages are pickled tuples between the parent and its own child (never read from storage). The
parent's reader thread turns the worker's replies into the drain's callbacks; if the worker dies,
every save in flight fails with the exit status. Items with a deferred wait (a merge receive, a CUDA
copy event) are waited for in the parent, by :class:`ProcessDrain`'s dispatcher thread, before they
are sent.
"""
from __future__ import annotations

import mmap
import os
import pickle
import queue
import socket
import struct
import sys
import threading
from typing import Any, Callable

from ..storage import open_storage
from .drain import DrainEvents, HashWriter, JobSpec, _format

__all__ = ["WriterProcess", "ProcessDrain", "worker_main", "send_msg", "recv_msg"]


def send_msg(sock: socket.socket, obj: Any, lock: threading.Lock | None = None, fds: tuple[int, ...] = ()) -> None:
    """Send one pickled message (length-prefixed), optionally passing file descriptors."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    frame = struct.pack("<I", len(data)) + data
    if lock is not None:
        lock.acquire()
    try:
        if fds:
            n = socket.send_fds(sock, [frame], list(fds))
            if n < len(frame):
                sock.sendall(frame[n:])
        else:
            sock.sendall(frame)
    finally:
        if lock is not None:
            lock.release()


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        data, got, _, _ = socket.recv_fds(sock, n - len(buf), 4)
        if not data:
            return None
        fds.extend(got)
        buf += data
    return bytes(buf)


def recv_msg(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """``(message, passed file descriptors)``, or None at end of stream."""
    fds: list[int] = []
    head = _recv_exact(sock, 4, fds)
    if head is None:
        return None
    body = _recv_exact(sock, struct.unpack("<I", head)[0], fds)
    if body is None:
        return None
    return pickle.loads(body), fds


class WriterProcess:
    """A worker process running :class:`HashWriter` on shared-memory staging rings.

    The process imports no torch (this module and what it imports are torch-free, and ``unickpt``'s
    package ``__init__`` files import nothing), so it starts in a fraction of a second and adds little
    memory. It gets the parent's ``sys.path``, so it imports the same ``unickpt``. Rings are ``memfd`` file descriptors passed over
    the socket (:meth:`map`). The parent's reader thread turns the worker's messages into the same
    callbacks as :class:`HashWriter`; if the worker dies, ``died(error_text)`` is called once.
    Items with a deferred wait are waited for in the parent (by the caller's dispatcher) before they
    are sent.
    """

    def __init__(self, *, freed: Callable, chunk: Callable, segment: Callable, done: Callable, failed: Callable,
                 died: Callable, nice: int = 0):
        import subprocess

        import json

        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        code = ("import json, sys\n"
                "sys.path[:] = json.loads(sys.argv[1])\n"
                "from unickpt.saving.writer_process import worker_main\n"
                "worker_main(int(sys.argv[2]), int(sys.argv[3]))\n")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code, json.dumps(sys.path), str(child_sock.fileno()), str(nice)],
            pass_fds=[child_sock.fileno()], close_fds=True)
        child_sock.close()
        self._sock = parent_sock
        self._lock = threading.Lock()
        self._callbacks = {"freed": freed, "chunk": chunk, "segment": segment, "done": done, "failed": failed}
        self._died = died
        self._closing = False
        self._mapped: dict[int, threading.Event] = {}
        self._reader = threading.Thread(target=self._read_loop, name="unickpt-writer-proc-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def map(self, pool: int, fd: int, size: int, timeout: float = 60.0) -> None:
        """Make ring ``pool`` (``size`` bytes of the memfd ``fd``) visible to the worker; waits for it."""
        ev = self._mapped[pool] = threading.Event()
        send_msg(self._sock, ("map", pool, size), self._lock, fds=(fd,))
        if not ev.wait(timeout) or not self.alive:
            raise RuntimeError("the unickpt writer process did not map the staging ring")

    def start_job(self, spec: JobSpec) -> None:
        send_msg(self._sock, ("start", spec), self._lock)

    def item(self, job: int, start: int, end: int, chunk: int) -> None:
        send_msg(self._sock, ("item", job, start, end, chunk), self._lock)

    def end_job(self, job: int, error: str | None = None) -> None:
        send_msg(self._sock, ("end", job, error), self._lock)

    def _read_loop(self) -> None:
        while True:
            try:
                got = recv_msg(self._sock)
            except OSError:
                got = None
            if got is None:
                break
            msg, _ = got
            if msg[0] == "mapped":
                self._mapped[msg[1]].set()
            else:
                self._callbacks[msg[0]](*msg[1:])
        if not self._closing:
            code = self.proc.wait()
            self._died(f"the unickpt writer process exited (status {code}) while saves were in flight")

    def close(self) -> None:
        self._closing = True
        try:
            send_msg(self._sock, ("exit",), self._lock)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except Exception:  # pragma: no cover - stuck worker
            self.proc.kill()
            self.proc.wait()
        self._sock.close()
        self._reader.join(timeout=10)


def worker_main(fd: int, nice: int) -> None:
    """Entry point of the writer process: serve the parent until it says exit or goes away."""
    if nice > 0:
        try:
            os.nice(nice)
        except OSError:  # pragma: no cover
            pass
    sock = socket.socket(fileno=fd)
    lock = threading.Lock()
    rings: dict[int, tuple[mmap.mmap, memoryview]] = {}

    def reply(*msg: Any) -> None:
        send_msg(sock, msg, lock)

    hw = HashWriter(lambda pool: rings[pool][1], open_storage,
                    freed=lambda *a: reply("freed", *a), chunk=lambda *a: reply("chunk", *a),
                    segment=lambda *a: reply("segment", *a), done=lambda *a: reply("done", *a),
                    failed=lambda *a: reply("failed", *a))
    while True:
        got = recv_msg(sock)
        if got is None:
            break
        msg, fds = got
        if msg[0] == "exit":
            break
        if msg[0] == "map":
            _, pool, size = msg
            old = rings.pop(pool, None)
            if old is not None:
                old[1].release()
                old[0].close()
            mm = mmap.mmap(fds[0], size)
            os.close(fds[0])
            rings[pool] = (mm, memoryview(mm))
            reply("mapped", pool)
        elif msg[0] == "start":
            hw.start_job(msg[1])
        elif msg[0] == "item":
            hw.item(*msg[1:])
        elif msg[0] == "end":
            hw.end_job(*msg[1:])
    hw.close()
    sock.close()


class ProcessDrain:
    """Hash + write in a worker process (:class:`WriterProcess`, ``writer="process"``); a dispatcher
    thread runs each piece's deferred wait here, then forwards it, keeping the order."""

    kind = "process"

    def __init__(self, events: DrainEvents, nice: int):
        e = events
        self.proc = WriterProcess(freed=e.on_freed, chunk=e.on_chunk, segment=e.on_segment, done=e.on_done,
                                  failed=e.on_failed, died=e.on_died, nice=nice)
        self._mapped: dict[int, tuple[int, int]] = {}
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._on_failed = e.on_failed
        self._thread = threading.Thread(target=self._dispatch, name="unickpt-dispatch", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        """The writer process's pid."""
        return self.proc.proc.pid

    def attach(self, pool: Any) -> None:
        """Map the staging ring ``pool`` (a memfd-backed :class:`~unickpt.saving.staging.StagingPool`)."""
        key = (pool.memfd, pool.capacity_bytes)
        if self._mapped.get(pool.index) != key:
            assert pool.memfd is not None
            self.proc.map(pool.index, pool.memfd, pool.capacity_bytes)
            self._mapped[pool.index] = key

    def start_job(self, spec: JobSpec) -> None:
        self._q.put(("start", spec))

    def item(self, job: int, start: int, end: int, chunk: int, wait: Callable | None) -> None:
        self._q.put(("item", job, start, end, chunk, wait))

    def end_job(self, job: int, error: str | None) -> None:
        self._q.put(("end", job, error))

    @property
    def alive(self) -> bool:
        return self.proc.alive

    def _dispatch(self) -> None:
        while True:
            msg = self._q.get()
            if msg is None:
                return
            try:
                if msg[0] == "start":
                    self.proc.start_job(msg[1])
                elif msg[0] == "item":
                    _, job, start, end, chunk, wait = msg
                    if wait is not None:
                        try:
                            wait()
                        except BaseException as e:
                            self._on_failed(job, _format("checksum stage (serialize)", e))
                    self.proc.item(job, start, end, chunk)
                else:
                    self.proc.end_job(msg[1], msg[2])
            except OSError:  # the worker is gone; its reader thread reports it
                pass

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)
        self.proc.close()
