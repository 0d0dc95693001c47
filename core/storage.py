"""Storage: fsspec for every backend, with a fast path for local disk.

Paths are strings: a local path (``/ckpt/run1``) or an fsspec URL (``s3://bucket/run1``,
``memory://x``). The local path writes with ``os.write`` + ``fsync`` and reads with ``os.pread``;
other protocols use the fsspec filesystem (``storage_options`` passed through).

Commit primitive: :meth:`Storage.write_atomic` (local: temp file, fsync, ``os.replace``, fsync of
the directory; object stores: a single put, which is atomic per object there).

Remote operations are retried on transient errors (connection resets, timeouts, throttling) with
exponential backoff (0.1 s doubling, at most 5 s apart) for at most ``retry_total_s`` seconds in all
(``UNICKPT_RETRY_TOTAL_S``, default 120); permanent errors (missing file, permission denied, bad
request) fail at once.
"""
from __future__ import annotations

import errno
import logging
import os
import posixpath
import time
import threading
import uuid
from typing import Iterable

import fsspec

__all__ = ["Storage", "DirectFile", "DIRECT_ALIGN", "is_transient"]

DIRECT_ALIGN = 4096  # O_DIRECT offset / length / address alignment used (covers 512 and 4096 B sectors)

log = logging.getLogger("unickpt")

_TRANSIENT_ERRNOS = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EAGAIN,
                     errno.EBUSY, errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH}
_TRANSIENT_WORDS = ("throttl", "slow down", "slowdown", "timeout", "timed out", "temporarily", "connection reset",
                    "service unavailable", "internal error", "503", "500 ")


def is_transient(e: BaseException) -> bool:
    """Whether a storage error is worth retrying (network hiccups, throttling, 5xx), not a permanent
    one (missing object, permission, bad request)."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in _TRANSIENT_WORDS)


class Storage:
    """File operations rooted nowhere in particular; every method takes a full path.

    Args:
        url: any path or URL under the checkpoint root (selects the backend).
        storage_options: keyword arguments for the fsspec filesystem (credentials, endpoint).
    """

    def __init__(self, url: str, storage_options: dict | None = None, retry_total_s: float | None = None):
        url = os.fspath(url)
        self.retry_total_s = float(os.environ.get("UNICKPT_RETRY_TOTAL_S", "120")) if retry_total_s is None \
            else retry_total_s
        self.retries = 0  # transient errors retried
        self.fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.is_local = "file" in protocols or "local" in protocols
        self.bytes_read = 0  # by read_into and read_bytes, for load statistics
        self._count_lock = threading.Lock()

    def _count(self, nbytes: int) -> None:
        with self._count_lock:
            self.bytes_read += nbytes

    def _remote(self, what: str, path: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` with retries of transient errors (see the module docstring)."""
        deadline = time.monotonic() + self.retry_total_s
        delay = 0.1
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if not is_transient(e) or time.monotonic() + delay > deadline:
                    raise
                self.retries += 1
                log.warning("unickpt: %s %s failed (%s: %s); retrying in %.1f s", what, path, type(e).__name__, e, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def strip(self, path: str) -> str:
        path = os.fspath(path)
        return os.path.abspath(self.fs._strip_protocol(path)) if self.is_local else path

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts) if not self.is_local else os.path.join(*parts)

    # -- queries --------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return os.path.exists(self.strip(path)) if self.is_local else self._remote("exists", path, self.fs.exists, path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(self.strip(path)) if self.is_local else self._remote("isdir", path, self.fs.isdir, path)

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) directly under ``path``; [] if it does not exist."""
        if self.is_local:
            p = self.strip(path)
            return sorted(os.listdir(p)) if os.path.isdir(p) else []
        try:
            entries = self._remote("ls", path, self.fs.ls, path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def size(self, path: str) -> int:
        return os.path.getsize(self.strip(path)) if self.is_local else int(self._remote("size", path, self.fs.size, path))

    def du(self, path: str) -> int:
        """Total bytes of all files under ``path``."""
        if self.is_local:
            total = 0
            for dirpath, _, files in os.walk(self.strip(path)):
                total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
            return total
        return int(self._remote("du", path, self.fs.du, path, total=True))

    # -- writes ---------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        if self.is_local:
            os.makedirs(self.strip(path), exist_ok=True)
        else:
            self._remote("makedirs", path, self.fs.makedirs, path, exist_ok=True)

    def write_file(self, path: str, buffers: Iterable[memoryview | bytes], *, direct: bool = False,
                   size: int | None = None) -> int:
        """Write the buffers one after another into a new file, durably. Returns bytes written.

        ``direct=True`` (local paths only; ignored elsewhere): write with ``O_DIRECT`` (DMA from the
        caller's buffers, no copy into the page cache; see :class:`DirectFile` for the alignment the
        buffers need), then truncate the file to ``size`` bytes (the logical length: the last
        buffer may carry padding up to the alignment). Where the file system refuses ``O_DIRECT``
        (tmpfs, some FUSE mounts) the same bytes are written buffered.
        """
        total = 0
        if self.is_local and direct:
            if size is None:
                raise ValueError(f"{path}: a direct write needs the file's logical size")
            f = DirectFile(self.strip(path), size)
            ok = False
            try:
                for buf in buffers:
                    f.write(memoryview(buf))
                ok = True
            finally:
                f.close(ok)
            return size
        if self.is_local:
            fd = os.open(self.strip(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for buf in buffers:
                    view = memoryview(buf).cast("B")
                    while view:
                        n = os.write(fd, view)
                        total += n
                        view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
            return total
        buffers = list(buffers)  # a retry rewrites the object from the start

        def upload() -> int:
            n = 0
            with self.fs.open(path, "wb") as f:  # object stores: multipart upload of large files
                for buf in buffers:
                    f.write(buf)
                    n += memoryview(buf).nbytes
            return n

        total = self._remote("write", path, upload)
        size = self.size(path)
        if size != total:
            raise OSError(errno.EIO, f"{path}: uploaded {total} bytes, the store holds {size}")
        return total

    def write_small(self, path: str, data: bytes) -> None:
        """Write a small advisory file (no fsync, not atomic): markers such as the writer record."""
        if self.is_local:
            with open(self.strip(path), "wb") as f:
                f.write(data)
        else:
            self._remote("write", path, self.fs.pipe_file, path, data)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Make ``path`` hold exactly ``data`` or leave it as it was (the commit primitive)."""
        if not self.is_local:
            self._remote("write", path, self.fs.pipe_file, path, data)
            return
        final = self.strip(path)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        self.write_file(tmp, [data])
        os.replace(tmp, final)
        dfd = os.open(os.path.dirname(final), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def rm(self, path: str) -> None:
        """Remove a file or a directory tree; missing paths are fine."""
        if self.is_local:
            import shutil

            p = self.strip(path)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=False)
            elif os.path.exists(p):
                os.remove(p)
            return
        if self.exists(path):
            self._remote("rm", path, self.fs.rm, path, recursive=True)

    # -- reads ----------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        if self.is_local:
            with open(self.strip(path), "rb") as f:
                data = f.read()
        else:
            data = self._remote("read", path, self.fs.cat_file, path)
        self._count(len(data))
        return data

    def read_into(self, path: str, ranges: list[tuple[int, int]], dest: memoryview, base: int) -> None:
        """Read each ``(file_offset, length)`` range into ``dest[file_offset - base :]``.

        Raises :class:`EOFError` if the file is shorter than a range (a truncated checkpoint).
        """
        dest = dest.cast("B")
        if self.is_local:
            fd = os.open(self.strip(path), os.O_RDONLY)
            try:
                for off, length in ranges:
                    got = 0
                    while got < length:
                        n = os.preadv(fd, [dest[off - base + got : off - base + length]], off + got)
                        if n == 0:
                            raise EOFError(f"{path}: file ends before byte {off + length} (read {off + got})")
                        got += n
                    self._count(length)
            finally:
                os.close(fd)
            return
        for off, length in ranges:
            data = self._remote("read", path, self.fs.cat_file, path, start=off, end=off + length)
            if len(data) != length:
                raise EOFError(f"{path}: wanted {length} bytes at {off}, got {len(data)}")
            dest[off - base : off - base + length] = data
            self._count(length)


class DirectFile:
    """A local file written sequentially with ``O_DIRECT`` (DMA from the caller's buffers, no copy
    into the page cache), then truncated to its logical size and fsynced.

    Buffers handed to :meth:`write` must start at a :data:`DIRECT_ALIGN`-aligned address, and
    every write but the last must be a multiple of it (the staging ring guarantees both: segment
    bases are granule-aligned and blocks are cut at aligned positions). Where the file system
    refuses ``O_DIRECT`` (tmpfs, some FUSE mounts) the file is written buffered instead.
    Used by :meth:`Storage.write_file` with ``direct=True``.
    """

    def __init__(self, path: str, logical_size: int):
        self.path, self.size = path, logical_size
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        if hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError:
                self.fd = os.open(path, flags, 0o644)
        else:  # pragma: no cover - not Linux
            self.fd = os.open(path, flags, 0o644)
        self.pos = 0

    def write(self, view: memoryview) -> None:
        """Write ``view`` at the current position (its start address aligned, and its length too
        unless it is the last write; a padded last write is cut back by :meth:`close`)."""
        v = view.cast("B")
        while v.nbytes:
            try:
                n = os.pwrite(self.fd, v, self.pos)
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:  # the device wants another alignment
                    raise
                import fcntl

                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
                continue
            self.pos += n
            v = v[n:]

    def close(self, ok: bool = True) -> None:
        try:
            if ok:
                if self.pos != self.size:
                    os.ftruncate(self.fd, self.size)
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
