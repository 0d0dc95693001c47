"""What this process has in flight: the io route's saving engine and every save not finished yet.

Process-wide (every :class:`~unickpt.lightning.UnickptCheckpointIO` shares it), so that a reader of
a path (``load_checkpoint``, ``pl_load``, a remove) waits for the saves of that path by any
instance: :func:`register` / :func:`unregister` keep ``{Lightning path: saves}``,
:func:`wait_for_saves` waits on them. The io route's saves run on one engine of this process alone
(:func:`io_engine`), closed when no save is in flight and no ``Trainer`` run is in progress
(:func:`release_io_engine`; the runs are counted by the ``Trainer._run`` wrapper of
:func:`unickpt.lightning._strategies.install`). The cleanup after an io-route save
(:func:`finish_io_save`: the staging copy, the placeholder of a save that did not publish) runs once,
from the save's done callback or from the first waiter (:func:`on_finished`, :func:`cleanup`).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from unickpt import SaveHandle, ext

from . import _pack

__all__ = ["fspath", "io_engine", "release_io_engine", "trainer_running", "run_started", "run_ended", "register",
           "unregister", "in_flight", "wait_for_saves", "on_finished", "cleanup", "finish_io_save",
           "drop_placeholder", "rm_staged"]

log = logging.getLogger("unickpt.lightning")


def fspath(path: Any) -> str:
    """``path`` as the key of a Lightning checkpoint here: a URL as it is, a local path absolute."""
    p = os.fspath(path)
    return p if "://" in p else os.path.abspath(p)


_ENGINE: list[ext.EngineHandle] = []  # the engine of io-route saves (this process alone), while saves need it
_ENGINE_LOCK = threading.Lock()
_RUNNING = [0]  # Trainer runs in progress in this process (see trainer_running)


def io_engine() -> ext.EngineHandle:
    """The engine that writes io-route saves (one process), started on first use."""
    with _ENGINE_LOCK:
        if not _ENGINE:
            _ENGINE.append(ext.new_engine(ext.THIS_PROCESS))
        return _ENGINE[0]


def release_io_engine() -> None:
    """Close the io-route engine (its threads and staging buffers) if no save is in flight and no
    Trainer is running; the next save starts a new one."""
    with _ENGINE_LOCK:
        if not _ENGINE or _RUNNING[0] > 0:
            return
        with _INFLIGHT_LOCK:
            if any(not h.done() for hs in _INFLIGHT.values() for h in hs):
                return
        engine = _ENGINE.pop()
    try:
        engine.close()
    except BaseException:  # noqa: BLE001 - every save it ran was already waited for
        log.exception("unickpt.lightning: closing the save engine failed")


def trainer_running() -> bool:
    """Whether a ``Trainer`` run (``fit`` / ``validate`` / ``test`` / ``predict``) is in progress in
    this process (counted by the wrapper that :func:`._strategies.install` puts on ``Trainer._run``)."""
    return _RUNNING[0] > 0


def run_started() -> None:
    """A ``Trainer`` run began (see :func:`trainer_running`)."""
    with _ENGINE_LOCK:
        _RUNNING[0] += 1


def run_ended() -> None:
    """A ``Trainer`` run ended; after the last one, wait for the saves in flight, then release the engine."""
    with _ENGINE_LOCK:
        _RUNNING[0] = max(0, _RUNNING[0] - 1)
        last = _RUNNING[0] == 0
    if last:  # the run's saves (also those a wrapping AsyncCheckpointIO handed over late) commit first
        with _INFLIGHT_LOCK:
            paths = list(_INFLIGHT)
        for p in paths:
            wait_for_saves(p, follow_links=False)
        release_io_engine()


_INFLIGHT: dict[str, list[SaveHandle]] = {}  # Lightning path -> saves of it not finished (every instance)
_INFLIGHT_LOCK = threading.Lock()


def register(path: str, handle: SaveHandle) -> None:
    """``handle`` saves Lightning path ``path`` (an :func:`fspath`) until :func:`unregister`."""
    with _INFLIGHT_LOCK:
        _INFLIGHT.setdefault(path, []).append(handle)


def unregister(path: str, handle: SaveHandle) -> None:
    """``handle`` (finished) no longer saves ``path``."""
    with _INFLIGHT_LOCK:
        left = [h for h in _INFLIGHT.get(path, []) if h is not handle]
        if left:
            _INFLIGHT[path] = left
        else:
            _INFLIGHT.pop(path, None)


def in_flight(path: Any) -> bool:
    """Whether a save of Lightning path ``path`` by any :class:`UnickptCheckpointIO` of this process
    has not finished."""
    with _INFLIGHT_LOCK:
        return bool(_INFLIGHT.get(fspath(path)))


def wait_for_saves(path: Any, follow_links: bool = True) -> None:
    """Wait until no save of ``path`` (and, for a symlink, of its target) started in this process by
    any :class:`UnickptCheckpointIO` is in flight. Failures are not raised here (the saving instance
    raises them); a reader then finds the previous checkpoint, or none."""
    path = fspath(path)
    paths = {path}
    if follow_links and "://" not in path:
        paths.add(os.path.realpath(path))
    while True:
        with _INFLIGHT_LOCK:
            handles = [h for p in paths for h in _INFLIGHT.get(p, [])]
        if not handles:
            return
        for h in handles:
            try:
                h._future.result()
            except BaseException:  # noqa: BLE001 - reported by the saving instance
                pass
            cleanup(h)
            _unregister_everywhere(h)


def _unregister_everywhere(handle: SaveHandle) -> None:
    with _INFLIGHT_LOCK:
        for p in [p for p, hs in _INFLIGHT.items() if handle in hs]:
            left = [h for h in _INFLIGHT[p] if h is not handle]
            if left:
                _INFLIGHT[p] = left
            else:
                del _INFLIGHT[p]


_CLEANUPS: dict[int, "_Once"] = {}  # id(handle) -> its post-save cleanup (see cleanup)


class _Once:
    """A cleanup that runs once; a second caller waits until the first one finished it."""

    def __init__(self, fn: Callable[[], None]):
        self.fn, self.lock, self.done = fn, threading.Lock(), False

    def __call__(self) -> None:
        with self.lock:
            if not self.done:
                self.done = True
                self.fn()


def on_finished(handle: SaveHandle, fn: Callable[[], None]) -> None:
    """Run ``fn`` once when ``handle`` has finished: from its done callback, or from the first waiter
    (:func:`cleanup`), whichever comes first."""
    _CLEANUPS[id(handle)] = _Once(fn)
    handle._future.add_done_callback(lambda _f: cleanup(handle))


def cleanup(handle: SaveHandle) -> None:
    """Run the cleanup of finished save ``handle`` (:func:`finish_io_save`) unless it already ran; its done
    callback and every waiter call this, so a waiter sees the outcome on storage when it returns (a
    failed save's placeholder gone)."""
    once = _CLEANUPS.get(id(handle))
    if once is not None:
        once()
        _CLEANUPS.pop(id(handle), None)


def finish_io_save(path: str, handle: SaveHandle, staged: str, options: dict | None, token: str | None,
                   published: list) -> None:
    """After an io-route save finished: drop its staging copy and its in-flight entry; if it did not
    publish, remove the placeholder it wrote (the path had no checkpoint)."""
    try:
        if token is not None and not published:
            drop_placeholder(path, options, token)
        rm_staged(staged)
    except BaseException:  # noqa: BLE001 - a callback must not raise
        log.exception("unickpt.lightning: cleaning up after the save of %s failed", path)
    finally:
        unregister(path, handle)


def drop_placeholder(path: str, options: dict | None, token: str) -> None:
    """Remove the placeholder at ``path`` if it is still the one with ``token`` (:mod:`._pack`)."""
    doc = _pack.read_placeholder(path, options)
    if doc is not None and doc.get("token") == token:
        _pack.remove_path(path, options)


def rm_staged(staged: str) -> None:
    """Remove the in-memory staging directory ``staged`` of an io-route save (if it exists)."""
    import fsspec

    mem = fsspec.filesystem("memory")
    root = mem._strip_protocol(staged)
    if mem.exists(root):
        mem.rm(root, recursive=True)

