"""Loading a checkpoint into a caller's state: key and target checks, tensor reads, objects,
per-rank state, then ``load_state_dict`` calls. Everything is validated and decoded before the first
byte is written into the caller's state, so a mismatch leaves the state untouched.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from . import codec
from .collectives import Comm
from .errors import IntegrityError, PerRankReshardError, StateMismatchError
from .metadata import CheckpointMetadata, TensorMeta, read_metadata
from .reader import LoadStats, load_tensor
from .resharding import FlatRange
from .state import flatten, saved_leaves
from .storage import Storage

__all__ = ["load_checkpoint"]


def load_checkpoint(comm: Comm, path: str, state: dict, *, strict: bool = True, storage_options: dict | None = None,
                    allow_pickle: bool = False, verify: bool = True) -> LoadStats:
    """Load ``path`` into ``state`` in place on this rank of ``comm``. See :func:`unickpt.load`."""
    storage = Storage(path, storage_options)
    meta = read_metadata(storage, path)
    flat = flatten(state, for_load=True)
    # tensors and per-rank entries from every rank's plan; plain objects are group rank 0's
    _, _, saved_objects = saved_leaves(meta.state_tree)
    saved_tensors = set(meta.tensors) | set(meta.aliases)
    saved_per_rank = set(meta.per_rank.get("fqns", []))
    _check_keys(flat, saved_tensors, saved_per_rank, saved_objects, strict, path)
    # Validate and decode everything before the first byte lands in the caller's state, so a
    # mismatch or an unsafe object leaves the state untouched.
    reads = []
    for fqn, leaf in flat.tensors.items():
        if fqn in saved_tensors:
            tmeta = meta.tensors[meta.aliases.get(fqn, fqn)]
            _check_target(leaf, tmeta)
            reads.append((leaf, tmeta))
    objects = {}
    for fqn, (container, key) in flat.objects.items():
        if fqn in saved_objects:
            value = codec.decode(saved_objects[fqn], allow_pickle=allow_pickle, key=fqn)
            if isinstance(container, tuple) and container[key] != value:
                raise StateMismatchError(
                    f"{fqn!r}: checkpoint has {value!r}, the state has {container[key]!r} inside a tuple, "
                    "which cannot be updated in place (use a list)"
                )
            objects[fqn] = (container, key, value)
    per_rank = _per_rank_states(comm, storage, path, meta, flat.per_rank, saved_per_rank, allow_pickle)
    stats = LoadStats()
    for leaf, tmeta in reads:
        if isinstance(leaf.spec, FlatRange) or leaf.spec.numel:
            load_tensor(storage, path, leaf, tmeta, stats, verify)
    for container, key, value in objects.values():
        if not isinstance(container, tuple):
            container[key] = value
    for fqn, value in per_rank.items():
        flat.per_rank[fqn].load_state_dict(value)
    for apply in flat.appliers:
        apply()
    return stats

def _per_rank_states(comm: Comm, storage: Storage, path: str, meta: CheckpointMetadata, targets: dict,
                     saved: set[str], allow_pickle: bool) -> dict[str, Any]:
    """This rank's state for each per-rank fqn (resharded if the world size changed)."""
    info = meta.per_rank
    saved_ws = int(info.get("world_size", 0))
    files: dict[int, dict] = {}

    def rank_state(r: int) -> dict:
        if r not in files:
            rel = info["files"][r]
            if rel is None:
                raise IntegrityError(f"{path!r}: rank {r} saved no per-rank state file")
            files[r] = json.loads(storage.read_bytes(storage.join(path, rel)))
        return files[r]

    out = {}
    for fqn, target in targets.items():
        if fqn not in saved:
            continue
        if saved_ws == comm.world_size:
            out[fqn] = codec.decode(rank_state(comm.rank)[fqn], allow_pickle=allow_pickle, key=fqn)
            continue
        if target.reshard is None:
            raise PerRankReshardError(
                f"{fqn!r}: per-rank state was saved by {saved_ws} ranks and is being loaded by "
                f"{comm.world_size}; give PerRank(..., reshard=fn) to say how to redistribute it"
            )
        states = [codec.decode(rank_state(r)[fqn], allow_pickle=allow_pickle, key=fqn) for r in range(saved_ws)]
        out[fqn] = target.reshard(states, comm.rank, comm.world_size)
    return out


def _check_target(leaf: Any, tmeta: TensorMeta) -> None:
    """Raise StateMismatchError unless ``leaf`` can take the stored tensor as it is."""
    fqn, t = leaf.fqn, leaf.local
    got_dtype, got_shape = codec.dtype_to_str(leaf.dtype), tuple(leaf.global_shape)
    if (got_dtype, got_shape) != (tmeta.dtype, tmeta.shape):
        raise StateMismatchError(
            f"{fqn!r}: checkpoint has dtype {tmeta.dtype} shape {list(tmeta.shape)}, the state to "
            f"load into has dtype {got_dtype} shape {list(got_shape)} (no implicit cast or reshape)"
        )
    if t.device.type == "meta":
        raise StateMismatchError(f"{fqn!r}: the tensor to load into is on the meta device (no storage); "
                                 "materialize it first (e.g. model.to_empty(device=...))")
    if t.layout != torch.strided:
        raise StateMismatchError(f"{fqn!r}: tensor layout {t.layout} is not supported (dense tensors only)")
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise StateMismatchError(f"{fqn!r}: the tensor to load into is an expanded view (stride 0, "
                                 f"shape {list(t.shape)}, stride {list(t.stride())}); its elements share memory")


def _check_keys(flat, saved_tensors: set, saved_per_rank: set, saved_objects: dict, strict: bool, path: str) -> None:
    kinds_target = {**{f: "tensor" for f in flat.tensors}, **{f: "per-rank object" for f in flat.per_rank},
                    **{f: "object" for f in flat.objects}}
    kinds_saved = {**{f: "tensor" for f in saved_tensors}, **{f: "per-rank object" for f in saved_per_rank},
                   **{f: "object" for f in saved_objects}}
    wrong_kind = [f"{f!r} (checkpoint: {kinds_saved[f]}, state: {k})" for f, k in kinds_target.items()
                  if f in kinds_saved and kinds_saved[f] != k]
    if wrong_kind:
        raise StateMismatchError(f"{path!r}: entries of another kind: " + ", ".join(sorted(wrong_kind)[:20]))
    if not strict:
        return
    missing = sorted(set(kinds_target) - set(kinds_saved))
    unexpected = sorted(set(kinds_saved) - set(kinds_target))
    if missing or unexpected:
        def show(keys: list[str]) -> str:
            return ", ".join(repr(k) for k in keys[:20]) + (f" ... ({len(keys)} in all)" if len(keys) > 20 else "")
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {show(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state: {show(unexpected)}")
        raise StateMismatchError(f"{path!r}: keys differ (strict=True); " + "; ".join(parts))


