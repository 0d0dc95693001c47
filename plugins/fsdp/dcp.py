"""``torch.distributed.checkpoint`` (DCP) storage layer backed by unickpt's engine and format.

Code that calls ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` keeps its planners (flattening,
deduplication of replicated tensors, resharding) and only passes a writer or reader::

    dcp.save(state_dict, storage_writer=unickpt.fsdp.StorageWriter(path))
    dcp.async_save(state_dict, storage_writer=unickpt.fsdp.StorageWriter(path))   # stages, then saves in a thread
    dcp.load(state_dict, storage_reader=unickpt.fsdp.StorageReader(path))

:class:`StorageWriter` turns each rank's DCP write items into unickpt box shards (DCP has already
given each replicated chunk to one rank) and saves them with one collective ``unickpt`` save: the
staging pool, checksums, the writer threads and the all-or-nothing commit of ``metadata.json``.
Non-tensor items (DCP ``BYTE_IO``, ``torch.save`` bytes) become plain JSON values grouped as
``unickpt.save`` groups them (``optim.param_groups``, ``step``); one JSON cannot express is kept as a
``uint8`` tensor under ``__dcp_bytes__.<fqn>``. The result is an ordinary unickpt checkpoint (``unickpt.load``,
``unickpt inspect`` and ``verify`` work on it) with no pickle in its metadata. Saves through it may
overlap (``dcp.async_save`` every step without waiting): they run one at a time, in call order
(:class:`_SaveOrder`).

:class:`StorageReader` serves DCP's read items from any unickpt checkpoint (also one written by
``unickpt.save``): the DCP metadata is derived from ``metadata.json`` (flat-range chunks become
their row-major boxes), and the bytes are read with one collective ``unickpt.load`` per
``read_data`` (partial, checksum-verified reads).
"""
from __future__ import annotations

import io
import os
import sys
import threading
import time
import uuid
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader as _DCPReader
from torch.distributed.checkpoint import StorageWriter as _DCPWriter
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from unickpt import CheckpointMetadata, Shard, ext

__all__ = ["StorageWriter", "StorageReader", "BYTES_PREFIX", "CHUNK_PREFIX", "GENERATIONS_DIR", "FRAMEWORK"]

BYTES_PREFIX = "__dcp_bytes__."
"""fqn prefix of DCP non-tensor items (``torch.save`` bytes) stored as ``uint8`` tensors."""
CHUNK_PREFIX = "__dcp_chunk__."
"""Prefix of the chunks of a tensor that some rank holds several chunks of (a ``ShardedTensor`` with
several local shards): each chunk is stored as a tensor of its own, ``__dcp_chunk__.<o0>_<o1>...<fqn>``
(its offsets in the whole tensor), and ``extra.dcp.chunked`` gives the whole tensor's shape."""
GENERATIONS_DIR = ".unickpt-dcp"
"""Subdirectory of a ``StorageWriter`` checkpoint directory that holds each save's files
(``<GENERATIONS_DIR>/<save id>/``) until the next save to the same directory replaces it."""
RANK_DIR = ".unickpt-rank-{rank}"
"""``dcp.save(..., use_collectives=False)``: each rank's own checkpoint, a subdirectory of the path."""
FRAMEWORK = "torch.distributed.checkpoint"


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _path(checkpoint_id: Any) -> str:
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(f"checkpoint_id must be a path or URL (str or os.PathLike), got {type(checkpoint_id).__name__}")
    return os.fspath(checkpoint_id)


def _dcp_wrapper() -> Any:
    """The ``_DistWrapper`` of the ``dcp.save`` / ``dcp.load`` call this method runs in (its process
    group, and whether it is distributed at all: ``no_dist``), found in the calling frames (for
    ``dcp.async_save``'s staging, its ``process_group`` and ``no_dist`` arguments); None when the
    writer or reader is driven directly."""
    import inspect

    from torch.distributed.checkpoint.utils import _DistWrapper

    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame is not None else None
        for _ in range(12):
            if f is None:
                return None
            w = f.f_locals.get("distW")
            if isinstance(w, _DistWrapper):
                return w
            if f.f_code.co_name == "async_save" and f.f_globals.get("__name__", "").endswith("state_dict_saver"):
                # staging (AsyncStager.stage) runs before async_save builds its _DistWrapper
                import types

                loc = f.f_locals
                no_dist = bool(loc.get("no_dist", False))
                return types.SimpleNamespace(group=loc.get("process_group"), use_dist=not no_dist)
            f = f.f_back
        return None
    finally:
        del frame


_SAVER = "torch.distributed.checkpoint.state_dict_saver"


def _saver_frame(*names: str) -> Any:
    """The outermost frame on this thread's stack that runs one of ``names`` of DCP's
    ``state_dict_saver`` module (``save``, ``async_save``, ...); None when there is none (the writer
    is driven directly)."""
    import inspect

    frame, found = inspect.currentframe(), None
    while frame is not None:
        if frame.f_code.co_name in names and frame.f_globals.get("__name__") == _SAVER:
            found = frame
        frame = frame.f_back
    return found


class _Staged(dict):
    """The copy :meth:`StorageWriter.stage` gives ``dcp.async_save``, carrying its save's place in
    :data:`_ORDER` (``ticket``) and the process group the save runs over in DCP's thread when
    ``async_save`` was given none (``group``: :func:`_private_group`); DCP's thread passes it to
    ``dcp.save`` as its ``state_dict``."""

    ticket: int = -1
    group: Any = None


_PRIVATE: list = [None, None]  # [the default group, its gloo copy for async saves]


def _private_group() -> Any:
    """A gloo group of every rank, this process's own for the saves ``dcp.async_save`` runs in its
    thread when given no process group: training keeps the default group to itself (FSDP2 on a world
    mesh uses it; two threads' collectives on one group interleave and hang or crash gloo). Created
    once per default group, collectively (every rank calls ``dcp.async_save``), on the caller's thread."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group()
    if _PRIVATE[0] is not default:
        _PRIVATE[:] = [default, dist.new_group(backend="gloo")]
    return _PRIVATE[1]


class _SaveOrder:
    """The ``dcp.save`` / ``dcp.async_save`` calls through :class:`StorageWriter` in this process run
    one at a time, in the order they were made.

    ``dcp.async_save`` runs each save in a thread of its own; two in flight make the collectives of
    both (DCP's planning and commit, unickpt's save) interleave on one process group, which hangs or
    crashes gloo. Every rank makes its calls in the same order, so a ticket taken at the call, on the
    caller's thread (:meth:`StorageWriter.stage` for ``dcp.async_save``, the save's first writer
    call for ``dcp.save``), orders the saves alike on every rank. A save's first writer call
    (``reset``, ``storage_meta`` or ``set_up_storage_writer``: before DCP's first collective of the
    save) waits until every save with an earlier ticket has left DCP's ``save`` (its frame is off its
    thread's stack: a watcher thread polls every 5 ms). A ticket whose staged copy is gone without
    its save having started (an ``async_save`` that failed after staging) is skipped."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0  # tickets given
        self._serving = 0  # the first ticket whose save has not ended
        self._running: Any = None  # (thread ident, DCP's save frame) of that save once it started
        self._staged: dict[int, Any] = {}  # ticket -> weakref of the copy its dcp.async_save saves

    def ticket(self, staged: Any = None) -> int:
        """The next place in the order (on the caller's thread); ``staged``: the async save's copy."""
        with self._cond:
            t, self._issued = self._issued, self._issued + 1
            if staged is not None:
                self._staged[t] = weakref.ref(staged)
            return t

    def enter(self, frame: Any) -> None:
        """Wait until the save that DCP runs in ``frame`` (its ``save``) may start; at once if it has."""
        with self._cond:
            if self._running is not None and self._running[1] is frame:
                return
            state = frame.f_locals.get("state_dict")
            t = state.ticket if isinstance(state, _Staged) and state.ticket >= 0 else self.ticket()
            while self._running is not None or self._serving != t:
                ref = self._staged.get(self._serving)
                if self._running is None and ref is not None and ref() is None:  # abandoned
                    del self._staged[self._serving]
                    self._serving += 1
                    continue
                self._cond.wait(0.05)
            self._staged.pop(t, None)
            self._running = (threading.get_ident(), frame)
        threading.Thread(target=self._watch, args=(threading.get_ident(), frame), daemon=True,
                         name="unickpt-dcp-save-order").start()

    def _watch(self, ident: int, frame: Any) -> None:
        """Release the turn once ``frame`` (the running save) is off thread ``ident``'s stack."""
        while True:
            f = sys._current_frames().get(ident)
            while f is not None and f is not frame:
                f = f.f_back
            if f is None:
                break
            del f
            time.sleep(0.005)
        with self._cond:
            self._running = None
            self._serving += 1
            self._cond.notify_all()


_ORDER = _SaveOrder()


def _take_turn() -> None:
    """Inside DCP's ``save``: wait for this save's turn in :data:`_ORDER` (see there); then, for a
    ``dcp.async_save`` given no process group, move DCP's collectives of the save onto the staged
    copy's own group (its ``_DistWrapper``, before its first collective)."""
    frame = _saver_frame("save", "save_state_dict", "_save_state_dict")
    if frame is None:
        return
    _ORDER.enter(frame)
    group = getattr(frame.f_locals.get("state_dict"), "group", None)
    del frame
    if group is None:
        return
    import torch.distributed as dist
    from torch.distributed.checkpoint.utils import _DistWrapper

    w = _dcp_wrapper()
    if isinstance(w, _DistWrapper) and w.group is None and w.use_dist:
        w.group = group  # a copy of the default group: the same ranks, the same coordinator
        w.global_coordinator_rank = dist.get_global_rank(group, w.coordinator_rank)


def _dcp_group(own: Any, use_collectives: bool = True) -> Any:
    """The process group a writer or reader (constructed with ``process_group=own``) runs unickpt's
    collectives over: DCP's own (``process_group`` of ``dcp.save`` / ``dcp.load``, else ``own``, else the
    world); :data:`unickpt.ext.THIS_PROCESS` (this process alone) with ``no_dist=True``, without
    an initialised process group, with ``use_collectives=False``, or when ``own`` is ext.THIS_PROCESS."""
    import torch.distributed as dist

    if own is ext.THIS_PROCESS or not use_collectives or not (dist.is_available() and dist.is_initialized()):
        return ext.THIS_PROCESS
    w = _dcp_wrapper()
    if w is None:
        return own
    if not w.use_dist:
        return ext.THIS_PROCESS
    return w.group if w.group is not None else own


def _all_gather(group: Any, obj: Any) -> list:
    """Every group rank's ``obj`` (one ``all_gather_object``); ``[obj]`` for ext.THIS_PROCESS or a world of one."""
    import torch.distributed as dist

    if group is ext.THIS_PROCESS or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def _flatten_both(values: dict) -> dict:
    """``values`` flattened as DCP flattens a state dict now (containers of plain values split per
    element) and as torch <= 2.3 did (such containers whole): the union of both key sets."""
    from torch.distributed.checkpoint import _version
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    new = flatten_state_dict(values)[0]
    before = _version._derived_version
    _version._derived_version = "2_3"
    try:
        old = flatten_state_dict(values)[0]
    finally:
        _version._derived_version = before
    return {**old, **new}


def _chunk_key(fqn: str, offsets: Any) -> str:
    return CHUNK_PREFIX + "_".join(str(int(o)) for o in offsets) + "." + fqn


def _parse_chunk_key(key: str) -> tuple[str, tuple[int, ...]]:
    rest = key[len(CHUNK_PREFIX):]
    offs, _, fqn = rest.partition(".")
    return fqn, tuple(int(o) for o in offs.split("_")) if offs else ()


def _generation(extra: dict) -> object:
    """The generation directory a committed checkpoint's metadata names (``extra["dcp"]["generation"]``), or None."""
    dcp_extra = extra.get("dcp")
    return dcp_extra.get("generation") if isinstance(dcp_extra, dict) else None


def _commit_generation(storage: ext.StorageBackend, path: str, gen: str) -> None:
    """Make the committed save in ``<path>/<gen>`` the checkpoint at ``path``: one commit of ``path``
    (:meth:`~unickpt.ext.CheckpointDir.commit`) with the generation's metadata, its file names prefixed
    by ``gen``, then removal of the checkpoint it replaced (its generation directory, or the data and
    object files a checkpoint written there directly named). Until the commit, the old checkpoint stays
    loadable; other files in ``path`` are left alone."""
    top = ext.CheckpointDir(storage, path)
    meta = _prefixed(ext.CheckpointDir(storage, storage.join(path, gen)).read_metadata(), gen)
    try:  # the checkpoint replaced: its generation is enough, unless it was written into path itself
        raw = top.metadata_bytes() if top.is_committed() else None  # read once, parsed as far as needed
        old_extra = CheckpointMetadata.extra_from_json(raw, source=top.metadata_path) if raw is not None else None
        old = CheckpointMetadata.from_json(raw, source=top.metadata_path) \
            if raw is not None and old_extra is not None and _generation(old_extra) is None else None
    except Exception:  # unreadable: it is replaced, its files are left alone
        old_extra = old = None
    top.commit(meta)
    if old_extra is None:
        return
    old_gen = _generation(old_extra)
    if isinstance(old_gen, str) and old_gen != gen and old_gen.count("/") == 1 and \
            old_gen.startswith(GENERATIONS_DIR + "/") and len(old_gen) > len(GENERATIONS_DIR) + 1:
        try:
            storage.rm(storage.join(path, old_gen))
        except FileNotFoundError:
            pass
        return
    if old is not None:  # a checkpoint written into path itself (unickpt.save, an older StorageWriter)
        keep = {c.file for t in meta.tensors.values() for c in t.explicit}
        files = {c.file for t in old.tensors.values() for c in t.explicit}
        files |= set(old.per_rank.get("files") or [])
        files |= _split_files(storage, path, old.index)
        gone = sorted(f for f in files - keep if isinstance(f, str) and ".." not in f.split("/"))
        for rel in [*gone, ext.CheckpointDir.WRITER_NAME]:  # and the writer record of that save
            try:
                storage.rm(storage.join(path, rel))
            except FileNotFoundError:
                pass
        for folder in sorted({rel.rsplit("/", 1)[0] for rel in gone if "/" in rel}, reverse=True):
            if not storage.listdir(storage.join(path, folder)):  # data/, objects/: emptied, not the user's
                storage.rm(storage.join(path, folder))


def _remove_dead_generations(storage: ext.StorageBackend, path: str, gen: str) -> None:
    """Remove the generations in ``<path>/<GENERATIONS_DIR>`` other than ``gen`` whose writer is gone (the
    leftovers of failed or killed saves; each uncommitted first)."""
    gens = storage.join(path, GENERATIONS_DIR)
    current = gen.rsplit("/", 1)[-1]
    try:
        names = [n.rstrip("/").rsplit("/", 1)[-1] for n in storage.listdir(gens)]
    except FileNotFoundError:
        names = []
    for name in names:
        d = ext.CheckpointDir(storage, storage.join(gens, name))
        if name != current and not d.writer_alive():
            d.remove()


def _prefixed(meta: CheckpointMetadata, gen: str) -> CheckpointMetadata:
    """``meta`` with every file it names under the generation directory ``gen`` (chunks, per-rank
    objects; format v2: the index prefix of split tensors' data and index files), and ``gen`` recorded
    as ``extra.dcp.generation``."""
    import dataclasses
    import posixpath

    def moved(t: Any) -> Any:
        return dataclasses.replace(t, explicit=tuple(dataclasses.replace(c, file=posixpath.join(gen, c.file))
                                                     for c in t.explicit))

    per_rank = dict(meta.per_rank)
    if per_rank.get("files"):
        per_rank["files"] = [None if f is None else posixpath.join(gen, f) for f in per_rank["files"]]
    index = dict(meta.index)
    if index:
        index["prefix"] = posixpath.join(gen, index["prefix"]) if index.get("prefix") else gen
    return dataclasses.replace(meta, tensors={fqn: moved(t) for fqn, t in meta.tensors.items()}, per_rank=per_rank,
                               index=index, extra={**meta.extra, "dcp": {**(meta.extra.get("dcp") or {}),
                                                                         "generation": gen}})


def _split_files(storage: ext.StorageBackend, path: str, index: dict) -> set[str]:
    """Format v2, a checkpoint written into ``path`` itself (its metadata's ``index``): the index files
    and data files of its writers (split tensors' parts are in ``data/<rank>_<n>.bin``, named by rank,
    not listed)."""
    writers = index.get("writers")
    if not isinstance(writers, int) or index.get("prefix"):
        return set()
    names = set(storage.listdir(storage.join(path, "data")))
    return ({f"index/{k}.idx" for k in range(writers)}
            | {f"data/{n}" for n in names if n.endswith(".bin") and n.split("_")[0].isdigit()
               and int(n.split("_")[0]) < writers})


def _jsonable_mapping(planner_data: Any) -> Any:
    """DefaultSavePlanner's flattening mapping ``{fqn: (key, ...)}`` as JSON (keys are str or int)."""
    if not isinstance(planner_data, dict):
        return None
    out = {}
    for fqn, path in planner_data.items():
        if not isinstance(path, (tuple, list)) or not all(isinstance(k, (str, int)) for k in path):
            return None
        out[fqn] = list(path)
    return out


def _plain_value(raw: bytes) -> tuple[bool, Any]:
    """``(True, value)`` when DCP's ``torch.save`` bytes of a non-tensor item hold a value unickpt stores
    as JSON (numbers, strings, None, lists, tuples, dicts of those: restricted unpickling with
    ``weights_only=True``, so nothing runs); ``(False, None)`` otherwise (kept as bytes)."""
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
        ext.Codec.encode(value, allow_pickle=False)
    except Exception:  # UnsafeObjectError (not JSON-expressible), UnpicklingError (not weights_only-loadable), ...
        return False, None
    if isinstance(value, torch.Tensor) or _holds_tensor(value):
        return False, None
    return True, value


def _holds_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, dict):
        return any(_holds_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v) for v in x)
    return False


def _listify(x: Any) -> Any:
    """Nested dicts with keys 0..n-1 as lists (DCP's ``set_element`` rebuilds int path keys as lists)."""
    if isinstance(x, dict) and x and all(isinstance(k, int) for k in x) and sorted(x) == list(range(len(x))):
        return [_listify(x[i]) for i in range(len(x))]
    return {k: _listify(v) for k, v in x.items()} if isinstance(x, dict) else x


class StorageWriter(_DCPWriter, AsyncStager):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) that saves through unickpt.

    Args:
        path: the checkpoint directory (local path or fsspec URL); or give it as ``checkpoint_id``
            to ``dcp.save``. As with DCP's ``FileSystemWriter``, a checkpoint already there is
            replaced when the new one commits (it stays loadable until then), and other files in the
            directory are left alone.
        process_group: the ranks taking part when ``dcp.save`` is given none (default: the world).
            The group ``dcp.save`` itself uses wins (its ``process_group``; a world of one with
            ``no_dist=True``); ``unickpt.ext.THIS_PROCESS`` saves this process alone.
        storage_options: passed to the fsspec filesystem.
        overwrite: False refuses a path that already holds a committed checkpoint
            (:class:`unickpt.CheckpointExistsError`), like ``FileSystemWriter(overwrite=False)``.

    ``dcp.save(..., use_collectives=False)`` makes each rank save alone, into
    ``<path>/.unickpt-rank-<rank>`` (``dcp.load`` finds it through ``read_metadata(rank=...)``).
    ``dcp.async_save`` uses :meth:`stage` on the caller's thread (a copy of every tensor into
    reused host buffers: ``torch.distributed.checkpoint.staging.DefaultStager``, pinned memory on
    CUDA) and runs the save in its background thread. Saves through StorageWriter overlap safely:
    they run one at a time, in the order of the calls (:class:`_SaveOrder`), and an ``async_save``
    given no process group runs on a gloo copy of the default group (:func:`_private_group`), not
    on the group training uses. Raises what :func:`unickpt.save` raises; ValueError at
    ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, process_group: Any = None,
                 storage_options: dict | None = None, overwrite: bool = True):
        self.path = None if path is None else _path(path)
        self.group = process_group
        self.storage_options = storage_options
        self.overwrite = overwrite
        self._planner_data: Any = None
        self._stager: Any = None
        self._in_flight = 0  # staged copies not yet written (dcp.async_save calls that have not finished)
        self._lock = threading.Lock()
        self._save_group: Any = process_group  # the group of the save under way (set_up_storage_writer)
        self._target: str | None = None  # the checkpoint directory of the save under way
        self._generation: str | None = None  # its files' subdirectory, agreed by every rank in write_data
        self.save_id = ""
        self.stats: Any = None  # the last save's unickpt SaveStats

    # -- StorageWriter ----------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        _take_turn()  # an earlier save through this writer may still be running: its path stays
        if checkpoint_id is not None:
            self.path = _path(checkpoint_id)
        self._planner_data = None
        self._generation = None
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int | None = None,
                              use_collectives: bool = True, **kwargs: Any) -> None:
        """Follow ``dcp.save``'s group and mode (see the class docstring) and create that group's
        engine, collectively, on the caller's thread."""
        _take_turn()
        self.is_coordinator = is_coordinator
        self.save_id = uuid.uuid4().hex  # dcp.save calls reset() only when given a checkpoint_id
        self._generation = None
        self._save_group = _dcp_group(self.group, use_collectives)
        self._target = self.path
        if not use_collectives and self.path is not None:
            import torch.distributed as dist

            r = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
            self._target = ext.open_storage(self.path, self.storage_options).join(self.path, RANK_DIR.format(rank=r))
        ext.engine(self._save_group)  # created collectively here, never first inside a background thread

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._planner_data = plan.planner_data
        if not self.overwrite and self.path is not None:
            from unickpt import CheckpointExistsError

            target = self._target or self.path
            storage = ext.open_storage(target, self.storage_options)
            if ext.CheckpointDir(storage, target).is_committed():
                raise CheckpointExistsError(f"{target!r} already holds a committed checkpoint and the writer has "
                                            "overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Save this rank's items with one collective unickpt save into a new generation directory
        of the checkpoint (committed there; :meth:`finish` makes it the checkpoint); return their
        ``WriteResult`` s."""
        try:
            return self._write_data(plan, planner)
        finally:
            with self._lock:  # the staged copy this save read from may be reused by the next stage()
                self._in_flight = max(0, self._in_flight - 1)

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        if self.path is None:
            raise ValueError("StorageWriter: no checkpoint path (pass it to StorageWriter(path) or as checkpoint_id)")
        target = self._target or self.path
        items: dict[str, list[tuple[Any, Any]]] = {}  # state key -> [(leaf, chunk offsets)]
        results = []
        plain: dict[str, Any] = {}  # DCP fqn -> non-tensor value that unickpt stores as a plain (JSON) value
        shapes: dict[str, list[int]] = {}  # tensor fqn -> whole shape
        local_error = None  # raised on every rank after the exchange below, never before a collective
        try:
            for item in plan.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    data = planner.resolve_data(item)
                    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    found, value = _plain_value(raw)
                    if found:
                        plain[fqn] = value
                        results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=None))
                        continue
                    key = BYTES_PREFIX + fqn
                    if key in items:
                        raise ValueError(f"StorageWriter: the non-tensor item {fqn!r} twice on one rank")
                    leaf = Shard(torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8),
                                 (len(raw),), offsets=(0,))
                    items[key] = [(leaf, None)]
                    nbytes = len(raw)
                else:
                    td = item.tensor_data
                    assert td is not None  # DCP gives every tensor write item its chunk and size
                    resolved = planner.resolve_data(item)
                    if not isinstance(resolved, torch.Tensor):
                        raise TypeError(f"StorageWriter: the tensor item {fqn!r} resolved to a "
                                        f"{type(resolved).__name__}, not a tensor")
                    tensor = resolved.detach()
                    offsets = tuple(int(o) for o in td.chunk.offsets)
                    leaf = Shard(tensor.reshape(tuple(td.chunk.sizes)), tuple(td.size), offsets=offsets)
                    items.setdefault(fqn, []).append((leaf, offsets))
                    shapes[fqn] = [int(n) for n in td.size]
                    nbytes = tensor.numel() * tensor.element_size()
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        except Exception as e:
            local_error = f"{type(e).__name__}: {e}"
        several = {fqn for fqn, lst in items.items() if len(lst) > 1}
        keys = set(items) - several
        roots, chunked, generation = self._exchange(plain, keys, several, shapes, local_error)
        state: dict[str, Any] = {}
        for key, lst in items.items():
            if key in chunked:  # each chunk a tensor of its own (a ShardedTensor with several local shards somewhere)
                for leaf, offsets in lst:
                    t = leaf.tensor
                    state[_chunk_key(key, offsets)] = Shard(t, tuple(t.shape), offsets=(0,) * t.dim())
            else:
                state[key] = lst[0][0]
        state.update(roots)  # never a tensor's fqn (checked in _exchange)
        extra = {"dcp": {"planner_data": _jsonable_mapping(self._planner_data), "save_id": generation.rsplit("/", 1)[-1],
                         "chunked": chunked}}
        self._generation = generation
        storage = ext.open_storage(target, self.storage_options)
        handle = ext.engine(self._save_group).save(storage.join(target, generation), state,
                                                   storage_options=self.storage_options, framework=FRAMEWORK, extra=extra)
        self.stats = handle.stats
        return _done(results)

    def _exchange(self, plain: dict[str, Any], keys: set[str], several: set[str], shapes: dict[str, list[int]],
                  local_error: str | None) -> tuple[dict[str, Any], dict[str, list[int]], str]:
        """One ``all_gather_object`` over the save's group: the plain values regrouped
        (:meth:`_plain_roots`), the tensors some rank holds several chunks of (``{fqn: shape}``,
        stored chunk by chunk), and group rank 0's generation directory (the same on every rank). A
        rank's ``local_error`` is raised on every rank (ValueError naming the rank), so no rank is
        left waiting in the save."""
        mapping = self._planner_data if isinstance(self._planner_data, dict) else {}

        def path(fqn: str) -> tuple:
            p = mapping.get(fqn)
            return tuple(p) if isinstance(p, (tuple, list)) and p else (fqn,)

        blocked = {path(f) for f in mapping if f not in plain}  # tensors and pickled bytes, this rank
        blocked |= {path(k[len(BYTES_PREFIX):]) if k.startswith(BYTES_PREFIX) else path(k) for k in keys | several}
        mine = ({f: (path(f), v) for f, v in plain.items()}, blocked, local_error,
                {f: shapes[f] for f in several}, f"{GENERATIONS_DIR}/{self.save_id}")
        every = _all_gather(self._save_group, mine)
        failed = [(rank, e[2]) for rank, e in enumerate(every) if e[2]]
        if failed:
            raise ValueError(f"StorageWriter: nothing saved to {self.path!r}; rank {failed[0][0]} failed: {failed[0][1]}")
        chunked: dict[str, list[int]] = {}
        for e in every:
            chunked.update(e[3])
        return self._plain_roots(every), dict(sorted(chunked.items())), every[0][4]

    def _plain_roots(self, every: list) -> dict[str, Any]:
        """Every rank's plain values (DCP gave each one to a single rank), regrouped the way
        ``unickpt.save`` stores the same state: each value under the outermost key of its path that
        holds no tensor (``optim.param_groups`` as one list, ``step``), so that ``unickpt.load`` of
        ``{"model": model, "optim": optim, "step": 0}`` reads a checkpoint written by ``dcp.save``.
        ``every``: each rank's ``(values, blocked paths, ...)`` from :meth:`_exchange`; every rank
        returns the same values (the engine stores rank 0's)."""
        values: dict[str, tuple[tuple, Any]] = {}
        blocked = set()
        for vals, blk, *_ in every:
            for f, pv in vals.items():
                values.setdefault(f, pv)
            blocked |= blk
        blocked -= {p for p, _ in values.values()}
        prefixes = {p[:i] for p in blocked for i in range(1, len(p) + 1)}
        roots: dict[str, Any] = {}
        for f in sorted(values, key=lambda k: values[k][0].__repr__()):
            p, v = values[f]
            n = next((i for i in range(1, len(p) + 1) if p[:i] not in prefixes), len(p))
            root = ".".join(map(str, p[:n]))
            rel = p[n:]
            if not rel:
                roots[root] = v
                continue
            node = roots.setdefault(root, {})
            for k in rel[:-1]:
                node = node.setdefault(k, {})
            node[rel[-1]] = v
        taken = sorted(set(roots) & {".".join(map(str, p)) for p in blocked})  # the same on every rank
        if taken:
            raise ValueError(f"StorageWriter: the non-tensor value {taken[0]!r} has the fqn of a tensor; rename one")
        return {k: ext.StateTools.restore_empty_optim_state(_listify(v)) for k, v in roots.items()}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's commit point (the coordinator, once every rank has written; every rank with
        ``use_collectives=False``): the generation committed by :meth:`write_data` becomes the
        checkpoint at the path (one atomic replace of ``metadata.json``), the checkpoint it replaces
        and the leftovers of failed or killed saves (other generations whose writer process is gone)
        are removed."""
        if self._generation is None:
            raise RuntimeError("StorageWriter.finish: no save was written (write_data did not run)")
        target = self._target or self.path
        assert target is not None
        storage = ext.open_storage(target, self.storage_options)
        _commit_generation(storage, target, self._generation)
        _remove_dead_generations(storage, target, self._generation)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        _take_turn()  # DCP's first call of a save without checkpoint_id, before its first collective
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    # -- AsyncStager ---------------------------------------------------------------------------------
    _synchronize_after_execute = False  # stage() returns only when the copy is complete

    def stage(self, state_dict: dict) -> dict:
        """A copy of ``state_dict`` no later change to the training state can reach (tensors copied
        into host buffers that are reused by the next save of the same layout once this save has
        written them; while an earlier ``async_save`` through this writer is still writing, the copy
        goes into fresh buffers instead, so the earlier checkpoint keeps the values it staged).

        Called by ``dcp.async_save``, the copy also takes the save's place in the order in which the
        saves through StorageWriter run, one at a time (:class:`_SaveOrder`). Raises ValueError for
        ``async_checkpointer_type=AsyncCheckpointerType.PROCESS`` (before copying anything)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        call = _saver_frame("async_save")
        from_async_save = call is not None  # not a direct call
        args = dict(call.f_locals) if from_async_save else {}
        del call
        kind = args.get("async_checkpointer_type")
        if getattr(kind, "name", None) == "PROCESS":
            raise ValueError("unickpt.fsdp.StorageWriter does not support dcp.async_save(..., async_checkpointer_type="
                             "AsyncCheckpointerType.PROCESS): DCP's checkpoint process would need the writer pickled "
                             "and the process group rebuilt there; use the default AsyncCheckpointerType.THREAD "
                             "(the bytes are written by unickpt's writer threads either way)")
        import torch.distributed as dist

        private = None
        if (from_async_save and self.group is None and args.get("process_group") is None and not args.get("no_dist")
                and args.get("use_collectives", True) and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            private = _private_group()
        ext.engine(private if private is not None else _dcp_group(self.group))  # on the caller's thread, collectively
        cuda = torch.cuda.is_available()
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                 use_non_blocking_copy=cuda)
        with self._lock:
            busy = self._in_flight > 0
            self._in_flight += 1
        if busy:  # the cached buffers are being written by the earlier save: copy into new ones
            once = DefaultStager(options)
            try:
                copied = once.stage(state_dict)
                assert isinstance(copied, dict)  # use_async_staging=False: the staged dict itself, never a Future
                staged = _Staged(copied)
            finally:
                once.close()
        else:
            if self._stager is None:
                self._stager = DefaultStager(options)
            staged = _Staged(self._stager.stage(state_dict))
        if from_async_save:  # its place in the order of saves
            staged.group = private
            staged.ticket = _ORDER.ticket(staged)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies synchronously."""

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


class StorageReader(_DCPReader):
    """A DCP ``StorageReader`` over any unickpt checkpoint.

    Args:
        path: the checkpoint directory (or ``checkpoint_id`` of ``dcp.load``).
        process_group: the ranks taking part when ``dcp.load`` is given none (default: the world);
            ``dcp.load``'s own group wins (a world of one with ``no_dist=True``), as for
            :class:`StorageWriter`.
        storage_options: passed to the fsspec filesystem.
        verify: check every byte read against its checksum block.

    Plain values of a checkpoint written by ``unickpt.save`` are offered to DCP as bytes items (JSON
    decoded, then ``torch.save`` d for DCP's ``load_bytes``); per-rank state is not offered. A
    ``dcp.save(..., use_collectives=False)`` checkpoint is read per rank (``read_metadata(rank=r)``,
    which DCP calls when the path holds no checkpoint of the whole group). Raises what
    :func:`unickpt.load` raises (CheckpointNotFoundError, IntegrityError, ...); a target of another
    dtype than the stored one raises TypeError (never cast).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, process_group: Any = None,
                 storage_options: dict | None = None, verify: bool = True):
        self.path = None if path is None else _path(path)
        self.group = process_group
        self.storage_options = storage_options
        self.verify = verify
        self.meta: CheckpointMetadata | None = None
        self._plain: dict[str, Any] | None = None
        self._target: str | None = None  # the directory read: path, or a rank's own (use_collectives=False)
        self._load_group: Any = process_group
        self.load_id = ""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = _path(checkpoint_id)
        self.meta = None
        self._plain = None
        self._target = None
        self.load_id = uuid.uuid4().hex

    def _dir(self) -> str:
        if self.path is None:
            raise ValueError("StorageReader: no checkpoint path (pass it to StorageReader(path) or as checkpoint_id)")
        return self._target or self.path

    def _meta(self) -> CheckpointMetadata:
        if self.meta is None:
            path = self._dir()
            storage = ext.open_storage(path, self.storage_options)
            if ext.StateTools.is_dcp_checkpoint(storage, path):
                raise ValueError(f"{path!r} was written by DCP's own FileSystemWriter (.metadata, no metadata.json); "
                                 "unickpt.fsdp.StorageReader reads unickpt checkpoints: load it with dcp.load's default "
                                 "reader, or with unickpt.load(path, state, allow_pickle=True)")
            self.meta = ext.CheckpointDir.open(path, self.storage_options).read_metadata()
        return self.meta

    def read_metadata(self, *args: Any, rank: int | None = None, **kwargs: Any) -> Metadata:
        """DCP metadata derived from ``metadata.json``: one chunk per stored box (flat ranges split
        into their row-major boxes; a tensor stored chunk by chunk as its chunks), bytes entries for
        DCP non-tensor items and plain values. ``rank``: read that rank's own checkpoint (written
        with ``use_collectives=False``). Raises CheckpointNotFoundError when there is none."""
        if rank is not None:
            assert self.path is not None
            self._target = ext.open_storage(self.path, self.storage_options).join(self.path, RANK_DIR.format(rank=rank))
            self.meta = None
            self._plain = None
        meta = self._meta()
        chunked = (meta.extra.get("dcp") or {}).get("chunked") or {}
        sdm: dict[str, Any] = {}
        for fqn, tm in meta.tensors.items():
            if fqn.startswith(BYTES_PREFIX):
                sdm[fqn[len(BYTES_PREFIX):]] = BytesStorageMetadata()
                continue
            if fqn.startswith(CHUNK_PREFIX):
                whole, offsets = _parse_chunk_key(fqn)
                entry = sdm.get(whole)
                if entry is None:
                    entry = sdm[whole] = TensorStorageMetadata(TensorProperties(dtype=ext.Codec.str_to_dtype(tm.dtype)),
                                                               torch.Size(chunked[whole]), [])
                entry.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(tm.shape)))
                continue
            chunks = [ChunkStorageMetadata(torch.Size(p.box.offsets), torch.Size(p.box.lengths))
                      for spec in tm.specs() for p in ext.StateTools.chunk_pieces(spec, tm.shape)]
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=ext.Codec.str_to_dtype(tm.dtype)), torch.Size(tm.shape), chunks)
        for alias, source in meta.aliases.items():
            if source in sdm:
                sdm[alias] = sdm[source]
        for key in self._objects():
            sdm.setdefault(key, BytesStorageMetadata())
        mapping = (meta.extra.get("dcp") or {}).get("planner_data")
        planner_data = {k: tuple(v) for k, v in mapping.items()} if isinstance(mapping, dict) else None
        return Metadata(state_dict_metadata=sdm, planner_data=planner_data,
                        storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id))

    def _objects(self) -> dict[str, Any]:
        """Plain values of the checkpoint, decoded (never unpickled) and keyed the way DCP flattens a
        state dict (``torch.distributed.checkpoint._nested_dict.flatten_state_dict``): both per
        element (``optim.param_groups.0.lr``, torch >= 2.4) and per container (``optim.param_groups``,
        the keys of torch <= 2.3). DCP's load planner falls back to the latter whenever the checkpoint
        has keys the state to load lacks (FSDP1 ranks that hold no element of a parameter), and then
        needs them (else "Missing key in checkpoint state_dict: optim.param_groups")."""
        if self._plain is None:
            from unickpt import UnsafeObjectError

            _, _, objects = ext.StateTools.saved_leaves(self._meta().state_tree)
            decoded = {}
            for fqn, enc in objects.items():
                try:
                    decoded[fqn] = ext.Codec.decode(enc, allow_pickle=False, key=fqn)
                except UnsafeObjectError:
                    continue  # a pickled value: not offered to DCP
            self._plain = _flatten_both(decoded) if decoded else {}
        return self._plain

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, rank: int | None = None,
                              use_collectives: bool = True, **kwargs: Any) -> None:
        """Follow ``dcp.load``'s group and mode and create that group's engine, collectively."""
        self.is_coordinator = is_coordinator
        self._load_group = _dcp_group(self.group, use_collectives)
        self._meta()
        ext.engine(self._load_group)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _source(self, item: Any) -> tuple[str, list[int]]:
        """The stored tensor an item reads from and the lower corner of its box in that tensor."""
        meta = self._meta()
        fqn = item.storage_index.fqn
        source = meta.aliases.get(fqn, fqn)
        if source not in meta.tensors and item.storage_index.offset is not None:
            key = _chunk_key(source, item.storage_index.offset)
            if key in meta.tensors:  # stored chunk by chunk: the box is relative to the chunk
                return key, [int(s) for s in item.storage_offsets]
        return source, [o + s for o, s in zip(item.storage_index.offset, item.storage_offsets)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Read this rank's items with one collective unickpt load (every rank calls it, with or
        without items): per stored tensor, the bounding box of its items is loaded (resharded,
        verified): straight into DCP's target when one item covers it (a contiguous target of the
        stored dtype), else into a buffer from which each item's box is copied."""
        meta = self._meta()
        objects = self._objects()
        boxes: dict[str, list[int]] = {}  # stored key -> bounding box lo + hi
        count: dict[str, int] = {}
        sources = {}
        for i, item in enumerate(plan.items):
            if item.type == LoadItemType.BYTE_IO:
                continue
            source, lo = sources[i] = self._source(item)
            hi = [a + n for a, n in zip(lo, item.lengths)]
            old = boxes.get(source)
            nd = len(lo)
            count[source] = count.get(source, 0) + 1
            boxes[source] = lo + hi if old is None else (
                [min(a, b) for a, b in zip(old[:nd], lo)] + [max(a, b) for a, b in zip(old[nd:], hi)])
        # DCP's own readers copy_ into the target, casting silently; unickpt never casts (raised after the
        # collective load below, so that no rank is left waiting)
        mismatch = None
        direct: dict[int, torch.Tensor] = {}  # item index -> target the bytes are read into
        for i, item in sorted(((i, it) for i, it in enumerate(plan.items) if it.type != LoadItemType.BYTE_IO),
                              key=lambda x: x[1].storage_index.fqn):
            source, lo = sources[i]
            stored, target = ext.Codec.str_to_dtype(meta.tensors[source].dtype), planner.resolve_tensor(item)
            if target.dtype != stored:
                mismatch = mismatch or TypeError(
                    f"{item.storage_index.fqn!r}: the checkpoint {self._dir()!r} stores {stored}, the state to load "
                    f"into has {target.dtype}; unickpt never casts on load (convert after loading)")
                continue
            target = target.detach()
            if (count[source] == 1 and target.device.type == "cpu" and target.is_contiguous()
                    and list(target.shape) == [int(n) for n in item.lengths]):
                direct[i] = target
        state: dict[str, Any] = {}
        buffers: dict[str, tuple[torch.Tensor, list[int]]] = {}
        direct_sources = {sources[i][0]: i for i in direct}
        for source, box in boxes.items():
            tm = meta.tensors[source]
            nd = len(tm.shape)
            lo, hi = box[:nd], box[nd:]
            if source in direct_sources:
                buf = direct[direct_sources[source]]
            else:
                buf = torch.empty([b - a for a, b in zip(lo, hi)], dtype=ext.Codec.str_to_dtype(tm.dtype))
            state[source] = Shard(buf, tm.shape, offsets=lo)
            buffers[source] = (buf, lo)
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                continue
            fqn = item.storage_index.fqn
            key = BYTES_PREFIX + fqn
            if key in meta.tensors:
                state[key] = torch.empty(meta.tensors[key].shape, dtype=torch.uint8)
            elif fqn not in objects:
                raise KeyError(f"{fqn!r}: not in the checkpoint {self._dir()!r}")
        if mismatch is None:
            ext.engine(self._load_group).load(self._dir(), state, strict=False, storage_options=self.storage_options,
                                              verify=self.verify)
        else:  # every rank joins the collective load, with nothing to read here, then raises
            ext.engine(self._load_group).load(self._dir(), {}, strict=False, storage_options=self.storage_options,
                                              verify=self.verify)
            raise mismatch
        for i, item in enumerate(plan.items):
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                key = BYTES_PREFIX + fqn
                if key in state:
                    raw = state[key].numpy().tobytes()
                else:
                    stream = io.BytesIO()
                    torch.save(objects[fqn], stream)
                    raw = stream.getvalue()
                planner.load_bytes(item, io.BytesIO(raw))
                continue
            if i in direct:
                planner.commit_tensor(item, direct[i])
                continue
            source, lo_item = sources[i]
            buf, lo = buffers[source]
            src = buf
            for d, (a, n) in enumerate(zip(lo_item, item.lengths)):
                src = src.narrow(d, a - lo[d], n)
            target = planner.resolve_tensor(item).detach()
            if target.shape != src.shape:
                raise ValueError(f"{fqn!r}: DCP target of shape {list(target.shape)} for a stored box of shape "
                                 f"{list(src.shape)}")
            target.copy_(src)
            planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
