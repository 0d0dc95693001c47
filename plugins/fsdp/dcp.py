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
``unickpt inspect`` and ``verify`` work on it) with no pickle in its metadata.

:class:`StorageReader` serves DCP's read items from any unickpt checkpoint (also one written by
``unickpt.save``): the DCP metadata is derived from ``metadata.json`` (flat-range chunks become
their row-major boxes), and the bytes are read with one collective ``unickpt.load`` per
``read_data`` (partial, checksum-verified reads).
"""
from __future__ import annotations

import io
import os
import threading
import uuid
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

from unickpt import Shard
from unickpt.codec import str_to_dtype
from unickpt.dcp_compat import is_dcp_checkpoint, restore_empty_optim_state
from unickpt.engine import get_engine
from unickpt.metadata import CheckpointMetadata, read_metadata
from unickpt.resharding import chunk_pieces
from unickpt.state import saved_leaves
from unickpt.storage import Storage

__all__ = ["StorageWriter", "StorageReader", "BYTES_PREFIX", "FRAMEWORK"]

BYTES_PREFIX = "__dcp_bytes__."
"""fqn prefix of DCP non-tensor items (``torch.save`` bytes) stored as ``uint8`` tensors."""
FRAMEWORK = "torch.distributed.checkpoint"


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _path(checkpoint_id: Any) -> str:
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(f"checkpoint_id must be a path or URL (str or os.PathLike), got {type(checkpoint_id).__name__}")
    return os.fspath(checkpoint_id)


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
    from unickpt import codec

    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
        codec.encode(value, allow_pickle=False)
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
            to ``dcp.save``. A committed checkpoint there is never overwritten
            (:class:`unickpt.CheckpointExistsError`).
        process_group: the ranks taking part (default: world); the same group as ``dcp.save``'s.
        storage_options: passed to the fsspec filesystem.

    ``dcp.async_save`` uses :meth:`stage` on the caller's thread (a copy of every tensor into
    reused host buffers: ``torch.distributed.checkpoint.staging.DefaultStager``, pinned memory on
    CUDA) and runs the save in its background thread. Raises what :func:`unickpt.save` raises.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, process_group: Any = None,
                 storage_options: dict | None = None):
        self.path = None if path is None else _path(path)
        self.group = process_group
        self.storage_options = storage_options
        self._planner_data: Any = None
        self._stager: Any = None
        self._in_flight = 0  # staged copies not yet written (dcp.async_save calls that have not finished)
        self._lock = threading.Lock()
        self.save_id = ""
        self.stats: Any = None  # the last save's unickpt SaveStats

    # -- StorageWriter ----------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = _path(checkpoint_id)
        self._planner_data = None
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        get_engine(self.group)  # created collectively here, never first inside a background thread

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._planner_data = plan.planner_data
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Save this rank's items with one collective unickpt save; return their ``WriteResult`` s."""
        try:
            return self._write_data(plan, planner)
        finally:
            with self._lock:  # the staged copy this save read from may be reused by the next stage()
                self._in_flight = max(0, self._in_flight - 1)

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        if self.path is None:
            raise ValueError("StorageWriter: no checkpoint path (pass it to StorageWriter(path) or as checkpoint_id)")
        state: dict[str, Any] = {}
        results = []
        plain: dict[str, Any] = {}  # DCP fqn -> non-tensor value that unickpt stores as a plain (JSON) value
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
                    leaf = Shard(torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8),
                                 (len(raw),), offsets=(0,))
                    nbytes = len(raw)
                else:
                    td = item.tensor_data
                    tensor = planner.resolve_data(item).detach()
                    key = fqn
                    leaf = Shard(tensor.reshape(tuple(td.chunk.sizes)), tuple(td.size), offsets=tuple(td.chunk.offsets))
                    nbytes = tensor.numel() * tensor.element_size()
                if key in state:
                    raise ValueError(f"StorageWriter: {fqn!r} has several chunks on one rank (a ShardedTensor with several "
                                     "local shards), which unickpt does not store")
                state[key] = leaf
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        except Exception as e:
            local_error = f"{type(e).__name__}: {e}"
        state.update(self._plain_roots(plain, state, local_error))  # never a tensor's fqn (checked there)
        extra = {"dcp": {"planner_data": _jsonable_mapping(self._planner_data), "save_id": self.save_id}}
        handle = get_engine(self.group).save(self.path, state, storage_options=self.storage_options,
                                             framework=FRAMEWORK, extra=extra)
        self.stats = handle.stats
        return _done(results)

    def _plain_roots(self, plain: dict[str, Any], state: dict[str, Any], local_error: str | None = None) -> dict[str, Any]:
        """Every rank's plain values (DCP gave each one to a single rank), regrouped the way
        ``unickpt.save`` stores the same state: each value under the outermost key of its path that
        holds no tensor (``optim.param_groups`` as one list, ``step``), so that ``unickpt.load`` of
        ``{"model": model, "optim": optim, "step": 0}`` reads a checkpoint written by ``dcp.save``.
        One ``all_gather_object`` over the writer's group; every rank returns the same values (the
        engine stores rank 0's). A rank's ``local_error`` is raised on every rank (ValueError naming
        the rank), so no rank is left waiting in the save."""
        import torch.distributed as dist

        mapping = self._planner_data if isinstance(self._planner_data, dict) else {}

        def path(fqn: str) -> tuple:
            p = mapping.get(fqn)
            return tuple(p) if isinstance(p, (tuple, list)) and p else (fqn,)

        blocked = {path(f) for f in mapping if f not in plain}  # tensors and pickled bytes, this rank
        blocked |= {path(k[len(BYTES_PREFIX):]) if k.startswith(BYTES_PREFIX) else path(k) for k in state}
        mine = ({f: (path(f), v) for f, v in plain.items()}, blocked, local_error)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            every: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(every, mine, group=self.group)
        else:
            every = [mine]
        failed = [(rank, err) for rank, (_, _, err) in enumerate(every) if err]
        if failed:
            raise ValueError(f"StorageWriter: nothing saved to {self.path!r}; rank {failed[0][0]} failed: {failed[0][1]}")
        values: dict[str, tuple[tuple, Any]] = {}
        blocked = set()
        for vals, blk, _ in every:
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
        return {k: restore_empty_optim_state(_listify(v)) for k, v in roots.items()}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing left: every rank's bytes were committed by the unickpt save in :meth:`write_data`."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    # -- AsyncStager ---------------------------------------------------------------------------------
    _synchronize_after_execute = False  # stage() returns only when the copy is complete

    def stage(self, state_dict: dict) -> dict:
        """A copy of ``state_dict`` no later change to the training state can reach (tensors copied
        into host buffers that are reused by the next save of the same layout once this save has
        written them; while an earlier ``async_save`` through this writer is still writing, the copy
        goes into fresh buffers instead, so the earlier checkpoint keeps the values it staged)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        get_engine(self.group)  # on the caller's thread, collectively
        cuda = torch.cuda.is_available()
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                 use_non_blocking_copy=cuda)
        with self._lock:
            busy = self._in_flight > 0
            self._in_flight += 1
        if busy:  # the cached buffers are being written by the earlier save: copy into new ones
            once = DefaultStager(options)
            try:
                return once.stage(state_dict)
            finally:
                once.close()
        if self._stager is None:
            self._stager = DefaultStager(options)
        return self._stager.stage(state_dict)

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
        process_group: the ranks taking part (default: world); the same group as ``dcp.load``'s.
        storage_options: passed to the fsspec filesystem.
        verify: check every byte read against its checksum block.

    Plain values of a checkpoint written by ``unickpt.save`` are offered to DCP as bytes items (JSON
    decoded, then ``torch.save`` d for DCP's ``load_bytes``); per-rank state is not offered. Raises
    what :func:`unickpt.load` raises (CheckpointNotFoundError, IntegrityError, ...).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, process_group: Any = None,
                 storage_options: dict | None = None, verify: bool = True):
        self.path = None if path is None else _path(path)
        self.group = process_group
        self.storage_options = storage_options
        self.verify = verify
        self.meta: CheckpointMetadata | None = None
        self._plain: dict[str, Any] | None = None
        self.load_id = ""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = _path(checkpoint_id)
        self.meta = None
        self._plain = None
        self.load_id = uuid.uuid4().hex

    def _meta(self) -> CheckpointMetadata:
        if self.meta is None:
            if self.path is None:
                raise ValueError("StorageReader: no checkpoint path (pass it to StorageReader(path) or as checkpoint_id)")
            storage = Storage(self.path, self.storage_options)
            if is_dcp_checkpoint(storage, self.path):
                raise ValueError(f"{self.path!r} was written by DCP's own FileSystemWriter (.metadata, no metadata.json); "
                                 "unickpt.fsdp.StorageReader reads unickpt checkpoints: load it with dcp.load's default "
                                 "reader, or with unickpt.load(path, state, allow_pickle=True)")
            self.meta = read_metadata(storage, self.path)
        return self.meta

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata derived from ``metadata.json``: one chunk per stored box (flat ranges split
        into their row-major boxes), bytes entries for DCP non-tensor items and plain values."""
        meta = self._meta()
        sdm: dict[str, Any] = {}
        for fqn, tm in meta.tensors.items():
            if fqn.startswith(BYTES_PREFIX):
                sdm[fqn[len(BYTES_PREFIX):]] = BytesStorageMetadata()
                continue
            chunks = [ChunkStorageMetadata(torch.Size(p.box.offsets), torch.Size(p.box.lengths))
                      for c in tm.chunks for p in chunk_pieces(c.spec, tm.shape)]
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=str_to_dtype(tm.dtype)), torch.Size(tm.shape), chunks)
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
        """Plain values of a checkpoint written by ``unickpt.save``, decoded (never unpickled) and keyed
        the way DCP flattens a state dict (``torch.distributed.checkpoint._nested_dict.flatten_state_dict``)."""
        if self._plain is None:
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict

            from unickpt import codec
            from unickpt.errors import UnsafeObjectError

            _, _, objects = saved_leaves(self._meta().state_tree)
            decoded = {}
            for fqn, enc in objects.items():
                try:
                    decoded[fqn] = codec.decode(enc, allow_pickle=False, key=fqn)
                except UnsafeObjectError:
                    continue  # a pickled value: not offered to DCP
            self._plain = flatten_state_dict(decoded)[0] if decoded else {}
        return self._plain

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self._meta()
        get_engine(self.group)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Read this rank's items with one collective unickpt load (every rank calls it, with or
        without items): per tensor, the bounding box of its items is loaded (resharded, verified)
        into a buffer, then each item's box is copied into DCP's target."""
        meta = self._meta()
        objects = self._objects()
        boxes: dict[str, list[int]] = {}  # stored fqn (aliases resolved) -> bounding box lo + hi
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            source = meta.aliases.get(item.storage_index.fqn, item.storage_index.fqn)
            lo = [o + s for o, s in zip(item.storage_index.offset, item.storage_offsets)]
            hi = [a + n for a, n in zip(lo, item.lengths)]
            old = boxes.get(source)
            nd = len(lo)
            boxes[source] = lo + hi if old is None else (
                [min(a, b) for a, b in zip(old[:nd], lo)] + [max(a, b) for a, b in zip(old[nd:], hi)])
        state: dict[str, Any] = {}
        buffers: dict[str, tuple[torch.Tensor, list[int]]] = {}
        for source, box in boxes.items():
            tm = meta.tensors[source]
            nd = len(tm.shape)
            lo, hi = box[:nd], box[nd:]
            buf = torch.empty([b - a for a, b in zip(lo, hi)], dtype=str_to_dtype(tm.dtype))
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
                raise KeyError(f"{fqn!r}: not in the checkpoint {self.path!r}")
        get_engine(self.group).load(self.path, state, strict=False, storage_options=self.storage_options,
                                    verify=self.verify)
        # DCP's own readers copy_ into the target, casting silently; unickpt never casts (every rank has
        # joined the collective load above, so raising here cannot leave a rank waiting)
        for item in sorted((i for i in plan.items if i.type != LoadItemType.BYTE_IO), key=lambda i: i.storage_index.fqn):
            fqn = item.storage_index.fqn
            stored, target = str_to_dtype(meta.tensors[meta.aliases.get(fqn, fqn)].dtype), planner.resolve_tensor(item)
            if target.dtype != stored:
                raise TypeError(f"{fqn!r}: the checkpoint {self.path!r} stores {stored}, the state to load into "
                                f"has {target.dtype}; unickpt never casts on load (convert after loading)")
        for item in plan.items:
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
            buf, lo = buffers[meta.aliases.get(fqn, fqn)]
            src = buf
            for d, (o, s, n) in enumerate(zip(item.storage_index.offset, item.storage_offsets, item.lengths)):
                src = src.narrow(d, o + s - lo[d], n)
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
