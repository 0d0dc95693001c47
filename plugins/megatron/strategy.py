"""megatron-core ``dist_checkpointing`` save and load strategies backed by unickpt (backend ``unickpt``).

Registered with :func:`register` (done on ``import unickpt.megatron``)::

    (SAVE_SHARDED, "unickpt", 1) -> UnickptSaveShardedStrategy   (an AsyncSaveShardedStrategy)
    (LOAD_SHARDED, "unickpt", 1) -> UnickptLoadShardedStrategy

``dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=("unickpt", 1))`` writes megatron's
``common.pt`` and, last, its ``metadata.json`` (``"sharded_backend": "unickpt"``) in ``ckpt_dir``; the
sharded state (ShardedTensors and ShardedObjects) is a unickpt checkpoint in the subdirectory
``ckpt_dir/unickpt`` (:data:`SUBDIR`), whose own ``metadata.json`` is its commit, so the two files never
collide and ``unickpt inspect|verify ckpt_dir/unickpt`` work. ``dist_checkpointing.load`` picks
:class:`UnickptLoadShardedStrategy` from megatron's ``metadata.json``; it reshards to the current TP /
PP / DP layout (only the stored byte ranges a rank needs are read).

Async saves follow megatron's ``AsyncRequest`` protocol: :meth:`UnickptSaveShardedStrategy.async_save`
returns once the state is copied into host memory; unickpt writes and commits in a background thread
of the training process. The request's ``async_fn`` (run by megatron's ``AsyncCallsQueue`` in a
forked or persistent worker process) only waits for a marker file that this process writes when the
save has finished, so megatron's "is the save done on every rank" checks see the real progress;
the finalize function raises the save's error, if any.
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unickpt import IntegrityError, SaveFailedError, StateMismatchError, ext

from .errors import as_checkpointing_errors
from .sharded_state import (OBJECT_PREFIX, KeyInfo, agree_layout, build_save_state, decode_object, prepare_save,
                      stored_object_sizes, to_load_targets)

__all__ = ["BACKEND", "VERSION", "SUBDIR", "UnickptSaveShardedStrategy", "UnickptLoadShardedStrategy", "register",
           "unickpt_dir", "OBJECT_POLICIES"]

BACKEND, VERSION = "unickpt", 1
SUBDIR = "unickpt"
"""The unickpt checkpoint lives in ``<megatron checkpoint dir>/unickpt`` (see the module docstring)."""

OBJECT_POLICIES = ("error", "skip")
"""What a load does with a requested ShardedObject the checkpoint lacks (its unique key encodes the
saved layout: ``rng_state/shard_0.3_1.4`` exists only for a run with 4 such shards):
``"error"`` raises StateMismatchError naming the key and the stored shards of that key;
``"skip"`` leaves it out of the returned state dict (megatron-LM drops RNG state on a layout change)."""

from megatron.core.dist_checkpointing.core import CONFIG_FNAME as _MARKER  # noqa: E402  megatron's own metadata.json
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest  # noqa: E402
from megatron.core.dist_checkpointing.strategies.base import (  # noqa: E402
    AsyncSaveShardedStrategy, LoadShardedStrategy, StrategyAction, register_default_strategy)


def unickpt_dir(checkpoint_dir: str | os.PathLike) -> str:
    """The unickpt checkpoint inside a megatron checkpoint directory."""
    return os.path.join(os.fspath(checkpoint_dir), SUBDIR)


log = logging.getLogger("unickpt.megatron")
_UNFINALIZED: set[str] = set()
"""unickpt paths of this process's async saves whose AsyncRequest is not finalized yet (megatron has not
written its metadata.json): saving into them again is refused, even when the write itself is done."""


def _clear_previous(engine: Any, checkpoint_dir: Any, path: str) -> list[str]:
    """Group rank 0, before a save: megatron's overwrite semantics for a directory that already holds a
    checkpoint. ``dist_checkpointing.save`` into a non-empty directory overwrites it (it only logs
    "Overwriting old incomplete / corrupted checkpoint"), while unickpt never overwrites a committed
    checkpoint. So, when ``path`` (``checkpoint_dir/unickpt``) holds a committed unickpt checkpoint that
    no save of this process is still writing, megatron's ``metadata.json`` is removed first (from then on
    megatron sees an incomplete checkpoint, never a mix of old and new) and then the unickpt part.
    A save into ``checkpoint_dir`` still in flight in this process, or whose AsyncRequest is not finalized,
    is an error. Returns error lines."""
    if engine.in_flight(path) or path in _UNFINALIZED:
        return [f"a save into {os.fspath(checkpoint_dir)!r} started by this process is still in flight (its "
                "AsyncRequest is not finalized); finalize it before saving there again"]
    storage = ext.open_storage(path)
    ckpt = ext.CheckpointDir(storage, path)
    if not ckpt.is_committed():
        return []
    log.warning("unickpt.megatron: overwriting the checkpoint in %s (megatron's overwrite semantics)", checkpoint_dir)
    try:
        storage.rm(storage.join(os.fspath(checkpoint_dir), _MARKER))  # megatron's own marker goes first
        ckpt.remove()
    except OSError as e:
        return [f"cannot remove the previous checkpoint in {os.fspath(checkpoint_dir)!r}: {type(e).__name__}: {e}"]
    return []


def _gather(obj: Any, group: Any) -> list:
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _group_rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _wait_for_marker(marker: str, owner_pid: int, poll_s: float = 0.01) -> None:
    """``async_fn`` of unickpt's AsyncRequest: block until ``marker`` exists (the save finished, with
    success or failure) or the training process ``owner_pid`` is gone. Runs in megatron's forked or
    spawned checkpoint worker; uses nothing but the file system."""
    while not os.path.exists(marker):
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(poll_s)


class UnickptSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves megatron-core ShardedTensors and ShardedObjects as a unickpt checkpoint.

    Args:
        process_group: the ranks saving (default: the world, as ``dist_checkpointing`` assumes).
        allow_pickle: store ShardedObject values that have no tagged-JSON form (see
            :mod:`unickpt.state.codec`) as pickles; off: such a value fails the save naming its key.
        balance_replicas: hand every replica of a ShardedTensor to unickpt, whose planner writes
            each box once from the least loaded holder (replicas must be bitwise identical). Off:
            only main replicas (``replica_id`` 0) are written, megatron's rule.

    Saving into a directory that already holds a checkpoint overwrites it (megatron's semantics, see
    :func:`_clear_previous`); one whose async save is not finalized is refused.

    Every rank must call ``save`` / ``async_save``. A shard that cannot be stored (a flattened range
    that is not one global range, a pickle-only object) fails the save on every rank with
    :class:`unickpt.SaveFailedError` naming the rank and key; nothing is committed.
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, process_group: Any = None,
                 allow_pickle: bool = False, balance_replicas: bool = False):
        super().__init__(backend, version)
        self.process_group = process_group
        self.allow_pickle = allow_pickle
        self.balance_replicas = balance_replicas

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _start(self, sharded_state_dict: Any, checkpoint_dir: Any, async_save: bool):
        path = unickpt_dir(checkpoint_dir)
        engine = ext.engine(self.process_group)  # collective on first use: every rank, before rank 0 works alone
        prep = prepare_save(sharded_state_dict, allow_pickle=self.allow_pickle, balance_replicas=self.balance_replicas)
        infos, errors = agree_layout(_gather((prep.infos, prep.splits, prep.errors), self.process_group))
        if errors:
            raise SaveFailedError(path, {r: "; ".join(ms) for r, ms in errors.items()})
        state, build_errors = build_save_state(prep, infos)
        if _group_rank(self.process_group) == 0 and not build_errors:
            # only a save that can go ahead replaces the previous checkpoint; the others wait in the gather
            build_errors = _clear_previous(engine, checkpoint_dir, path)
        failures = {r: ms for r, ms in enumerate(_gather(build_errors, self.process_group)) if ms}
        if failures:
            raise SaveFailedError(path, {r: "; ".join(ms) for r, ms in failures.items()})
        extra = {"megatron": {"backend": self.backend, "backend_version": self.version, "object_prefix": OBJECT_PREFIX,
                              "keys": {k: i.to_json() for k, i in sorted(infos.items())}}}
        return engine.save(path, state, async_save=async_save, framework="megatron", extra=extra)

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Save synchronously (returns once committed). Raises SaveFailedError and the engine's errors."""
        self._start(sharded_state_dict, checkpoint_dir, async_save=False)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        """Snapshot the state into host memory and return megatron's AsyncRequest for the rest.

        Tensors may be changed as soon as this returns. Schedule the request with megatron's
        ``AsyncCallsQueue`` (or call ``execute_sync()``); its finalize function raises the save's error.
        """
        handle = self._start(sharded_state_dict, checkpoint_dir, async_save=True)
        path = unickpt_dir(checkpoint_dir)
        _UNFINALIZED.add(path)
        marker = os.path.join(tempfile.gettempdir(), f"unickpt-megatron-{os.getpid()}-{uuid.uuid4().hex}.done")

        def watch() -> None:
            try:
                handle.wait()
            except BaseException:  # raised again by finalize(); the marker only says "finished"
                pass
            Path(marker).touch()

        threading.Thread(target=watch, name="unickpt-megatron-watch", daemon=True).start()

        def finalize() -> None:
            try:
                handle.wait()
            finally:
                _UNFINALIZED.discard(path)
                try:
                    os.unlink(marker)
                except FileNotFoundError:
                    pass

        return AsyncRequest(_wait_for_marker, (marker, os.getpid()), [finalize])


class UnickptLoadShardedStrategy(LoadShardedStrategy):
    """Loads a unickpt-backed megatron checkpoint into a sharded state dict, resharding as needed.

    Args:
        process_group: the ranks loading (default: the world).
        object_policy: one of :data:`OBJECT_POLICIES` (default ``"error"``).
        allow_pickle: allow ShardedObjects stored as pickles to be unpickled.
        verify: check every byte read against its checksum.

    ``load`` fills each ShardedTensor's ``data`` in place (ShardedTensors without data get a CPU
    tensor) and returns the state dict with ShardedTensors replaced by their tensors and
    ShardedObjects by their values. Raises StateMismatchError on every rank when a requested key is
    missing from the checkpoint or its dtype or global shape differs (nothing is cast or cut), and
    unickpt's load errors (IntegrityError, ...). Every unickpt error is raised as a subclass of its
    class that is also megatron-core's ``CheckpointingException`` (:mod:`unickpt.megatron.errors`:
    ``MegatronStateMismatchError``, ...), which megatron's callers catch.
    """

    def __init__(self, *, process_group: Any = None, object_policy: str = "error", allow_pickle: bool = False,
                 verify: bool = True):
        super().__init__()
        if object_policy not in OBJECT_POLICIES:
            raise ValueError(f"object_policy must be one of {OBJECT_POLICIES}, got {object_policy!r}")
        self.process_group = process_group
        self.object_policy = object_policy
        self.allow_pickle = allow_pickle
        self.verify = verify

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise ValueError(f"UnickptLoadShardedStrategy reads backend {BACKEND!r}, the checkpoint has {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if int(loaded_version) != VERSION:
            raise ValueError(f"UnickptLoadShardedStrategy reads backend version {VERSION}, the checkpoint has {loaded_version}")

    def _metadata(self, checkpoint_dir: Any) -> tuple[str, Any, dict[str, KeyInfo]]:
        """``(unickpt path, its CheckpointMetadata, key -> KeyInfo)``. Raises CheckpointNotFoundError,
        IntegrityError when the metadata lacks the megatron key table."""
        path = unickpt_dir(checkpoint_dir)
        meta = ext.CheckpointDir.open(path).read_metadata()
        try:
            keys = meta.extra["megatron"]["keys"]
            infos = {k: KeyInfo.from_json(d) for k, d in keys.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise IntegrityError(f"{path!r}: metadata.json has no valid extra.megatron.keys table "
                                 f"({type(e).__name__}: {e}); not saved by unickpt.megatron?") from None
        return path, meta, infos

    @as_checkpointing_errors()
    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """Load in place (collective). See the class docstring."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        path, meta, infos = self._metadata(checkpoint_dir)
        sizes = stored_object_sizes(meta.tensors)
        target = to_load_targets(sharded_state_dict, infos, sizes)
        problems = target.errors + self._missing_objects(target, sizes)
        gathered = _gather((problems, len(target.rounds)), self.process_group)
        lines = [f"rank {r}: {m}" for r, (ms, _) in enumerate(gathered) for m in ms]
        if lines:
            raise StateMismatchError(f"{path!r}: the checkpoint does not match the requested sharded state: "
                                     + "; ".join(lines[:20]) + (f" ... ({len(lines)} in all)" if len(lines) > 20 else ""))
        rounds = max(n for _, n in gathered)
        engine = ext.engine(self.process_group)
        with torch.no_grad():
            for i in range(rounds):
                engine.load(path, target.rounds[i] if i < len(target.rounds) else {}, strict=False,
                            allow_pickle=self.allow_pickle, verify=self.verify)
            for fn in target.after:
                fn()
        loaded = {k: v for r in target.rounds for k, v in r.items() if k.startswith(OBJECT_PREFIX)}
        values: dict[str, Any] = {}
        for uk in target.objects:
            buf = loaded.get(OBJECT_PREFIX + uk)
            if buf is not None:
                values[uk] = decode_object(buf, OBJECT_PREFIX + uk, self.allow_pickle)
        skipped = object()

        def finish(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                return x.data
            if isinstance(x, ShardedObject):
                return values.get(x.unique_key, skipped)
            return x

        dict_list_map_inplace(finish, sharded_state_dict)
        _drop(sharded_state_dict, skipped)
        return sharded_state_dict

    def _missing_objects(self, target: Any, sizes: dict[str, int]) -> list[str]:
        if self.object_policy != "error":
            return []
        out = []
        for uk in target.objects:
            if uk not in sizes:
                base = uk.rsplit("/shard_", 1)[0]
                stored = sorted(k for k in sizes if k.rsplit("/shard_", 1)[0] == base)
                out.append(f"ShardedObject {uk!r} is not in the checkpoint (stored shards of {base!r}: "
                           f"{stored[:8] or 'none'}; the parallel layout changed? object_policy='skip' drops it)")
        return out

    @as_checkpointing_errors()
    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Any = None) -> dict:
        """Every stored ShardedTensor key -> a data-less ShardedTensor with its global shape and dtype."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        _, _, infos = self._metadata(checkpoint_dir)
        return {k: ShardedTensor.from_rank_offsets(
                    k, torch.empty(i.shape, dtype=ext.Codec.str_to_dtype(i.dtype), device="meta")).without_data()
                for k, i in infos.items()}

    @as_checkpointing_errors()
    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict:
        """:meth:`load_tensors_metadata` plus every stored ShardedObject (data-less), by unique key."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        out = self.load_tensors_metadata(checkpoint_dir)
        _, meta, _ = self._metadata(checkpoint_dir)
        for uk in stored_object_sizes(meta.tensors):
            out[uk] = ShardedObject.empty_from_unique_key(uk)
        return out


def _drop(x: Any, marker: object) -> None:
    """Remove (in place) every dict entry or list item that is ``marker``."""
    if isinstance(x, dict):
        for k in [k for k, v in x.items() if v is marker]:
            del x[k]
        for v in x.values():
            _drop(v, marker)
    elif isinstance(x, list):
        x[:] = [v for v in x if v is not marker]
        for v in x:
            _drop(v, marker)


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Register the ``unickpt`` backend (v1) in megatron-core's strategy registry (idempotent)."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, UnickptSaveShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, UnickptLoadShardedStrategy())
