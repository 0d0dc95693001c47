"""What a framework plugin uses of unickpt's engine (``plugins/<framework>/``, ``unickpt.<framework>``).

A plugin imports :mod:`unickpt` (the public names), :mod:`unickpt.interop` (what it implements: a
layout, a checkpoint source, a conversion) and this module, nothing else of the core
(``tests/unit/test_layers.py`` fails otherwise), so the core can change behind it. Fifteen names:

- **engines**: :func:`engine` gives the :class:`EngineHandle` of a process group (save, load, wait,
  in-flight paths, the group's rank, and collectives on the caller's thread; :meth:`EngineHandle.existing`
  the default group's if it exists; :meth:`EngineHandle.watch_removal`: ``shutil.rmtree`` of a folder an
  async save still writes waits for it); :func:`new_engine` a private one the plugin closes itself;
  :data:`THIS_PROCESS` is a group of this process alone, and :func:`load_solo` loads in this process
  alone without any engine.
- **checkpoint tiers** (docs/tiers.md): :func:`memory_tiers` gives a :class:`TiersHandle`: a memory
  save every ``memory_every`` steps with its peer copy, the per-step preemption agreement, and
  recovery from memory before a plugin's own storage load.
- **checkpoints on storage**: :class:`CheckpointRoot` (``step_<N>``, ``latest``, retention),
  :class:`CheckpointDir` (one directory: claim, commit, is-committed, metadata, writer, removal),
  :func:`open_storage` and :class:`StorageBackend`.
- **state**: :class:`Codec` (plain values as tagged JSON, dtype names) and :class:`StateTools`
  (flattening, the leaves a save stored, torch state-dict helpers, chunk geometry, DCP directories).
- **plugin plumbing**: :func:`flag` (a boolean environment switch), :func:`lazy_getattr` (cheap
  package imports).

Every name is typed; nothing here takes or returns ``Any``. Importing this module imports no torch
(the engine, tiers and state helpers are imported on first use). This module sits above the engine
and below the tools (``tests/unit/test_layers.py``).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

from ._lazy import lazy_getattr

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

    from .dist.comm import ThisProcess
    from .engine import Engine
    from .format.metadata import CheckpointMetadata
    from .geometry import ChunkSpec, ContiguousBox
    from .loading.stats import LoadStats
    from .options import SaveOptions, TierOptions
    from .plan.mapping import Mapping
    from .saving.request import SaveHandle
    from .state.flat import FlatState
    from .state.leaves import Shard
    from .tiers.manager import Tiers
    from .tiers.signals import PreemptionNotice

__all__ = ["engine", "new_engine", "EngineHandle", "THIS_PROCESS", "load_solo", "memory_tiers", "TiersHandle",
           "CheckpointRoot", "CheckpointDir", "open_storage", "StorageBackend", "Codec", "StateTools", "flag",
           "lazy_getattr"]

_EXPORTS = {
    "THIS_PROCESS": "unickpt.dist.comm",
    "CheckpointRoot": "unickpt.lifecycle.root",
    "CheckpointDir": "unickpt.lifecycle.directory",
    "open_storage": "unickpt.storage",
    "StorageBackend": "unickpt.storage",
}
__getattr__ = lazy_getattr(__name__, _EXPORTS)

_T = TypeVar("_T")


def _get(module: str, name: str) -> Callable:
    return getattr(importlib.import_module(module), name)


class EngineHandle:
    """What a plugin may do with the engine of a process group (:func:`engine`).

    Attributes:
        rank, world_size: this process in the group.
    """

    def __init__(self, engine: Engine, owned: bool = False):
        self._engine = engine
        self._owned = owned
        self.rank, self.world_size = engine.rank, engine.world_size

    def save(self, path: str, state: dict, *, async_save: bool = False, storage_options: dict | None = None,
             step: int | None = None, framework: str | None = None, extra: dict | None = None,
             on_commit: Callable[[], None] | None = None, allow_pickle: bool = False,
             options: SaveOptions | None = None, on_error: Callable[[BaseException], bool] | None = None
             ) -> SaveHandle:
        """:func:`unickpt.save` into ``path`` (collective), plus ``framework`` and ``extra`` (recorded in
        ``metadata.json``) and ``on_commit`` (called on group rank 0 right after the commit, on the
        commit thread). Returns the :class:`~unickpt.SaveHandle`. First raises EarlierSaveFailedError
        for earlier saves of the group that failed unreported (``on_error``: see
        :meth:`unickpt.engine.Engine.save`)."""
        from .requests import SaveRequest

        return self._engine.save(SaveRequest(path, async_save=async_save, storage_options=storage_options, step=step,
                                             framework=framework, extra=extra or {}, allow_pickle=allow_pickle,
                                             options=options, on_commit=on_commit, on_error=on_error), state)

    def load(self, path: str, state: dict, *, strict: bool = True, storage_options: dict | None = None,
             allow_pickle: bool = False, verify: bool | None = None, redistribute: bool | None = None,
             options: LoadOptions | None = None, mapping: Mapping | str | None = None) -> LoadStats:
        """:func:`unickpt.load` of ``path`` (collective), after this group's pending saves (``mapping``: a
        cross-framework load, see :func:`unickpt.load`). Returns the :class:`~unickpt.LoadStats`."""
        from .requests import LoadRequest

        return self._engine.load(LoadRequest.of(path, strict=strict, storage_options=storage_options,
                                                allow_pickle=allow_pickle, verify=verify, redistribute=redistribute,
                                                options=options, mapping=mapping), state)

    def wait(self) -> None:
        """Block until every pending save of the group has committed; raise EarlierSaveFailedError naming
        every failed save not reported yet."""
        self._engine.wait()

    def in_flight(self, path: str) -> bool:
        """True while a save into ``path`` started by this process on this group has not finished."""
        return self._engine.in_flight(str(path))

    def broadcast(self, obj: _T) -> _T:
        """Group rank 0's ``obj`` on every rank (collective, caller's thread)."""
        return self._engine.broadcast(obj)

    def all_gather(self, obj: _T) -> list[_T]:
        """Every rank's ``obj``, in group-rank order (collective, caller's thread)."""
        return self._engine.all_gather(obj)

    @property
    def options(self) -> SaveOptions:
        """The group's default :class:`~unickpt.SaveOptions`."""
        return self._engine.options

    def configure(self, **options: object) -> SaveOptions:
        """Change the group's default save options (fields of :class:`~unickpt.SaveOptions`)."""
        return self._engine.configure(**options)

    @staticmethod
    def watch_removal(handle: SaveHandle) -> None:
        """Make ``shutil.rmtree`` of ``handle.path`` (or of a folder around or inside it) wait for this
        async save (:mod:`unickpt.removal`; the first call replaces ``shutil.rmtree``): a framework's
        checkpoint is complete when its save call returns, and callers remove it right afterwards."""
        removal = importlib.import_module("unickpt.removal")
        removal.install()
        removal.watch(handle)

    @staticmethod
    def wait_under(path: str, but: str | None = None) -> None:
        """Block until no save given to :meth:`watch_removal` still writes into ``path``, inside it or
        around it (``but``: except the save into that directory). The saves' errors are not raised here."""
        _get("unickpt.removal", "wait_under")(path, but)

    @staticmethod
    def watched_pending(path: str | None = None) -> bool:
        """True while a save given to :meth:`watch_removal` has not finished (``path``: one writing into
        ``path``, inside it or around it)."""
        return _get("unickpt.removal", "pending")(path)

    @staticmethod
    def existing() -> EngineHandle | None:
        """The default group's engine if it exists already (creates nothing: no collective)."""
        from .engine import default_engine

        found = default_engine()
        return None if found is None else EngineHandle(found)

    def close(self) -> None:
        """An engine of :func:`new_engine` only: wait for its saves, then free its threads, staging
        memory and private groups. Raises RuntimeError for a shared engine (:func:`engine`)."""
        if not self._owned:
            raise RuntimeError("unickpt.ext: only an engine made by new_engine() is closed by its plugin")
        self._engine.close()


def engine(process_group: ProcessGroup | ThisProcess | None = None) -> EngineHandle:
    """The :class:`EngineHandle` of ``process_group`` (default: the world; :data:`THIS_PROCESS`: this
    process alone). Created collectively on first use: every rank of the group must call it first on
    the same thread order (never first inside a background thread)."""
    from .engine import get_engine

    return EngineHandle(get_engine(process_group))


def new_engine(process_group: ProcessGroup | ThisProcess | None = None) -> EngineHandle:
    """A private engine of ``process_group`` (collective when the group has several ranks), not shared
    with :func:`engine` and not waited for at teardown: the plugin waits for its saves and closes it
    (:meth:`EngineHandle.close`), e.g. to give its staging memory back between runs."""
    from .engine import Engine

    return EngineHandle(Engine(process_group), owned=True)


def load_solo(path: str, state: dict, *, strict: bool = True, storage_options: dict | None = None,
              allow_pickle: bool = False, verify: bool | None = None, redistribute: bool | None = None,
              mapping: Mapping | str | None = None) -> LoadStats:
    """:func:`unickpt.load` in this process alone (a world of one, whatever process groups exist), with
    no engine (no threads, no staging memory): the reader of a file that one process reads by itself."""
    from .dist.comm import Comm
    from .loading.loader import Loader
    from .requests import LoadRequest

    return Loader(Comm.solo()).load(LoadRequest.of(path, strict=strict, storage_options=storage_options,
                                                   allow_pickle=allow_pickle, verify=verify,
                                                   redistribute=redistribute, mapping=mapping), state)

class TiersHandle:
    """The checkpoint tiers of a plugin (:func:`memory_tiers`; docs/tiers.md).

    Attributes:
        rank, world_size: this process in the group.
        preempted: True once :meth:`step` saw a preemption notice (the plugin then saves persistently).
    """

    def __init__(self, tiers: Tiers):
        self._tiers = tiers
        self.rank, self.world_size = tiers.rank, tiers.world_size
        self.preempted = False

    @property
    def options(self) -> TierOptions:
        """The validated :class:`~unickpt.TierOptions`."""
        return self._tiers.options

    @property
    def notice(self) -> PreemptionNotice:
        """This process's preemption notice (``.received``: the signal's name; ``.notify()``)."""
        return self._tiers.notice

    def step(self, step: int, state: dict | Callable[[], dict], *, allow_pickle: bool = False) -> bool:
        """Call at every training step, on every rank (collective: one small all-reduce). Makes the
        memory save of ``step`` when it is due (``state``: the state dict, or a function returning it,
        called only then), and returns whether any rank has received a preemption notice (then save
        persistently, on every rank, and stop)."""
        tiers = self._tiers
        pending = tiers.start_agreement()
        if tiers.due(step):
            tiers.memory_save(step, state() if callable(state) else state, allow_pickle=allow_pickle)
        preempt = tiers.finish_agreement(pending).preempt
        self.preempted = self.preempted or preempt
        return preempt

    def recover(self, state: dict | Callable[[str], dict], *, persisted: int | None = None, step: int | None = None,
                strict: bool = True, allow_pickle: bool = False) -> tuple[int, dict, LoadStats] | None:
        """Restore from memory (collective): the newest step that every rank has in memory (its node's or
        a peer node's) and that is at least as new as ``persisted`` (the plugin's newest persisted step;
        ``step``: exactly that one). ``state``: the state to load into, or ``state(copy path)`` building
        it. Returns ``(step, state loaded, LoadStats)`` or None: then load from storage."""
        result = self._tiers.recover(state, persisted=persisted, only=step, strict=strict, allow_pickle=allow_pickle)
        return None if result is None else (result.step, result.state, result.stats)

    def forget_newer(self, step: int) -> None:
        """After loading ``step`` from storage (every rank, 1 barrier): drop this node's memory copies of
        later steps."""
        self._tiers.forget_newer(step)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank's tiers hold: ``own``, ``peer``, ``staging``."""
        return self._tiers.memory_bytes()

    def wait(self) -> None:
        """Wait for the memory saves and peer copies in flight."""
        self._tiers.wait()

    def close(self) -> None:
        """Wait, stop the threads, put the signal handlers back, destroy the private groups."""
        self._tiers.close()

    def clear_memory(self) -> None:
        """Remove this rank's memory copies and those it holds for peers."""
        self._tiers.clear_memory()


def memory_tiers(root: str, options: TierOptions | None = None, *, process_group: ProcessGroup | ThisProcess | None = None,
                 save_options: SaveOptions | None = None) -> TiersHandle:
    """The checkpoint tiers of the run whose persistent checkpoints are under ``root`` (its memory
    directory is named after it), with ``options`` (a :class:`~unickpt.TierOptions`). Collective over
    ``process_group`` (creates two private gloo groups)."""
    from .options import TierOptions, env
    from .tiers.manager import Tiers

    opts = (options or TierOptions()).validated()
    return TiersHandle(Tiers(str(root), opts, process_group=process_group, save_options=save_options,
                             timeout_s=env().collective_timeout_s, local_world_size=env().local_world_size))


def flag(name: str, default: bool) -> bool:
    """A plugin's boolean switch from the environment: unset or empty gives ``default``; ``0``,
    ``false``, ``no``, ``off`` (any case) give False; anything else True."""
    import os

    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


class Codec:
    """Plain values as tagged JSON (no pickle unless allowed; ``unickpt.state.codec``) and the format's
    dtype names (``"bfloat16"``; ``unickpt.format.dtypes``). Static methods only."""

    @staticmethod
    def encode(value: object, *, allow_pickle: bool = True, key: str = "") -> object:
        """``value`` as JSON-able data; a class JSON cannot express is pickled only with ``allow_pickle``,
        else UnsafeObjectError names ``key``."""
        return _get("unickpt.state.codec", "encode")(value, allow_pickle=allow_pickle, key=key)

    @staticmethod
    def decode(data: object, *, allow_pickle: bool = False, key: str = "") -> object:
        """The value :meth:`encode` gave ``data`` for; a pickle is refused (UnsafeObjectError naming
        ``key``) unless ``allow_pickle``."""
        return _get("unickpt.state.codec", "decode")(data, allow_pickle=allow_pickle, key=key)

    @staticmethod
    def dtype_to_str(dtype: torch.dtype) -> str:
        """``torch.bfloat16`` -> ``"bfloat16"``."""
        return _get("unickpt.format.dtypes", "dtype_to_str")(dtype)

    @staticmethod
    def str_to_dtype(name: str) -> torch.dtype:
        """``"bfloat16"`` -> ``torch.bfloat16``; ValueError for a name that is no torch dtype."""
        return _get("unickpt.format.dtypes", "str_to_dtype")(name)


class StateTools:
    """Helpers on the state a plugin saves and loads (``unickpt.state.flat``, ``unickpt.geometry``,
    ``unickpt.loading.from_dcp``). Static methods only."""

    @staticmethod
    def flatten(state: dict, *, for_load: bool, allow_pickle: bool = False) -> FlatState:
        """The flat ``fqn -> leaf`` maps of ``state`` as a save (``for_load=False``) or a load sees them."""
        return _get("unickpt.state.flat", "flatten")(state, for_load=for_load, allow_pickle=allow_pickle)

    @staticmethod
    def saved_leaves(skeleton: object) -> tuple[set[str], set[str], dict[str, object]]:
        """``(tensor fqns, per-rank fqns, {object fqn: encoded value})`` of a checkpoint's state tree
        (``CheckpointMetadata.state_tree``)."""
        return _get("unickpt.state.flat", "saved_leaves")(skeleton)

    @staticmethod
    def optimizer_state(model: nn.Module | None, optimizer: torch.optim.Optimizer) -> object:
        """``optimizer`` as a stateful leaf keyed by ``model``'s parameter fqns (the layout of an optimizer
        saved next to its model), for a save or load without the model's weights
        (:class:`unickpt.state.optimizer.OptimizerState`)."""
        return _get("unickpt.state.optimizer", "OptimizerState")(model, optimizer)

    @staticmethod
    def optimizers_untouched() -> object:
        """A context manager in which torch's ``get_state_dict`` leaves an optimizer without state as it is
        (no zero-gradient ``step()``): a save never changes what it saves."""
        return _get("unickpt.state.flat", "optimizers_untouched")()

    @staticmethod
    def sharded_tensor_shard(st: object, fqn: str) -> Shard:
        """The one local shard of a ``ShardedTensor`` (FSDP1 ``SHARDED_STATE_DICT``) as a box. ValueError
        for several local shards."""
        return _get("unickpt.state.flat", "sharded_tensor_shard")(st, fqn)

    @staticmethod
    def chunk_pieces(spec: ChunkSpec, global_shape: Sequence[int]) -> list[ContiguousBox]:
        """The storage-contiguous pieces of a chunk (a box: one; a flat range: at most ``2 * ndim - 1``)."""
        return _get("unickpt.geometry", "chunk_pieces")(spec, global_shape)

    @staticmethod
    def is_dcp_checkpoint(storage: StorageBackend, path: str) -> bool:
        """Whether ``path`` is a torch DCP checkpoint (``.metadata``) and not a unickpt one."""
        return _get("unickpt.loading.from_dcp", "is_dcp_checkpoint")(storage, path)

    @staticmethod
    def restore_empty_optim_state(value: dict) -> dict:
        """An optimizer state dict with the empty per-parameter states DCP's flattening dropped put back."""
        return _get("unickpt.loading.from_dcp", "restore_empty_optim_state")(value)


if TYPE_CHECKING:
    from .dist.comm import THIS_PROCESS
    from .lifecycle.directory import CheckpointDir
    from .lifecycle.root import CheckpointRoot
    from .options import LoadOptions
    from .storage import StorageBackend, open_storage
