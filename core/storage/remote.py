"""Remote storage through fsspec (``s3://``, ``gs://``, ``hdfs://``, ``memory://``, ...).

Every call is retried on transient errors (:mod:`unickpt.storage.retry`). A data file is one
upload (multipart for large files on object stores), then its size is checked against what was
sent. The commit primitive is a single put of ``metadata.json``, atomic per object on object stores.
"""
from __future__ import annotations

import errno
import posixpath
from typing import Iterable

import fsspec

from ..options import env
from .base import StorageBackend
from .retry import retrying

__all__ = ["FsspecStorage"]


class FsspecStorage(StorageBackend):
    """Any fsspec file system (see the module docstring).

    Args:
        url: any path or URL under the checkpoint root (selects the file system).
        storage_options: keyword arguments for the fsspec file system (credentials, endpoint).
        retry_total_s: bound of the retries of one call, seconds (default: ``UNICKPT_RETRY_TOTAL_S``, 120).
    """

    is_local = False

    def __init__(self, url: str, storage_options: dict | None = None, retry_total_s: float | None = None):
        super().__init__()
        self.retry_total_s = env().retry_total_s if retry_total_s is None else retry_total_s
        self.fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))

    def _remote(self, what: str, path: str, fn, *args, **kwargs):
        def counted() -> None:
            self.retries += 1
        return retrying(what, path, self.retry_total_s, fn, *args, on_retry=counted, **kwargs)

    def strip(self, path: str) -> str:
        return path

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    # -- queries ----------------------------------------------------------------------------------
    def _info(self, path: str) -> dict | None:
        """fsspec's ``info`` (retried), None when not found. Not ``fs.exists`` / ``fs.isdir``: they
        read any error (a throttled HEAD, a permission error) as "absent"."""
        try:
            return self._remote("info", path, self.fs.info, path)
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        return self._info(path) is not None

    def isdir(self, path: str) -> bool:
        info = self._info(path)
        return info is not None and info.get("type") == "directory"

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self._remote("ls", path, self.fs.ls, path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def size(self, path: str) -> int:
        return int(self._remote("size", path, self.fs.size, path))

    def du(self, path: str) -> int:
        return int(self._remote("du", path, self.fs.du, path, total=True))

    # -- writes -----------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        self._remote("makedirs", path, self.fs.makedirs, path, exist_ok=True)

    def mkdir(self, path: str) -> None:
        self.makedirs(path)

    def write_file(self, path: str, buffers: Iterable[memoryview | bytes], *, direct: bool = False,
                   size: int | None = None) -> int:
        buffers = list(buffers)  # a retry rewrites the object from the start

        def upload() -> int:
            n = 0
            with self.fs.open(path, "wb") as f:  # object stores: multipart upload of large files
                for buf in buffers:
                    f.write(buf)
                    n += memoryview(buf).nbytes
            return n

        total = self._remote("write", path, upload)
        stored = self.size(path)
        if stored != total:
            raise OSError(errno.EIO, f"{path}: uploaded {total} bytes, the store holds {stored}")
        return total

    def write_small(self, path: str, data: bytes) -> None:
        self._remote("write", path, self.fs.pipe_file, path, data)

    def write_atomic(self, path: str, data: bytes) -> None:
        self._remote("write", path, self.fs.pipe_file, path, data)

    def rm(self, path: str) -> None:
        if self.exists(path):
            self._remote("rm", path, self.fs.rm, path, recursive=True)

    # -- reads ------------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        data = self._remote("read", path, self.fs.cat_file, path)
        self._count(len(data))
        return data

    def read_into(self, path: str, ranges: list[tuple[int, int]], dest: memoryview, base: int) -> None:
        dest = dest.cast("B")
        for off, length in ranges:
            data = self._remote("read", path, self.fs.cat_file, path, start=off, end=off + length)
            if len(data) != length:
                raise EOFError(f"{path}: wanted {length} bytes at {off}, got {len(data)}")
            dest[off - base : off - base + length] = data
            self._count(length)
