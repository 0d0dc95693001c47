"""Removing a folder an asynchronous save still writes into waits for that save first.

With every framework a checkpoint is complete when its save call returns, so users, tests and the
frameworks themselves remove its folder right afterwards: ``save_total_limit`` rotation, a
``tempfile.TemporaryDirectory`` around the run, ``shutil.rmtree(output_dir)`` at the end of a script.
An asynchronous unickpt save may still be writing there; removing under it races the writer
(``Directory not empty``, a folder brought back by a late file, a commit into nothing).

Plugins :func:`watch` the handle of each asynchronous save they start for a framework
(``unickpt.ext.EngineHandle.watch_removal``, which also calls :func:`install`). :func:`install`
replaces ``shutil.rmtree`` (once per process, a wrapper made with ``functools.wraps``, so
``shutil.rmtree.avoids_symlink_attacks`` is kept) by one that first waits, on the calling thread,
for the watched saves writing inside the removed path or into a folder that contains it. Paths that
hold no watched save are removed at once. Removals made by unickpt's own threads (names
``unickpt-*``: a failed save's commit thread removing what it wrote) never wait: waiting there would
wait for the save itself. A save's failure is not raised here; it stays the save's, reported by the
engine's next ``wait()`` or save (``unickpt.EarlierSaveFailedError``).

Threads: :func:`watch` runs on the framework's thread that saved; the wait runs on the thread that
removes (polling ``handle.done()`` every 5 ms). No collective. Saves not watched (``unickpt.save``
called directly, the tiers' memory copies) are not waited for.
"""
from __future__ import annotations

import functools
import os
import shutil
import threading
import time
from typing import Any, Protocol

__all__ = ["Watched", "watch", "busy_under", "wait_under", "pending", "install", "installed"]


class Watched(Protocol):
    """What :func:`watch` needs of a save's handle (:class:`unickpt.SaveHandle` has it)."""

    @property
    def path(self) -> str: ...

    def done(self) -> bool: ...


_lock = threading.Lock()
_watched: list[tuple[Watched, str]] = []  # (handle, real path of the save's directory)


def watch(handle: Watched) -> None:
    """Make removals of ``handle.path`` (or of a folder around it, or inside it) wait for the save.
    Finished saves are dropped from the list here and on every wait."""
    path = os.path.realpath(os.fspath(handle.path))
    with _lock:
        _watched[:] = [(h, p) for h, p in _watched if not h.done()] + [(handle, path)]


def _overlaps(removed: str, saved: str) -> bool:
    return saved == removed or saved.startswith(removed + os.sep) or removed.startswith(saved + os.sep)


def busy_under(path: str | os.PathLike, but: str | os.PathLike | None = None) -> list[Watched]:
    """The watched saves not finished yet whose directory is ``path``, inside it, or contains it
    (``but``: except the save into that directory). Paths are compared resolved (``os.path.realpath``): a
    folder named through a symbolic link is the same folder."""
    removed = os.path.realpath(os.fspath(path))
    skip = None if but is None else os.path.realpath(os.fspath(but))
    with _lock:
        _watched[:] = [(h, p) for h, p in _watched if not h.done()]
        return [h for h, p in _watched if p != skip and _overlaps(removed, p)]


def wait_under(path: str | os.PathLike, but: str | os.PathLike | None = None) -> None:
    """Block until :func:`busy_under` ``(path, but)`` is empty. Errors are not raised (see the module
    docstring)."""
    for handle in busy_under(path, but):
        while not handle.done():
            time.sleep(0.005)


def pending(path: str | os.PathLike | None = None) -> bool:
    """True while a watched save has not finished (``path``: one whose directory is ``path``, inside
    it or around it)."""
    if path is not None:
        return bool(busy_under(path))
    with _lock:
        _watched[:] = [(h, p) for h, p in _watched if not h.done()]
        return bool(_watched)


def _waiting(rmtree: Any) -> Any:
    @functools.wraps(rmtree)
    def rmtree_after_saves(path: Any, *args: Any, **kwargs: Any) -> Any:
        """``shutil.rmtree`` that first waits for unickpt's watched saves in flight inside ``path``
        (:mod:`unickpt.removal`)."""
        if _watched and not threading.current_thread().name.startswith("unickpt-"):
            try:
                wait_under(os.fsdecode(os.fspath(path)))
            except TypeError:  # a file descriptor (rmtree's dir_fd forms), or something that is no path
                pass
        return rmtree(path, *args, **kwargs)

    rmtree_after_saves.__unickpt__ = True  # type: ignore[attr-defined]
    return rmtree_after_saves


def installed() -> bool:
    """True once :func:`install` has replaced ``shutil.rmtree``."""
    return getattr(shutil.rmtree, "__unickpt__", False)


def install() -> None:
    """Replace ``shutil.rmtree`` by the waiting wrapper (idempotent; the module's attribute, so code
    that calls ``shutil.rmtree(...)`` gets it; ``from shutil import rmtree`` bound earlier does not)."""
    with _lock:
        if not installed():
            shutil.rmtree = _waiting(shutil.rmtree)
