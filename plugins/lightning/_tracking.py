"""The saves of one :class:`~unickpt.lightning.UnickptCheckpointIO` until they are reported: the base
class :class:`SaveTracker`.

An asynchronous save returns before it commits; its failure is reported later, once (``on_error``):
by the next save when it has finished by then, or by the next load, remove, ``wait`` or teardown of
its path, which wait for it. A failure of a post-commit step (publishing the pack or pointer) is kept
and raised by the caller's next call. The engine names an io-route save by its staging directory;
:meth:`SaveTracker._named` names it by its Lightning path again.
"""
from __future__ import annotations

import logging
import threading
import warnings
from typing import Callable

from unickpt import EarlierSaveFailedError, SaveHandle, ext

from . import _pointers
from ._inflight import cleanup

__all__ = ["SaveTracker"]

log = logging.getLogger("unickpt.lightning")


class SaveTracker:
    """The pending saves of one IO, their failures, and the versions they write.

    Args:
        on_error: ``"raise"`` or ``"warn"`` (see ``UnickptCheckpointIO``). Raises ValueError otherwise.

    Attributes: ``failed_saves`` (failed saves reported so far), ``last_error`` (the latest one),
    ``last_handle`` (the :class:`~unickpt.SaveHandle` of the latest save).
    """

    def __init__(self, on_error: str = "raise"):
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        self.on_error = on_error
        self.failed_saves = 0
        self.last_error: BaseException | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, list[SaveHandle]] = {}  # Lightning path -> saves not yet waited for
        self._errors: list[BaseException] = []  # failures of post-commit steps (pointer, cleanup)
        self._names: dict[str, str] = {}  # io route: staging directory -> the Lightning path it is saved to
        self._next_version: dict[str, int] = {}
        self._pending_links: dict[str, str] = {}  # Lightning path -> version dir its newest link save reads
        self.last_handle: SaveHandle | None = None

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _track(self, path: str, handle: SaveHandle, link: str | None = None) -> None:
        """Remember ``handle`` until waited for; finished saves are dropped here unless they failed
        unreported (kept for the next call to report), so a long run does not accumulate handles."""
        self.last_handle = handle
        with self._lock:
            for p in list(self._pending):
                self._pending[p] = [h for h in self._pending[p] if not h.done() or _unreported(h)]
                if not self._pending[p]:
                    del self._pending[p]
            self._pending.setdefault(path, []).append(handle)
            if link is not None:
                self._pending_links[path] = link
            self._pending_links = {p: t for p, t in self._pending_links.items() if p in self._pending}
            staged = {h.path for hs in self._pending.values() for h in hs}
            self._names = {st: p for st, p in self._names.items() if st in staged}

    def _report_finished(self) -> None:
        """Report the failures of this plugin's saves that have finished, not reported yet (see
        ``on_error``). For the io route (this process alone); on several ranks only the engine's next
        save can agree which saves have finished everywhere (a sharded save's failure is reported there)."""
        with self._lock:
            found = [(p, h) for p, hs in self._pending.items() for h in hs if _unreported(h)]
        self._report([(h.stats.step, p, _take(h)) for p, h in found])

    def _report(self, failed: list) -> None:
        """``failed``: ``[(global step, path, error)]``, each reported once: counted, then one
        EarlierSaveFailedError naming them all raised, or (``on_error="warn"``) one warning each."""
        failed = [f for f in failed if f[2] is not None]
        if not failed:
            return
        if self.on_error == "warn":
            for f in failed:
                one = EarlierSaveFailedError([f])
                one.__cause__ = f[2]
                self._on_engine_error(one)
            return
        error = EarlierSaveFailedError(failed)
        self.failed_saves += len(failed)
        self.last_error = error
        raise error from failed[0][2]

    def _named(self, error: EarlierSaveFailedError) -> EarlierSaveFailedError:
        """``error`` with each io-route save named by its Lightning path instead of its staging directory."""
        with self._lock:
            names = dict(self._names)
        if not any(path in names for _, path, _ in error.errors):
            return error
        named = EarlierSaveFailedError([(step, names.get(path, path), e) for step, path, e in error.errors])
        named.__cause__ = error.__cause__
        return named

    def _on_engine_error(self, error: BaseException) -> bool:
        """The engine found one of this plugin's saves failed (at its next save): count it; with
        ``on_error="warn"`` warn and report it handled."""
        assert isinstance(error, EarlierSaveFailedError)  # what the engine (and _report) call it with
        error = self._named(error)
        self.failed_saves += 1
        self.last_error = error
        if self.on_error != "warn":
            return False
        lines = [line.strip() for line in str(error.__cause__ or error).splitlines() if line.strip()]
        warnings.warn(f"unickpt.lightning: the asynchronous save of {error.path!r} (global step {error.steps[0]}) "
                      f"failed ({lines[-1] if lines else ''}); on_error='warn': training goes on", RuntimeWarning,
                      stacklevel=2)
        return True

    def _wait(self, path: str | None = None) -> None:
        """Wait for this plugin's pending saves (of ``path``, or all); then report their failures not
        reported yet (see ``on_error``), then a failure of a post-commit step (pointer, cleanup)."""
        with self._lock:
            if path is None:
                handles = [(p, h) for p, hs in self._pending.items() for h in hs]
                self._pending = {}
            else:
                handles = [(path, h) for h in self._pending.pop(path, [])]
        for _, h in handles:
            h.outcome()
            cleanup(h)
        self._report([(h.stats.step, p, _take(h)) for p, h in handles])
        self._raise_errors()

    def wait(self) -> None:
        """Block until every save started by this plugin in this process has committed and its
        pointer is written; raise EarlierSaveFailedError naming every failed save not reported yet
        (``on_error="warn"``: warn)."""
        self._wait()

    def _version_for(self, storage: ext.StorageBackend, path: str) -> int:
        """The next version number of ``path`` (one above any existing or in-flight version)."""
        with self._lock:
            known = self._next_version.get(path)
        found = _pointers.versions(storage, path)
        v = max([known or 0] + [x + 1 for x in found] + [1])
        with self._lock:
            self._next_version[path] = v + 1
        return v

    def _guarded(self, path: str, step: Callable[[], None]) -> Callable[[], None]:
        """``step`` (a post-commit step of the save of ``path``, run in the background) whose failure is
        logged and raised by the caller's next call."""
        def run() -> None:
            try:
                step()
            except BaseException as e:  # raised on the caller's next call
                log.exception("unickpt.lightning: publishing %s failed", path)
                with self._lock:
                    self._errors.append(e)
        return run

    def _wait_for_links_into(self, root: str) -> None:
        """Wait for the saves in flight whose link reads a version under ``root`` (they must publish
        their pointer before that version is judged unused)."""
        with self._lock:
            readers = [p for p, target in self._pending_links.items() if target.startswith(root) and p in self._pending]
        for p in readers:
            self._wait(p)


def _unreported(handle: SaveHandle) -> bool:
    """A finished save whose failure was not reported yet."""
    return handle.done() and not handle.error_reported and handle.outcome() is not None


def _take(handle: SaveHandle) -> BaseException | None:
    """A finished save's failure, unless reported already; it is reported by the caller (once)."""
    if handle.error_reported:
        return None
    error = handle.outcome()
    if error is not None:
        handle.error_reported = True
    return error

