"""Storage faults on purpose: a backend that fails, slows, truncates or kills at a chosen operation.

:class:`FaultyStorage` wraps any :class:`~unickpt.storage.StorageBackend` and applies the
:class:`Fault` s given to it; :func:`inject` wraps every backend the process opens while it is active
(through :func:`unickpt.storage.add_wrapper`), so that a test drives the real save and load paths
against failing storage without patching any module::

    with faults.inject(Fault("write", match="*.bin", action="error", errno=errno.ENOSPC)):
        ...  # the first data-file write fails with ENOSPC

Operations (``Fault.op``): ``"write"`` (a file written through ``write_file``: data files, per-rank
objects), ``"fsync"`` (the same, failing after its bytes were written: the durability step),
``"rename"`` (``write_atomic``: the atomic replace that commits ``metadata.json`` and moves
``latest``), ``"read"`` (``read_into`` / ``read_bytes``), ``"rm"``, ``"mkdir"`` (``mkdir`` /
``makedirs``), ``"marker"`` (``write_small``: the writer record), ``"list"`` (``listdir``: a
directory listing, as an object store's LIST), ``"stat"`` (``exists`` / ``isdir`` / ``size``: a look
at one path, as an object store's HEAD; an error here is not "not found"). Actions: ``"error"`` (raise
``OSError(errno)``), ``"slow"`` (sleep ``delay_s`` first), ``"hold"`` (wait until
:meth:`Fault.release` or ``delay_s``), ``"truncate"`` (``write``: store only ``keep`` of the bytes and
report success: a lying disk), ``"kill"`` (SIGKILL this process, with ``keep`` of a file's bytes
written first for ``write``). ``after=True`` applies the action once the operation has completed
(``rename`` + ``kill``: die right after a commit). Faults apply in the process that installs them
(the writer process of ``writer="process"`` opens its own storage), to the backends opened while
they are installed: a save opens its storage at the call, the drain at each file; a
:class:`~unickpt.Checkpointer` opens its root (``latest``, retention) when it is made, so install
faults on those before making it (or arm them later: ``Fault(..., enabled=False)``).
"""
from __future__ import annotations

import contextlib
import errno as errnos
import fnmatch
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from ..storage import StorageBackend, add_wrapper

__all__ = ["Fault", "FaultyStorage", "inject", "install"]

OPS = ("write", "fsync", "rename", "read", "rm", "mkdir", "marker", "list", "stat")
ACTIONS = ("error", "slow", "hold", "truncate", "kill")


@dataclass
class Fault:
    """One fault: the ``nth`` operation ``op`` on a path matching ``match`` (fnmatch, on the full
    path) gets ``action`` (see the module docstring). ``nth=None``: every matching operation.
    ``enabled=False``: operations are neither counted nor touched until it is set (arm a fault at a
    chosen moment of a run).

    Attributes (after use): ``seen`` matching operations so far, ``fired`` times the action ran.
    """

    op: str
    match: str = "*"
    nth: int | None = 1
    action: str = "error"
    errno: int = errnos.EIO
    delay_s: float = 0.0
    keep: float = 0.5
    after: bool = False
    enabled: bool = True
    seen: int = 0
    fired: int = 0
    _gate: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Fault.op must be one of {OPS}, got {self.op!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"Fault.action must be one of {ACTIONS}, got {self.action!r}")
        if self.action == "truncate" and self.op != "write":
            raise ValueError("action 'truncate' applies to op 'write' only")

    def release(self) -> None:
        """Let operations held by a ``"hold"`` fault go on (and later ones pass at once)."""
        self._gate.set()

    def _hit(self, op: str, path: str) -> bool:
        if not self.enabled or op != self.op or not fnmatch.fnmatchcase(path, self.match):
            return False
        with self._lock:
            self.seen += 1
            hit = self.nth is None or self.seen == self.nth
            if hit:
                self.fired += 1
            return hit

    def _act(self, path: str) -> None:
        """The action of a non-``write`` operation (and the ``write`` actions but truncate)."""
        if self.action == "error":
            raise OSError(self.errno, f"{os.strerror(self.errno)} (injected: {self.op} of {path})")
        if self.action == "slow":
            time.sleep(self.delay_s)
        elif self.action == "hold":
            self._gate.wait(self.delay_s or None)
        elif self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


class FaultyStorage(StorageBackend):
    """``inner`` with ``faults`` applied (see the module docstring); every other behaviour is the inner
    backend's."""

    def __init__(self, inner: StorageBackend, faults: Iterable[Fault]):
        super().__init__()
        self.inner = inner
        self.faults = list(faults)
        self.is_local = inner.is_local

    def _before(self, op: str, path: str) -> list[Fault]:
        """Apply the matching faults that act before ``op``; return those that act later (after it, or,
        for ``write``'s truncate / kill and for ``fsync``, on the bytes inside write_file)."""
        later = []
        for f in self.faults:
            if f._hit(op, path):
                if f.after or op == "fsync" or (op == "write" and f.action in ("truncate", "kill")):
                    later.append(f)
                else:
                    f._act(path)
        return later

    @staticmethod
    def _after(faults: list[Fault], path: str) -> None:
        for f in faults:
            if f.after:
                f._act(path)

    # -- delegated, with faults -----------------------------------------------------------------
    def strip(self, path: str) -> str:
        return self.inner.strip(path)

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def _query(self, op: str, path: str, fn: Callable, *args):
        later = self._before(op, path)
        out = fn(*args)
        self._after(later, path)
        return out

    def exists(self, path: str) -> bool:
        return self._query("stat", path, self.inner.exists, path)

    def isdir(self, path: str) -> bool:
        return self._query("stat", path, self.inner.isdir, path)

    def islink(self, path: str) -> bool:
        return self.inner.islink(path)

    def listdir(self, path: str) -> list[str]:
        return self._query("list", path, self.inner.listdir, path)

    def size(self, path: str) -> int:
        return self._query("stat", path, self.inner.size, path)

    def du(self, path: str) -> int:
        return self.inner.du(path)

    def makedirs(self, path: str) -> None:
        later = self._before("mkdir", path)
        self.inner.makedirs(path)
        self._after(later, path)

    def mkdir(self, path: str) -> None:
        later = self._before("mkdir", path)
        self.inner.mkdir(path)
        self._after(later, path)

    def write_file(self, path: str, buffers: Iterable[memoryview | bytes], *, direct: bool = False,
                   size: int | None = None) -> int:
        later = self._before("write", path)
        fsync = self._before("fsync", path)
        cut = [f for f in later if not f.after and f.action in ("truncate", "kill")]
        if cut:
            data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
            if size is not None:
                data = data[:size]
            kept = data[: max(1, int(len(data) * cut[0].keep))] if data else data
            self.inner.write_file(path, [kept])
            if cut[0].action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            n = len(data)  # a lying disk: success, whole size
        else:
            n = self.inner.write_file(path, buffers, direct=direct, size=size)
        for f in fsync:  # the bytes are written; the durability step fails
            if not f.after:
                f._act(path)
        self._after(later + fsync, path)
        return n

    def write_small(self, path: str, data: bytes) -> None:
        later = self._before("marker", path)
        self.inner.write_small(path, data)
        self._after(later, path)

    def write_atomic(self, path: str, data: bytes) -> None:
        later = self._before("rename", path)
        self.inner.write_atomic(path, data)
        self._after(later, path)

    def rm(self, path: str) -> None:
        later = self._before("rm", path)
        self.inner.rm(path)
        self._after(later, path)

    def read_bytes(self, path: str) -> bytes:
        later = self._before("read", path)
        data = self.inner.read_bytes(path)
        self._count(len(data))
        self._after(later, path)
        return data

    def read_into(self, path: str, ranges: list[tuple[int, int]], dest: memoryview, base: int) -> None:
        later = self._before("read", path)
        before = self.inner.bytes_read
        self.inner.read_into(path, ranges, dest, base)
        self._count(self.inner.bytes_read - before)
        self._after(later, path)


def install(*faults: Fault) -> Callable[[], None]:
    """From now on, every backend opened in this process is a :class:`FaultyStorage` with ``faults``
    (for a whole process: a test's child script). Returns the function that uninstalls them (and
    releases what they hold)."""
    remove = add_wrapper(lambda backend: FaultyStorage(backend, faults))

    def uninstall() -> None:
        remove()
        for f in faults:
            f.release()  # nothing stays held after the faults are gone

    return uninstall


@contextlib.contextmanager
def inject(*faults: Fault) -> Iterator[list[Fault]]:
    """:func:`install` for the duration of the context. Yields the faults (to read ``seen`` /
    ``fired``, or :meth:`Fault.release` them)."""
    uninstall = install(*faults)
    try:
        yield list(faults)
    finally:
        uninstall()
