"""The storage interface: :class:`StorageBackend` (a path selects a backend: :mod:`.registry`).

Call protocol: every method takes a full path (a local path, or a URL of the backend's protocol) and
is safe to call from several threads at once. Writes of checkpoint data go through
:meth:`~StorageBackend.write_file` (durable when it returns: fsynced locally, uploaded and
size-checked on object stores); the commit of a checkpoint is one :meth:`~StorageBackend.write_atomic`
of its ``metadata.json`` (the path holds exactly the new bytes or its old content, never a mix).
Reads are ranged (:meth:`~StorageBackend.read_into`) so that a load reads only the bytes it needs.
"""
from __future__ import annotations

import threading
from typing import Iterable

__all__ = ["StorageBackend"]


class StorageBackend:
    """File operations on one kind of storage (see the module docstring for the call protocol).

    Attributes:
        is_local: the bytes live in this host's file system (its page cache serves every process on
            the host; ``O_DIRECT`` and a writer process may be used). False for object stores.
        bytes_read: bytes returned by :meth:`read_bytes` and :meth:`read_into` so far (load statistics).
        retries: transient errors retried so far.
    """

    is_local: bool = False

    def __init__(self) -> None:
        self.bytes_read = 0
        self.retries = 0
        self._count_lock = threading.Lock()

    def _count(self, nbytes: int) -> None:
        with self._count_lock:
            self.bytes_read += nbytes

    # -- paths ------------------------------------------------------------------------------------
    def strip(self, path: str) -> str:
        """The path as this backend's calls take it (local: absolute, without ``file://``)."""
        raise NotImplementedError

    def join(self, *parts: str) -> str:
        raise NotImplementedError

    # -- queries ----------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists. False only when it is not there: a look that fails otherwise (an
        I/O error, permission, throttling past the retries) raises OSError, never reads as absent."""
        raise NotImplementedError

    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory (object stores: a prefix); errors as :meth:`exists`."""
        raise NotImplementedError

    def islink(self, path: str) -> bool:
        """True for a symbolic link (local storage only; object stores have none)."""
        return False

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) directly under ``path``, sorted; [] if it does not exist. A listing that
        fails otherwise raises OSError (never [] : "no checkpoint" on intact data)."""
        raise NotImplementedError

    def size(self, path: str) -> int:
        raise NotImplementedError

    def du(self, path: str) -> int:
        """Total bytes of all files under ``path``."""
        raise NotImplementedError

    # -- writes -----------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents (existing ones are fine)."""
        raise NotImplementedError

    def mkdir(self, path: str) -> None:
        """Create ``path`` whose parent must exist (so that a directory removed meanwhile by someone else
        is not brought back: raises FileNotFoundError then); an existing ``path`` is fine. Object stores
        have no directories: nothing to do."""
        raise NotImplementedError

    def write_file(self, path: str, buffers: Iterable[memoryview | bytes], *, direct: bool = False,
                   size: int | None = None) -> int:
        """Write the buffers one after another into a new file, durably. Returns bytes written.

        ``direct=True`` (local storage; ignored elsewhere): ``O_DIRECT`` writes from the caller's
        aligned buffers (see :class:`~unickpt.storage.local.DirectFile`), then truncation to ``size``
        bytes (the logical length: the last buffer may carry padding).
        """
        raise NotImplementedError

    def write_small(self, path: str, data: bytes) -> None:
        """Write a small advisory file (no fsync, not atomic): markers such as the writer record."""
        raise NotImplementedError

    def write_atomic(self, path: str, data: bytes) -> None:
        """Make ``path`` hold exactly ``data`` or leave it as it was (the commit primitive)."""
        raise NotImplementedError

    def rm(self, path: str) -> None:
        """Remove a file or a directory tree; missing paths are fine."""
        raise NotImplementedError

    # -- reads ------------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        raise NotImplementedError

    def read_into(self, path: str, ranges: list[tuple[int, int]], dest: memoryview, base: int) -> None:
        """Read each ``(file_offset, length)`` range into ``dest[file_offset - base :]``.

        Raises EOFError, naming the file's length and the length needed, if the file is shorter than
        a range (a truncated checkpoint); local files are checked before any byte is read.
        """
        raise NotImplementedError
