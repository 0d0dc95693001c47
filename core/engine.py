"""The engine of a process group: its :class:`~unickpt.saving.saver.Saver` and
:class:`~unickpt.loading.loader.Loader` over one set of private gloo groups, created once per group per
process (:func:`get_engine`, collectively on first use).

The engine holds no save or load logic of its own; it composes the two paths, holds the default
save options, orders loads after this group's pending saves, and keeps caller-thread collectives
(:meth:`Engine.broadcast`) from interleaving with a save's plan agreement. Plugins reach it through
:func:`unickpt.ext.engine`. :func:`finish_saves` is what ``destroy_process_group`` and interpreter
exit wait for (:mod:`unickpt.teardown`).
"""
from __future__ import annotations

import logging
import threading
import uuid
from typing import TYPE_CHECKING, Any, Union

from .dist.comm import Comm, ThisProcess
from .loading.loader import Loader
from .loading.stats import LoadStats
from .options import SaveOptions, env
from .requests import LoadRequest, SaveRequest
from .saving.request import SaveHandle, SaveStats
from .saving.saver import Saver
from .teardown import install as install_teardown_guard

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Group = Union["ProcessGroup", ThisProcess, None]  # a process group; THIS_PROCESS; None: the default group

__all__ = ["Engine", "SaveHandle", "SaveStats", "get_engine", "engines", "default_engine", "finish_saves"]

log = logging.getLogger("unickpt")


class Engine:
    """Saves and loads for the ranks of one process group (see the module docstring).

    Args:
        process_group: the ranks taking part (default: the world; ``THIS_PROCESS``: this process alone).
            Its backend is not used.
        timeout_s: deadline of each internal collective (default ``UNICKPT_COLLECTIVE_TIMEOUT_S``, 1800).
        options: the default save options (:meth:`configure`).
    """

    def __init__(self, process_group: Group = None, timeout_s: float | None = None, options: SaveOptions | None = None):
        timeout_s = env().collective_timeout_s if timeout_s is None else timeout_s
        self.comm = Comm(process_group, timeout_s)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.run_id = uuid.uuid4().hex
        self.saver = Saver(self.comm, (options or SaveOptions()).validated(), self.run_id,
                           local_world_size=env().local_world_size, timeout_s=timeout_s,
                           busy_elsewhere=lambda path: any(e.in_flight(path) for e in engines() if e is not self),
                           report_earlier=True)
        self.loader = Loader(self.comm)

    @property
    def options(self) -> SaveOptions:
        """The default options of this engine's saves (settable: validated first)."""
        return self.saver.options

    @options.setter
    def options(self, options: SaveOptions) -> None:
        self.saver.options = options.validated()

    def configure(self, **options: Any) -> SaveOptions:
        """Change the default options of later saves (fields of :class:`~unickpt.options.SaveOptions`),
        e.g. ``configure(pool_bytes=2 << 30, snapshot="overlap")``. Options that shape the plan
        (``flat_ranges``, ``segment_bytes``, ``upload_to``, ``snapshot``, ``check_replicas``) must be the
        same on every rank (a save raises ValueError otherwise). Raises ValueError for unknown or bad values."""
        self.saver.options = self.saver.options.with_(**options)
        return self.saver.options

    def save(self, request: SaveRequest, state: dict) -> SaveHandle:
        """Save ``state`` as ``request`` says (see :func:`unickpt.save`; :meth:`unickpt.saving.saver.Saver.save`).
        ``request.on_commit`` runs on group rank 0 right after the commit; ``request.options`` default
        to the engine's.

        First raises EarlierSaveFailedError, on every rank, when earlier saves of this engine failed
        after their call returned (then this save is not started; docs/design.md, "Failures of
        asynchronous saves"). ``request.on_error(error) -> bool``: called instead with this save's
        EarlierSaveFailedError when a later call finds it failed; True: handled, not raised."""
        return self.saver.save(request, state)

    def load(self, request: LoadRequest, state: dict) -> LoadStats:
        """Wait for this engine's pending saves (raising their failures as :meth:`wait` does), then load
        ``request.path`` into ``state`` (see :func:`unickpt.load`; :meth:`unickpt.loading.loader.Loader.load`)."""
        self.wait()
        return self.loader.load(request, state)

    def broadcast(self, obj: Any) -> Any:
        """Group rank 0's ``obj`` on every rank (caller's thread; collective). Waits until this engine's
        pending saves have agreed their plans, so that the two never interleave on one group."""
        self.saver.wait_planned()
        return self.comm.broadcast(obj, self.comm.plan_group)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-able or picklable), in group-rank order (caller's thread;
        collective; waits for pending plan agreements as :meth:`broadcast` does)."""
        self.saver.wait_planned()
        return self.comm.all_gather(obj, self.comm.plan_group)

    def in_flight(self, path: str, others: int = 0) -> bool:
        """True while a save to ``path`` started by this engine has not finished (any thread)."""
        return self.saver.in_flight(path, others)

    def wait(self) -> None:
        """Wait for every pending save; then raise EarlierSaveFailedError naming every failed save whose
        failure was not raised yet (by its handle or an earlier call); each failure is raised once."""
        self.saver.wait()

    def close(self) -> None:
        """Wait for the pending saves, then stop the threads, free the staging memory and destroy the
        private groups (no reference to them is kept: torch can then re-initialise on the same store)."""
        try:
            self.saver.close()
        finally:
            self.comm.close()
            self.loader.plans.clear()


_ENGINES: dict[object, Engine] = {}
_ENGINES_LOCK = threading.Lock()


def engines() -> list[Engine]:
    """Every engine of this process."""
    with _ENGINES_LOCK:
        return list(_ENGINES.values())


def _engines_of(group: Group) -> list[tuple[object, Engine]]:
    """The engines that ``destroy_process_group(group)`` takes the process group of: every engine for
    the default group (``None`` / WORLD destroys every group), else the engine of ``group``."""
    import torch.distributed as dist

    with _ENGINES_LOCK:
        if group is None or group is dist.group.WORLD:
            return list(_ENGINES.items())
        return [(k, e) for k, e in _ENGINES.items() if k is group]


def finish_saves(group: Group = None) -> BaseException | None:
    """Wait for the in-flight saves of the engines on ``group`` (None: every engine) and close those
    whose private groups are about to go; returns the save errors not reported yet (an
    EarlierSaveFailedError naming each failed save; the first engine's if several have some; None if none)."""
    import torch.distributed as dist

    from .tiers.manager import finish_all

    if group is None or group is dist.group.WORLD:
        finish_all()  # the checkpoint tiers' threads and private groups go first
    first: BaseException | None = None
    for key, engine in _engines_of(group):
        try:
            engine.wait()
        except BaseException as e:  # the others still finish
            log.error("unickpt: a save in flight when the process group was destroyed failed: %s", e)
            first = first or e
        if engine.comm.distributed:
            with _ENGINES_LOCK:
                if _ENGINES.get(key) is engine:
                    del _ENGINES[key]
            engine.close()
    return first


def default_engine() -> Engine | None:
    """The engine of the default group (or of this process alone without one), if it exists."""
    import torch.distributed as dist

    key = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    with _ENGINES_LOCK:
        return _ENGINES.get(key)


def get_engine(process_group: Group = None) -> Engine:
    """The engine of ``process_group`` (created on first use, collectively). One per group per process.

    ``UNICKPT_COLLECTIVE_TIMEOUT_S`` (default 1800) bounds each internal collective, so a dead peer
    fails a save instead of hanging it.
    """
    import torch.distributed as dist

    key = process_group if process_group is not None else (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            install_teardown_guard(finish_saves)
            engine = _ENGINES[key] = Engine(process_group)
        return engine
