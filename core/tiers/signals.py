"""Preemption notices: a signal (``SIGTERM``, ``SIGUSR1``, ...) sets this process's flag.

The handler only sets a flag (and calls a Python handler that was installed before, so a framework's
own handling goes on); it never saves, never exits and runs no collective. Acting on the flag is
collective and happens at a step boundary: :meth:`unickpt.tiers.manager.Tiers.agree` sums every
rank's flag in the one small all-reduce it runs per step, so that all ranks see the notice at the
same step and save that step together (a flag checked per rank starts a save on one rank only: a
hang). Python runs signal handlers on the main thread only, so handlers are installed only when
the :class:`PreemptionNotice` is created on the main thread (else a warning; the flag can still be
set by :meth:`PreemptionNotice.notify`).
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

__all__ = ["PreemptionNotice"]

log = logging.getLogger("unickpt")


class PreemptionNotice:
    """This process's preemption flag and the handlers that set it.

    Args:
        names: signal names (``"SIGTERM"``, ``"SIGUSR1"``, ...; see :class:`~unickpt.TierOptions`).

    Attributes:
        received: the name of the first signal received, or None; ``received_at``: its
            ``time.time()`` (seconds).
    """

    def __init__(self, names: tuple = ()):
        self.received: str | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}
        if not names:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("unickpt: the Checkpointer was created off the main thread: no handler for %s "
                        "(preemption notices are not seen)", ", ".join(names))
            return
        for name in names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def flag(self) -> bool:
        return self.received is not None

    def notify(self, name: str = "notice") -> None:
        """Set the flag (as a signal would), e.g. from a scheduler's own preemption API."""
        if self.received is None:
            self.received, self.received_at = name, time.time()

    def _handle(self, signum: int, frame: Any) -> None:
        self.notify(signal.Signals(signum).name)
        previous = self._previous.get(signum)
        if callable(previous) and previous not in (signal.default_int_handler,):
            previous(signum, frame)

    def close(self) -> None:
        """Put the previous handlers back (main thread; handlers replaced meanwhile by someone else stay)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
