"""Saves in flight survive the end of the process group and of the process.

A script that ends its process group right after an async save (``engine.save_checkpoint(...)``;
``destroy_process_group()``; the process ends, however abruptly) must keep that checkpoint: the
frameworks' contract is that a save is complete when the call returns. :func:`install` makes
``torch.distributed.destroy_process_group`` (once per process) first run a hook that waits for the
saves in flight on the group it destroys (the engines' :func:`unickpt.engine.finish_saves`), and
registers the same wait at interpreter exit. A save that failed is raised from
``destroy_process_group`` after the group is destroyed.

The function object itself is changed (its ``__code__`` becomes a call of the guarded version, which
runs a copy of torch's original), so that names bound before unickpt was imported
(``from torch.distributed import destroy_process_group``) get the guard too.
"""
from __future__ import annotations

import atexit
import logging
import types
from typing import Any, Callable

__all__ = ["install"]

log = logging.getLogger("unickpt")


def _destroy_trampoline(group=None):  # its code replaces torch's destroy_process_group's (see install)
    return _unickpt_destroy_process_group(group)  # type: ignore[name-defined]  # noqa: F821 - a global of torch's c10d module


def install(finish: Callable[[Any], BaseException | None]) -> None:
    """Guard ``destroy_process_group`` and interpreter exit with ``finish(group)`` (``None``: every
    group), which waits for the saves in flight on ``group`` and returns the first save error not
    reported yet. Idempotent. Raises RuntimeError when torch's function has an unexpected form."""
    import torch.distributed.distributed_c10d as c10d

    target = c10d.destroy_process_group
    if getattr(target, "_unickpt_guard", False):
        return
    if target.__code__.co_freevars or "group" not in target.__code__.co_varnames[:1]:
        raise RuntimeError("unickpt: torch.distributed.destroy_process_group has an unexpected form; "
                           "call unickpt's handle.wait() before destroying the process group")
    original = types.FunctionType(target.__code__, target.__globals__, target.__name__, target.__defaults__)
    original.__kwdefaults__ = target.__kwdefaults__

    def guarded(group: Any = None) -> None:
        error = finish(group)
        original(group)
        if error is not None:
            raise error

    def at_exit() -> None:
        error = finish(None)
        if error is not None:
            log.error("unickpt: a save in flight at exit failed: %s", error)

    c10d._unickpt_destroy_process_group = guarded  # type: ignore[attr-defined]  # read by the trampoline
    target.__code__ = _destroy_trampoline.__code__
    target._unickpt_guard = True  # type: ignore[attr-defined]
    atexit.register(at_exit)
