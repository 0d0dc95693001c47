"""Retries of transient storage errors: which errors are worth retrying, and the backoff loop.

Transient: connection resets, timeouts, throttling, 5xx. Permanent (fail at once): a missing object,
permission denied, a bad request. Backoff: 0.1 s, doubling, at most 5 s apart, for at most
``total_s`` seconds in all (``UNICKPT_RETRY_TOTAL_S``, default 120: :class:`unickpt.options.Env`).
"""
from __future__ import annotations

import errno
import logging
import time
from typing import Any, Callable

__all__ = ["is_transient", "retrying"]

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


def retrying(what: str, path: str, total_s: float, fn: Callable[..., Any], *args: Any,
             on_retry: Callable[[], None] | None = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, retried on transient errors with exponential backoff for at most
    ``total_s`` seconds; ``on_retry()`` is called before each retry. Raises the last error."""
    deadline = time.monotonic() + total_s
    delay = 0.1
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not is_transient(e) or time.monotonic() + delay > deadline:
                raise
            if on_retry is not None:
                on_retry()
            log.warning("unickpt: %s %s failed (%s: %s); retrying in %.1f s", what, path, type(e).__name__, e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
