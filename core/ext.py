"""The interface of unickpt's core for framework plugins (``plugins/<framework>/``, ``unickpt.<framework>``).

A plugin imports :mod:`unickpt` (the public names) and this module, nothing else of the core
(``tests/unit/test_layers.py`` fails otherwise), so the core can change behind it. What it offers:

- **engines**: :func:`engine` gives the :class:`EngineHandle` of a process group (save, load, wait,
  in-flight paths, the group's rank, and collectives on the caller's thread); :func:`new_engine` a
  private one the plugin closes itself; :data:`THIS_PROCESS` is a group of this process alone, and
  :func:`load_solo` loads in this process alone without any engine.
- **checkpoint directories**: :class:`CheckpointRoot` (``step_<N>``, ``latest``, retention), and the
  rules of one directory: :func:`is_committed`, :func:`is_incomplete_checkpoint`,
  :func:`writer_alive`, :func:`writer_elsewhere_on_host`, :func:`pid_alive`, :func:`remove_checkpoint_dir`
  (uncommit first), :data:`METADATA_FILE`,
  :data:`WRITER_FILE`; :func:`read_metadata`.
- **storage**: :func:`open_storage` and :class:`StorageBackend`.
- **state**: :func:`flatten`, :func:`saved_leaves`, :func:`optimizers_untouched`,
  :func:`sharded_tensor_shard`; plain values as tagged JSON: :func:`encode`, :func:`decode`;
  dtype names :func:`dtype_to_str`, :func:`str_to_dtype`; chunk geometry :class:`Box`,
  :class:`FlatRange`, :func:`chunk_pieces`.
- **DCP**: :func:`is_dcp_checkpoint`, :func:`restore_empty_optim_state`.
- **checkpoint tiers** (docs/tiers.md): :func:`memory_tiers` gives a :class:`TiersHandle`: a memory
  save every ``memory_every`` steps with its peer copy, the per-step preemption agreement, and
  recovery from memory before a plugin's own storage load.
- **plugin plumbing**: :func:`flag` (a boolean environment switch), :func:`lazy_getattr` (cheap
  package imports), :class:`Source` (a checkpoint kind for ``unickpt import``).
- **cross-framework loads** (docs/cross-framework.md): :class:`Layout` (how a framework names training
  state: subclass it, register it under the entry-point group ``unickpt.layouts``), its
  :class:`SourceNames` / :class:`TargetNames` and roles :data:`PARAM` / :data:`MASTER`,
  :func:`source_layout`, :func:`locate_checkpoint`, :func:`registered_layouts`, :class:`StoredParams`
  (a checkpoint's parameters through rules); the rules' results :class:`Resolved` / :class:`Piece`;
  :class:`Conversion` (``unickpt export --to`` / ``unickpt import --to``, entry-point group
  ``unickpt.conversions``) with :class:`ExportPlan`, :class:`ImportPlan`, :func:`materialize`,
  :func:`box_of`, :func:`dict_resolver`.

Names are imported lazily (importing this module imports no torch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ._lazy import lazy_getattr

__all__ = ["engine", "default_engine", "new_engine", "load_solo", "EngineHandle", "THIS_PROCESS", "CheckpointRoot", "LATEST_FILE",
           "step_name", "is_committed", "is_incomplete_checkpoint", "writer_alive", "writer_elsewhere_on_host",
           "remove_checkpoint_dir", "pid_alive",
           "METADATA_FILE", "WRITER_FILE", "read_metadata", "CheckpointMetadata", "open_storage", "StorageBackend",
           "flatten", "saved_leaves", "optimizers_untouched", "sharded_tensor_shard", "encode", "decode",
           "dtype_to_str", "str_to_dtype", "Box", "FlatRange", "chunk_pieces", "is_dcp_checkpoint",
           "restore_empty_optim_state", "flag", "lazy_getattr", "Source", "Layout", "SourceNames", "TargetNames",
           "PARAM", "MASTER", "source_layout", "locate_checkpoint", "registered_layouts", "StoredParams",
           "Conversion", "ExportPlan", "ImportPlan", "materialize", "box_of", "dict_resolver", "Resolved", "Piece", "memory_tiers", "TiersHandle", "TierOptions"]

_EXPORTS = {
    "THIS_PROCESS": "unickpt.dist.comm",
    "CheckpointRoot": "unickpt.lifecycle.root",
    "LATEST_FILE": "unickpt.lifecycle.root",
    "step_name": "unickpt.lifecycle.root",
    "is_committed": "unickpt.lifecycle.directory",
    "is_incomplete_checkpoint": "unickpt.lifecycle.directory",
    "writer_alive": "unickpt.lifecycle.directory",
    "writer_elsewhere_on_host": "unickpt.lifecycle.directory",
    "pid_alive": "unickpt.lifecycle.directory",
    "METADATA_FILE": "unickpt.format.layout",
    "WRITER_FILE": "unickpt.format.layout",
    "CheckpointMetadata": "unickpt.format.metadata",
    "open_storage": "unickpt.storage",
    "StorageBackend": "unickpt.storage",
    "flatten": "unickpt.state.flat",
    "saved_leaves": "unickpt.state.flat",
    "optimizers_untouched": "unickpt.state.flat",
    "sharded_tensor_shard": "unickpt.state.flat",
    "encode": "unickpt.state.codec",
    "decode": "unickpt.state.codec",
    "dtype_to_str": "unickpt.format.dtypes",
    "str_to_dtype": "unickpt.format.dtypes",
    "Box": "unickpt.geometry",
    "FlatRange": "unickpt.geometry",
    "chunk_pieces": "unickpt.geometry",
    "is_dcp_checkpoint": "unickpt.loading.dcp",
    "restore_empty_optim_state": "unickpt.loading.dcp",
    "Source": "unickpt.tools.importers",
    "Layout": "unickpt.loading.convert",
    "SourceNames": "unickpt.loading.convert",
    "TargetNames": "unickpt.loading.convert",
    "PARAM": "unickpt.loading.convert",
    "MASTER": "unickpt.loading.convert",
    "source_layout": "unickpt.loading.convert",
    "locate_checkpoint": "unickpt.loading.convert",
    "registered_layouts": "unickpt.loading.convert",
    "Resolved": "unickpt.plan.mapping",
    "Piece": "unickpt.plan.mapping",
    "StoredParams": "unickpt.loading.convert",
    "Conversion": "unickpt.tools.convert",
    "ExportPlan": "unickpt.tools.convert",
    "ImportPlan": "unickpt.tools.convert",
    "materialize": "unickpt.tools.convert",
    "box_of": "unickpt.tools.convert",
    "dict_resolver": "unickpt.tools.convert",
    "TierOptions": "unickpt.options",
}
__getattr__ = lazy_getattr(__name__, _EXPORTS)


class EngineHandle:
    """What a plugin may do with the engine of a process group (:func:`engine`).

    Attributes:
        rank, world_size: this process in the group.
    """

    def __init__(self, engine: Any, owned: bool = False):
        self._engine = engine
        self._owned = owned
        self.rank, self.world_size = engine.rank, engine.world_size

    def save(self, path: str, state: dict, *, async_save: bool = False, storage_options: dict | None = None,
             step: int | None = None, framework: str | None = None, extra: dict | None = None,
             on_commit: Callable[[], None] | None = None, allow_pickle: bool = False, options: Any = None,
             on_error: Callable[[BaseException], bool] | None = None) -> Any:
        """:func:`unickpt.save` into ``path`` (collective), plus ``framework`` and ``extra`` (recorded in
        ``metadata.json``) and ``on_commit`` (called on group rank 0 right after the commit, on the
        commit thread). Returns the :class:`~unickpt.SaveHandle`. First raises EarlierSaveFailedError
        for earlier saves of the group that failed unreported (``on_error``: see
        :meth:`unickpt.engine.Engine.save`)."""
        return self._engine.save(path, state, async_save=async_save, storage_options=storage_options, step=step,
                                 framework=framework, extra=extra, on_commit=on_commit, allow_pickle=allow_pickle,
                                 options=options, on_error=on_error)

    def load(self, path: str, state: dict, *, strict: bool = True, storage_options: dict | None = None,
             allow_pickle: bool = False, verify: bool | None = None, redistribute: bool | None = None,
             options: Any = None, mapping: Any = None) -> Any:
        """:func:`unickpt.load` of ``path`` (collective), after this group's pending saves (``mapping``: a
        cross-framework load, see :func:`unickpt.load`). Returns the :class:`~unickpt.LoadStats`."""
        return self._engine.load(path, state, strict=strict, storage_options=storage_options,
                                 allow_pickle=allow_pickle, verify=verify, redistribute=redistribute, options=options,
                                 mapping=mapping)

    def wait(self) -> None:
        """Block until every pending save of the group has committed; raise EarlierSaveFailedError naming
        every failed save not reported yet."""
        self._engine.wait()

    def in_flight(self, path: str) -> bool:
        """True while a save into ``path`` started by this process on this group has not finished."""
        return self._engine.in_flight(str(path))

    def broadcast(self, obj: Any) -> Any:
        """Group rank 0's ``obj`` on every rank (collective, caller's thread)."""
        return self._engine.broadcast(obj)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in group-rank order (collective, caller's thread)."""
        return self._engine.all_gather(obj)

    @property
    def options(self) -> Any:
        """The group's default :class:`~unickpt.SaveOptions`."""
        return self._engine.options

    def configure(self, **options: Any) -> Any:
        """Change the group's default save options (fields of :class:`~unickpt.SaveOptions`)."""
        return self._engine.configure(**options)

    def close(self) -> None:
        """An engine of :func:`new_engine` only: wait for its saves, then free its threads, staging
        memory and private groups. Raises RuntimeError for a shared engine (:func:`engine`)."""
        if not self._owned:
            raise RuntimeError("unickpt.ext: only an engine made by new_engine() is closed by its plugin")
        self._engine.close()


def engine(process_group: Any = None) -> EngineHandle:
    """The :class:`EngineHandle` of ``process_group`` (default: the world; :data:`THIS_PROCESS`: this
    process alone). Created collectively on first use: every rank of the group must call it first on
    the same thread order (never first inside a background thread)."""
    from .engine import get_engine

    return EngineHandle(get_engine(process_group))


def new_engine(process_group: Any = None) -> EngineHandle:
    """A private engine of ``process_group`` (collective when the group has several ranks), not shared
    with :func:`engine` and not waited for at teardown: the plugin waits for its saves and closes it
    (:meth:`EngineHandle.close`), e.g. to give its staging memory back between runs."""
    from .engine import Engine

    return EngineHandle(Engine(process_group), owned=True)


def load_solo(path: str, state: dict, *, strict: bool = True, storage_options: dict | None = None,
              allow_pickle: bool = False, verify: bool | None = None, redistribute: bool | None = None,
              mapping: Any = None) -> Any:
    """:func:`unickpt.load` in this process alone (a world of one, whatever process groups exist), with
    no engine (no threads, no staging memory): the reader of a file that one process reads by itself."""
    from .dist.comm import Comm
    from .loading.loader import Loader
    from .options import LoadOptions

    changes = {k: v for k, v in (("verify", verify), ("redistribute", redistribute)) if v is not None}
    return Loader(Comm.solo()).load(path, state, strict=strict, storage_options=storage_options,
                                    allow_pickle=allow_pickle, options=LoadOptions(**changes), mapping=mapping)


def default_engine() -> EngineHandle | None:
    """The default group's engine if it exists already (creates nothing: no collective)."""
    from .engine import default_engine as existing

    found = existing()
    return None if found is None else EngineHandle(found)


def read_metadata(path: str, storage_options: dict | None = None) -> Any:
    """The :class:`CheckpointMetadata` of the checkpoint ``path``. Raises CheckpointNotFoundError
    when it is not committed, FormatVersionError / IntegrityError for a bad file."""
    from .format.metadata import read_metadata as read
    from .storage import open_storage

    return read(open_storage(path, storage_options), path)


def remove_checkpoint_dir(storage: Any, path: str) -> None:
    """Remove the checkpoint directory ``path``: ``metadata.json`` first (it is no longer committed),
    then the tree, so a half-removed directory is never loadable. Entries that vanish meanwhile are fine."""
    from .lifecycle.directory import remove_dir

    remove_dir(storage, path)


class TiersHandle:
    """The checkpoint tiers of a plugin (:func:`memory_tiers`; docs/tiers.md).

    Attributes:
        rank, world_size: this process in the group.
        preempted: True once :meth:`step` saw a preemption notice (the plugin then saves persistently).
    """

    def __init__(self, tiers: Any):
        self._tiers = tiers
        self.rank, self.world_size = tiers.rank, tiers.world_size
        self.preempted = False

    @property
    def options(self) -> Any:
        """The validated :class:`~unickpt.TierOptions`."""
        return self._tiers.options

    @property
    def notice(self) -> Any:
        """This process's preemption notice (``.received``: the signal's name; ``.notify()``)."""
        return self._tiers.notice

    def step(self, step: int, state: Any, *, allow_pickle: bool = False) -> bool:
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

    def recover(self, state: Any, *, persisted: int | None = None, step: int | None = None, strict: bool = True,
                allow_pickle: bool = False) -> Any:
        """Restore from memory (collective): the newest step that every rank has in memory (its node's or
        a peer node's) and that is at least as new as ``persisted`` (the plugin's newest persisted step;
        ``step``: exactly that one). ``state``: the state to load into, or ``state(copy path)`` building
        it. Returns ``(step, state loaded, LoadStats)`` or None: then load from storage."""
        result = self._tiers.recover(state, persisted=persisted, only=step, strict=strict, allow_pickle=allow_pickle)
        return None if result is None else (result.step, result.state, result.stats)

    def forget_newer(self, step: int) -> None:
        """After loading ``step`` from storage: drop this node's memory copies of later steps."""
        self._tiers.forget_newer(step)

    def memory_bytes(self) -> dict:
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


def memory_tiers(root: str, options: Any = None, *, process_group: Any = None, save_options: Any = None) -> TiersHandle:
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


if TYPE_CHECKING:
    from .dist.comm import THIS_PROCESS
    from .format.dtypes import dtype_to_str, str_to_dtype
    from .format.layout import METADATA_FILE, WRITER_FILE
    from .format.metadata import CheckpointMetadata
    from .geometry import Box, FlatRange, chunk_pieces
    from .options import TierOptions
    from .lifecycle.directory import (is_committed, is_incomplete_checkpoint, pid_alive, writer_alive,
                                      writer_elsewhere_on_host)
    from .lifecycle.root import LATEST_FILE, CheckpointRoot, step_name
    from .loading.dcp import is_dcp_checkpoint, restore_empty_optim_state
    from .state.codec import decode, encode
    from .state.flat import flatten, optimizers_untouched, saved_leaves, sharded_tensor_shard
    from .storage import StorageBackend, open_storage
    from .loading.convert import (MASTER, PARAM, Layout, SourceNames, StoredParams, TargetNames, locate_checkpoint,
                                  registered_layouts, source_layout)
    from .plan.mapping import Piece, Resolved
    from .tools.convert import Conversion, ExportPlan, ImportPlan, box_of, dict_resolver, materialize
    from .tools.importers import Source
