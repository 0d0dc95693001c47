"""Local storage: the fast path (``os`` calls only, no fsspec), and ``O_DIRECT`` writes.

Data files are written with ``os.write`` (or ``pwrite`` from aligned buffers with ``O_DIRECT``: DMA
from the staging ring, no copy into the page cache) and ``fsync``; reads are ``os.preadv`` into the
caller's buffer. The commit primitive :meth:`LocalStorage.write_atomic` writes a temporary file,
fsyncs it, ``os.replace`` s it over the target and fsyncs the directory.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from typing import Iterable

from .base import StorageBackend

__all__ = ["LocalStorage", "DirectFile", "DIRECT_ALIGN"]

DIRECT_ALIGN = 4096  # O_DIRECT offset / length / address alignment used (covers 512 and 4096 B sectors)


class LocalStorage(StorageBackend):
    """A local file system (see the module docstring)."""

    is_local = True

    def strip(self, path: str) -> str:
        path = os.fspath(path)
        for prefix in ("file://", "local://"):
            if path.startswith(prefix):
                path = path[len(prefix):]
                break
        return os.path.abspath(path)

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    # -- queries ----------------------------------------------------------------------------------
    def _stat(self, path: str) -> os.stat_result | None:
        """``os.stat``, None when the path is not there; other errors (EIO, EACCES, ELOOP) raise:
        unlike ``os.path.exists``, a failing look is never "absent"."""
        try:
            return os.stat(self.strip(path))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def exists(self, path: str) -> bool:
        return self._stat(path) is not None

    def isdir(self, path: str) -> bool:
        st = self._stat(path)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def islink(self, path: str) -> bool:
        return os.path.islink(self.strip(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.strip(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, path: str) -> int:
        return os.path.getsize(self.strip(path))

    def du(self, path: str) -> int:
        total = 0
        for dirpath, _, files in os.walk(self.strip(path)):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
        return total

    # -- writes -----------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        os.makedirs(self.strip(path), exist_ok=True)

    def mkdir(self, path: str) -> None:
        try:
            os.mkdir(self.strip(path))
        except FileExistsError:
            pass

    def write_file(self, path: str, buffers: Iterable[memoryview | bytes], *, direct: bool = False,
                   size: int | None = None) -> int:
        if direct:
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
        total = 0
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

    def write_small(self, path: str, data: bytes) -> None:
        with open(self.strip(path), "wb") as f:
            f.write(data)

    def write_atomic(self, path: str, data: bytes) -> None:
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
        """Remove a file or a directory tree (a symbolic link itself, never its target). Entries that
        vanish meanwhile (another process removing the same tree) are fine; other errors raise."""
        p = self.strip(path)

        def gone_is_fine(func, name, exc_info):
            if not issubclass(exc_info[0], FileNotFoundError):
                raise exc_info[1]

        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, onerror=gone_is_fine)
        else:
            try:
                os.remove(p)
            except FileNotFoundError:
                pass

    # -- reads ------------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        with open(self.strip(path), "rb") as f:
            data = f.read()
        self._count(len(data))
        return data

    def read_into(self, path: str, ranges: list[tuple[int, int]], dest: memoryview, base: int) -> None:
        dest = dest.cast("B")
        fd = os.open(self.strip(path), os.O_RDONLY)
        try:
            need = max((off + length for off, length in ranges), default=0)
            have = os.fstat(fd).st_size
            if need > have:  # checked before reading: a truncated file never reads back partly
                raise EOFError(f"{path}: the file holds {have} bytes, the checkpoint needs {need} "
                               "(the file is truncated)")
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


class DirectFile:
    """A local file written sequentially with ``O_DIRECT`` (DMA from the caller's buffers, no copy
    into the page cache), then truncated to its logical size and fsynced.

    Buffers handed to :meth:`write` must start at a :data:`DIRECT_ALIGN`-aligned address, and
    every write but the last must be a multiple of it (the staging ring guarantees both: segment
    bases are granule-aligned and blocks are cut at aligned positions). Where the file system
    refuses ``O_DIRECT`` (tmpfs, some FUSE mounts) the file is written buffered instead.
    Used by :meth:`LocalStorage.write_file` with ``direct=True``.
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
