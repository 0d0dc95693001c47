"""Two-tier saving: the upload of a local checkpoint to its remote copy (``SaveOptions.upload_to``).

Each checkpoint ``path`` is mirrored to ``upload_to/<basename(path)>``. Who does what: group rank 0's
save thread prepares the remote directory (:meth:`Uploader.prepare_target`: the same rules as the
local target); the engine's uploader thread copies each data file as soon as the drain has written
and fsynced it (:meth:`Uploader.upload_later`), while the next file is being written; the commit
thread uploads the per-rank object file (:meth:`Uploader.upload_file`) and, on group rank 0, writes
the remote ``metadata.json`` before the local one (:meth:`Uploader.commit`), so the remote copy
commits first. No collective.
"""
from __future__ import annotations

import errno
import os
import queue
import threading
import time
import traceback
from typing import Any, Callable

from ..lifecycle.directory import CheckpointDir
from ..options import SaveOptions
from ..storage import open_storage

__all__ = ["Uploader"]

COPY_BLOCK = 8 << 20  # bytes read from the local file per remote write


def remote_dir(options: SaveOptions, path: str) -> tuple[Any, str]:
    """(backend, directory) of the remote copy of the checkpoint ``path``."""
    assert options.upload_to is not None
    remote = open_storage(options.upload_to, options.upload_options)
    return remote, remote.join(options.upload_to, os.path.basename(path.rstrip("/")))


class Uploader:
    """The uploads of one engine, in the order they were asked for (one thread)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="unickpt-upload", daemon=True)
        self._thread.start()

    @staticmethod
    def prepare_target(options: SaveOptions, path: str) -> tuple[Any, str]:
        """Group rank 0, save thread: the remote directory follows the local target's rules (a committed
        one is refused, a foreign one too; an incomplete one is replaced). Returns (backend, directory)."""
        remote, rdir = remote_dir(options, path)
        CheckpointDir(remote, rdir).prepare(in_flight=lambda _: False, writer=False)
        return remote, rdir

    def upload_later(self, request: Any, progress: Any, rel: str,
                     report: Callable[[int, float, BaseException | None], None]) -> None:
        """Copy ``<request.path>/<rel>`` to the remote copy on the uploader thread, unless the save has
        failed by then; then ``report(bytes, seconds, error)`` there."""
        self._q.put((request, progress, rel, report))

    def after_uploads(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the uploader thread once every upload asked for before is done."""
        self._q.put((None, None, None, callback))

    @staticmethod
    def upload_file(request: Any, rel: str) -> int:
        """Copy ``<request.path>/<rel>`` to the remote copy now (this thread); returns bytes copied."""
        remote, rdir = remote_dir(request.options, request.path)
        dst = remote.join(rdir, *rel.split("/"))
        remote.makedirs(remote.join(rdir, *rel.split("/")[:-1]))
        storage = request.storage
        src = storage.join(request.path, *rel.split("/"))
        size = storage.size(src)

        def chunks():  # fresh buffers: a remote write_file may keep them all until it ends
            off = 0
            while off < size:
                n = min(COPY_BLOCK, size - off)
                buf = bytearray(n)
                storage.read_into(src, [(off, n)], memoryview(buf), base=off)
                yield buf
                off += n

        written = remote.write_file(dst, chunks())
        held = remote.size(dst)  # checked before the commit: a store that acknowledged more than it kept
        if held != size:
            raise OSError(errno.EIO, f"{dst}: {size} bytes were uploaded, the store holds {held} (a short write)")
        return written

    @staticmethod
    def commit(request: Any, data: bytes) -> None:
        """Group rank 0, commit thread: write the remote copy's ``metadata.json`` (its commit)."""
        remote, rdir = remote_dir(request.options, request.path)
        CheckpointDir(remote, rdir).commit(data)

    def _loop(self) -> None:
        while True:
            got = self._q.get()
            if got is None:
                return
            request, progress, rel, report = got
            if request is None:
                report()
                continue
            if progress.error is not None:
                continue
            t0 = time.perf_counter()
            try:
                n, error = self.upload_file(request, rel), None
            except BaseException as e:
                n, error = 0, e
            report(n, time.perf_counter() - t0, error)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)


def format_upload_error(e: BaseException) -> str:
    return "upload stage: " + "".join(traceback.format_exception(type(e), e, e.__traceback__))
