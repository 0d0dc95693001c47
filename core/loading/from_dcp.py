"""``unickpt.load`` of a ``torch.distributed.checkpoint`` (DCP) directory, for migrating to unickpt.

A DCP ``FileSystemWriter`` directory holds ``.metadata`` (a pickled ``Metadata``: every tensor's
chunks as boxes, and where each chunk's bytes are: ``relative_path``, ``offset``, ``length``) and
``__<rank>_<n>.distcp`` files whose entries are ``torch.save`` d tensors (or raw bytes with the
safetensors serialization) and ``torch.save`` d objects. Unpickling can run code, so this is opt-in:
``unickpt.load(path, state, allow_pickle=True)``; without it :class:`UnsafeObjectError` says so.

Tensors are filled in place from the chunks that overlap each target shard (any world size and
layout at save time: boxes, DTensor shards, flat ranges). Plain values that DCP flattened into
several entries (``optim.param_groups.0.lr``) are rebuilt from DCP's flattening map
(``Metadata.planner_data``). Each rank reads what it needs; one failure is raised on every rank.
Per-rank state and DCP storage transforms (compression extensions) are not supported.
"""
from __future__ import annotations

import io
import pickle
import time
from typing import Any

import torch

from ..dist import failures
from ..dist.comm import Comm
from ..errors import IntegrityError, StateMismatchError, UnsafeObjectError
from ..geometry import Box, intersect
from ..lifecycle.directory import CheckpointDir
from ..state.flat import flatten
from ..storage.base import StorageBackend
from .stats import LoadStats
from .targets import narrowed, target_views

__all__ = ["DCP_METADATA", "is_dcp_checkpoint", "load_dcp_checkpoint", "restore_empty_optim_state"]

DCP_METADATA = ".metadata"


def is_dcp_checkpoint(storage: StorageBackend, path: str) -> bool:
    """True for a DCP directory: a ``.metadata`` file and no unickpt ``metadata.json``."""
    return storage.exists(storage.join(path, DCP_METADATA)) and not CheckpointDir(storage, path).is_committed()


def _read(storage: StorageBackend, path: str, info: Any) -> bytes:
    if getattr(info, "transform_descriptors", None):
        raise IntegrityError(f"{path!r}: {info.relative_path}@{info.offset} uses DCP storage transforms "
                             f"{list(info.transform_descriptors)}, which unickpt does not read")
    buf = bytearray(info.length)
    storage.read_into(storage.join(path, info.relative_path), [(info.offset, info.length)], memoryview(buf), info.offset)
    return bytes(buf)


def _chunk_tensor(raw: bytes, dtype: torch.dtype, sizes: tuple[int, ...], where: str) -> torch.Tensor:
    numel = 1
    for n in sizes:
        numel *= n
    if len(raw) == numel * dtype.itemsize:  # safetensors-format entries are the raw bytes
        try:
            return torch.frombuffer(bytearray(raw), dtype=dtype).view(sizes) if numel else torch.empty(sizes, dtype=dtype)
        except (TypeError, RuntimeError):
            pass
    t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(sizes):
        raise IntegrityError(f"{where}: stored chunk is not a {dtype} tensor of shape {list(sizes)}")
    return t


def restore_empty_optim_state(value: Any) -> Any:
    """Put back the empty ``"state"`` of an optimizer state dict (``{"state": {}, "param_groups": [...]}``
    of ``get_optimizer_state_dict``, e.g. SGD without momentum or an optimizer before its first step)
    that DCP's flattening dropped with every other empty dict: without it ``set_optimizer_state_dict``
    takes the dict for a flattened one and fails (``KeyError: 'param_groups.0.<fqn>.lr'``)."""
    if isinstance(value, dict) and isinstance(value.get("param_groups"), list) and "state" not in value:
        return {"state": {}, **value}
    return value


def _rebuild(fqn: str, planner_data: dict, values: dict[str, Any]) -> tuple[bool, Any, set[str]]:
    """Rebuild the plain value ``fqn`` from DCP's flattened entries below it: (found, value, keys used)."""
    root: dict = {}
    used = set()
    for key, path in (planner_data or {}).items():
        if not key.startswith(fqn + ".") or key not in values:
            continue
        n = next((i for i in range(1, len(path) + 1) if ".".join(map(str, path[:i])) == fqn), None)
        if n is None:
            continue
        node, rel = root, list(path[n:])
        for k in rel[:-1]:
            node = node.setdefault(k, {})
        node[rel[-1]] = values[key]
        used.add(key)

    def listify(x: Any) -> Any:
        if isinstance(x, dict) and x and all(isinstance(k, int) for k in x) and sorted(x) == list(range(len(x))):
            return [listify(x[i]) for i in range(len(x))]
        return {k: listify(v) for k, v in x.items()} if isinstance(x, dict) else x

    return bool(used), restore_empty_optim_state(listify(root)), used


def load_dcp_checkpoint(comm: Comm, storage: StorageBackend, path: str, state: dict, *, strict: bool, allow_pickle: bool) -> LoadStats:
    """Load the DCP directory ``path`` into ``state`` in place (collective over ``comm``).

    Raises UnsafeObjectError without ``allow_pickle``; StateMismatchError for differing keys
    (``strict``), dtypes or shapes; IntegrityError for unreadable or incomplete chunks.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    if not allow_pickle:
        raise UnsafeObjectError(
            f"{path!r} is a torch.distributed.checkpoint directory: its {DCP_METADATA} and its non-tensor entries are "
            "pickles, and unpickling can run code; pass allow_pickle=True to load it (only a checkpoint you trust)")
    t0 = time.perf_counter()
    stats = LoadStats()
    local_error: BaseException | None = None
    objects: dict[str, tuple[Any, Any, Any]] = {}
    flat = None
    try:
        md = pickle.loads(storage.read_bytes(storage.join(path, DCP_METADATA)))
        sdm, where = md.state_dict_metadata, md.storage_data or {}
        flat = flatten(state, for_load=True)
        if flat.per_rank:
            raise StateMismatchError(f"{path!r}: a DCP checkpoint has no per-rank state; the state has {sorted(flat.per_rank)}")
        byte_keys = {k for k, v in sdm.items() if isinstance(v, BytesStorageMetadata)}
        tensor_keys = {k for k, v in sdm.items() if isinstance(v, TensorStorageMetadata)}
        values: dict[str, Any] = {}

        def value(key: str) -> Any:
            if key not in values:
                values[key] = torch.load(io.BytesIO(_read(storage, path, where[MetadataIndex(key)])), weights_only=False)
            return values[key]

        used: set[str] = set()
        missing = [f for f in flat.tensors if f not in tensor_keys]
        for fqn, (container, key) in flat.objects.items():
            if fqn in byte_keys:
                objects[fqn] = (container, key, value(fqn))
                used.add(fqn)
                continue
            below = [k for k in byte_keys if k.startswith(fqn + ".")]
            for k in below:
                value(k)
            found, rebuilt, keys = _rebuild(fqn, md.planner_data, values)
            if found:
                objects[fqn] = (container, key, rebuilt)
                used |= keys
            else:
                missing.append(fqn)
        unexpected = sorted((tensor_keys - set(flat.tensors)) | (byte_keys - used))
        if strict and (missing or unexpected):
            raise StateMismatchError(f"{path!r}: keys differ (strict=True); missing from the checkpoint: {sorted(missing)[:20]}; "
                                     f"in the checkpoint but not in the state: {unexpected[:20]}")
        for fqn, leaf in flat.tensors.items():
            if fqn not in tensor_keys:
                continue
            tmd = sdm[fqn]
            if tmd.properties.dtype != leaf.dtype or tuple(tmd.size) != tuple(leaf.global_shape):
                raise StateMismatchError(f"{fqn!r}: checkpoint has dtype {tmd.properties.dtype} shape {list(tmd.size)}, "
                                         f"the state has dtype {leaf.dtype} shape {list(leaf.global_shape)}")
            targets = target_views(leaf)
            filled = 0
            for chunk in tmd.chunks:
                cbox = Box(tuple(chunk.offsets), tuple(chunk.sizes))
                hits = [(tbox, view, inter) for tbox, view in targets if (inter := intersect(tbox, cbox)) is not None]
                if not hits:
                    continue
                raw = _read(storage, path, where[MetadataIndex(fqn, torch.Size(chunk.offsets))])
                stats.bytes_read += len(raw)
                stats.reads += 1
                src = _chunk_tensor(raw, leaf.dtype, cbox.lengths, f"{path!r} {fqn!r} chunk at {list(cbox.offsets)}")
                with torch.no_grad():  # (a 0-d tensor is the box ((), ()): one element)
                    for tbox, view, inter in hits:
                        narrowed(view, tbox, inter).copy_(narrowed(src, cbox, inter))
                        filled += inter.numel
            if filled != leaf.spec.numel:
                raise IntegrityError(f"{fqn!r}: the DCP chunks cover {filled} of the {leaf.spec.numel} elements this rank needs")
    except Exception as e:  # every rank must still join the gather
        local_error = e
    failures.gather_load_outcomes(comm, path, local_error)
    assert flat is not None
    for container, key, val in objects.values():
        if not isinstance(container, tuple):
            container[key] = val
    for apply in flat.appliers:
        apply()
    stats.storage_bytes_read = getattr(storage, "bytes_read", 0)
    stats.total_s = time.perf_counter() - t0
    return stats
