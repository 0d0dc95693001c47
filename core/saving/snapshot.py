"""The caller's part of a save: what the state holds at the call, as the save thread will need it.

On the caller's thread (no collective): flatten the state (:mod:`unickpt.state.flat`: tensor
leaves, plain values and per-rank objects as of the call), check each leaf against its shard, build
this rank's local plan and its signature (:mod:`unickpt.plan.save_plan`), encode the per-rank
objects, and, in ``overlap`` snapshot mode, decide what is staged after the call returns:

* ``sync`` (default): nothing. The caller waits until every byte is staged, so nothing it does
  afterwards can reach the checkpoint.
* ``overlap``: the tensors an optimizer in the state owns (its parameters and its state: only
  ``optimizer.step()`` changes them) are staged while the training loop runs its next
  forward/backward, and a step pre-hook on each such optimizer (:class:`StepGuards`) blocks
  ``optimizer.step()`` until the snapshot is complete (DCP's async staging has the loop make the same
  wait by hand). All other tensors (buffers, plain tensors) are cloned at the call when they are
  small (:data:`OVERLAP_CLONE_BYTES` in all), or else staged before the call returns. Changing
  optimizer-owned tensors in place by other means than ``optimizer.step()`` before
  ``handle.wait_snapshot()`` returns is not allowed in this mode.

A failure here does not raise at once: every rank must still join the plan exchange (or the others
would hang), so it travels in the local plan and is raised on every rank by the agreement.
"""
from __future__ import annotations

import hashlib
import json
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from .._util import gc_paused
from ..plan.save_plan import LocalPlan, make_local_plan
from ..state import codec
from ..state.flat import FlatState, check_leaf_fits, flatten
from .request import SaveStats

__all__ = ["OVERLAP_CLONE_BYTES", "Snapshot", "take_snapshot", "StepGuards"]

OVERLAP_CLONE_BYTES = 64 << 20
"""Overlap snapshots: tensors no optimizer owns (buffers, plain tensors) up to this many bytes in all
are cloned at the call, so that the caller returns without waiting for the plan; more are staged
before the call returns."""


def format_exc(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


@dataclass
class Snapshot:
    """The state at the call, as the save thread needs it (written once, by the caller's thread).

    Attributes:
        flat: the flattened state (None if flattening failed).
        local: this rank's local plan (carrying ``error`` if the caller's part failed).
        signature: the local plan's signature (None after a failure).
        error: the caller's part's exception, raised on every rank by the agreement.
        per_rank_blob: this rank's per-rank objects as JSON bytes (None: none).
        skeleton: the state tree with plain values (group rank 0 only; it goes into ``metadata.json``).
        clones: overlap mode: copies of the small tensors no optimizer guards, taken at the call.
        guarded: overlap mode: fqns staged after the call returns (optimizer-owned, or cloned).
        optimizers: overlap mode: the optimizers whose ``step()`` must wait for the snapshot.
        must_wait: the caller waits for the whole snapshot (sync mode, or too much to clone).
        cuda_ready: CUDA devices holding leaves -> an event recorded at the call (staging copies wait on it).
    """

    flat: FlatState | None = None
    local: LocalPlan | None = None
    signature: str | None = None
    error: BaseException | None = None
    per_rank_blob: bytes | None = None
    skeleton: Any = None
    clones: dict = field(default_factory=dict)
    guarded: frozenset = frozenset()
    optimizers: list = field(default_factory=list)
    must_wait: bool = True
    cuda_ready: dict = field(default_factory=dict)

    def leaf(self, fqn: str) -> torch.Tensor:
        """The tensor to stage for ``fqn``: its clone taken at the call, or the live local shard."""
        assert self.flat is not None
        return self.clones.get(fqn, self.flat.tensors[fqn].local)

    def failed(self, e: BaseException, rank: int, tag: str | None = None) -> None:
        """Record the caller's part's failure in the local plan (it reaches every rank at the agreement;
        ``tag="options"``: a bad argument of the call, raised with its own type everywhere)."""
        self.error = e
        self.local = LocalPlan(rank=rank, error=format_exc(e))
        kind = type(e).__name__ if tag is None else f"{tag}:{type(e).__name__}"
        self.local.error_type, self.local.error_message = kind, str(e)
        self.signature = None
        self.must_wait = True


def take_snapshot(state: dict, *, rank: int, world_size: int, snapshot_mode: str, allow_pickle: bool,
                  clone_limit: int, stream_order_fixed: bool = False) -> Snapshot:
    """The caller's part (see the module docstring). Never raises: a failure is recorded in the
    returned snapshot (:meth:`Snapshot.failed`). ``clone_limit``: overlap mode clones at most this
    many bytes of unguarded tensors. ``stream_order_fixed``: the plan cannot put unguarded tensors
    first (``SaveOptions.safetensors``: the group's file comes first), so an overlap snapshot that
    would need it is taken before the call returns, as a sync one."""
    snap = Snapshot(must_wait=snapshot_mode == "sync")
    try:
        # the collector paused while the call allocates its few thousand short-lived objects: a
        # collection pass landing in it walks the whole heap (measured: ~1 ms of a ~4 ms call)
        with gc_paused():
            flat = flatten(state, for_load=False, allow_pickle=allow_pickle)
            for leaf in flat.tensors.values():
                check_leaf_fits(leaf)
            if snapshot_mode == "overlap":
                _overlap(snap, flat, clone_limit)
                if stream_order_fixed and snap.must_wait:
                    snap.guarded, snap.optimizers = frozenset(), []
            local = make_local_plan(flat, rank, snap.guarded, world_size)
            snap.signature = local.signature()
            local.objects_digest = hashlib.blake2b(repr(sorted(flat.objects)).encode(), digest_size=8).hexdigest()
            snap.local, snap.flat = local, flat
            if flat.per_rank:
                encoded = {fqn: codec.encode(pr.state_dict(), allow_pickle=allow_pickle, key=fqn)
                           for fqn, pr in flat.per_rank.items()}
                snap.per_rank_blob = json.dumps(encoded, separators=(",", ":")).encode()
            if rank == 0:
                snap.skeleton = flat.skeleton
            on_cuda = {t.device for t in (leaf.local for leaf in flat.tensors.values()) if t.is_cuda}
            if on_cuda:
                from .staging import CudaStager

                snap.cuda_ready = CudaStager.mark_ready(on_cuda)
    except Exception as e:  # every rank must still join the plan exchange, or the others hang
        snap.failed(e, rank)
    return snap


def _storage_ptr(t: Any) -> int | None:
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard
    if not isinstance(local, torch.Tensor) or local.device.type == "meta" or local.numel() == 0:
        return None
    return local.untyped_storage().data_ptr()


def _optimizer_owned(flat: FlatState) -> tuple[frozenset, list]:
    """The fqns whose tensors belong to an optimizer of the flattened state (its parameters and its
    state tensors: only ``optimizer.step()`` changes them), and those optimizers."""
    optims = flat.optimizers
    ptrs: set[int | None] = set()
    for o in optims:
        for g in o.param_groups:
            ptrs.update(_storage_ptr(p) for p in g["params"])
        for st in o.state.values():
            ptrs.update(_storage_ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
    ptrs.discard(None)
    fqns = frozenset(fqn for fqn, leaf in flat.tensors.items()
                     if fqn not in flat.aliases and leaf.storage_ptr in ptrs)
    return fqns, optims


def _overlap(snap: Snapshot, flat: FlatState, clone_limit: int) -> None:
    """Overlap mode: which fqns are staged after the call, which optimizers to guard, and whether the
    caller must wait for the rest to be staged. Tensors no optimizer owns are cloned when they are
    small (at most ``clone_limit`` bytes in all), so that the caller need not wait at all."""
    guarded, snap.optimizers = _optimizer_owned(flat)
    loose = {fqn: leaf for fqn, leaf in flat.tensors.items() if fqn not in guarded and fqn not in flat.aliases}
    loose_bytes = sum(leaf.local.numel() * leaf.local.element_size() for leaf in loose.values())
    if loose_bytes > clone_limit:
        snap.guarded, snap.must_wait = guarded, True  # stage them before returning (the plan puts them first)
        return
    with torch.no_grad():
        snap.clones = {fqn: leaf.local.clone() for fqn, leaf in loose.items()}
    snap.guarded, snap.must_wait = frozenset(fqn for fqn in flat.tensors if fqn not in flat.aliases), False


class StepGuards:
    """Overlap snapshots: step pre-hooks that make ``optimizer.step()`` wait until the snapshot of a
    save is complete (the wait is added to that save's stall). Registered and removed on the caller's
    thread only (never inside ``step``)."""

    def __init__(self) -> None:
        self._hooks: list[tuple[Any, list]] = []  # (progress, hook handles)

    def guard(self, progress: Any, stats: SaveStats, optimizers: list) -> None:
        def hook(*_: Any) -> None:
            if not progress.snapshot_done.is_set():
                t0 = time.perf_counter()
                progress.snapshot_done.wait()
                stats.stall_s += time.perf_counter() - t0  # the loop is blocked by the save here too

        self._hooks.append((progress, [o.register_step_pre_hook(hook) for o in optimizers]))

    def remove_finished(self) -> None:
        """Drop the pre-hooks whose snapshot is complete."""
        keep = []
        for progress, handles in self._hooks:
            if progress.snapshot_done.is_set():
                for h in handles:
                    h.remove()
            else:
                keep.append((progress, handles))
        self._hooks = keep
