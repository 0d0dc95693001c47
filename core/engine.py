"""The engine: one per process group. Runs saves (plan -> stage -> pipelined drain -> commit) and loads.

Save sequence (every rank of the group; the threads are :mod:`unickpt.pipeline`'s):

1. caller's thread: flatten the state (tensor leaves, plain values, per-rank objects: the values
   as of the call), build the local plan and its signature, and hand the save to the stager
   thread. In ``sync`` snapshot mode (the default) the caller then waits until every byte is
   staged (step 3); in ``overlap`` mode it returns at once (see :mod:`unickpt.pipeline`).
2. stager thread, **plan**: group rank 0 refuses a committed, in-flight or foreign target directory
   and clears an incomplete one; then the ranks agree on the plan with one small collective, a
   fixed-size ``all_gather`` (48 bytes per rank: plan signature, table, options digests, error flag) on
   the private *plan* group. When this combination of signatures was planned before (the plan
   cache), that is the only planning collective; otherwise the local plans are gathered as compact
   JSON (:meth:`~unickpt.planner.LocalPlan.to_bytes`, two collectives, no pickle; a rank whose
   signature repeats an earlier rank's sends nothing, one whose tensor table repeats an earlier
   rank's sends its shards only) and :func:`~unickpt.planner.make_save_plan` derives the same plan on
   every rank (replicas written once and balanced, files and offsets, merge transfers). The
   exchange cannot be skipped safely: one rank's layout may change while the others' do not, and
   only an exchange lets all ranks hit or miss the cache together; it runs off the caller's
   thread in ``overlap`` mode, so there it costs the training loop nothing.
3. stager thread, **stage**: take a free staging ring (ping-pong of two; waiting only when both
   are draining, reported as ``pool_wait_s``) and stage this rank's chunks into it.
4. background, **drain**: checksum and write threads (or a writer process) and the uploader
   stream the staged pieces to the data files (and the remote copy) while staging goes on.
5. commit thread (one per engine, so saves commit in order): wait for the drain, ``all_gather``
   the results on the private *background* group; if every rank succeeded, group rank 0 writes
   ``metadata.json`` atomically (the commit; the remote copy's first when uploading) and runs the
   ``on_commit`` callback; the outcome is broadcast so that every rank's handle reports the same
   result (:class:`~unickpt.errors.SaveFailedError` names the failed ranks and stages).

A failure anywhere leaves no ``metadata.json``, so the directory is never loaded, and the
previously committed checkpoints are not touched. :class:`SaveStats` counts each save's
collectives: ``collectives_plan`` 1 on a plan-cache hit, 3 on a miss (2 more on a miss when chunks are
replicated: the replica check of :mod:`unickpt.replicas`); ``collectives_commit`` 3
(2 for the results' gather as compact JSON, 1 for the status broadcast; 2 more if the commit failed).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable

import torch

from . import codec
from .collectives import Comm, local_synchronization
from .errors import CheckpointExistsError, SaveFailedError, UnsafeObjectError
from .loading import load_checkpoint
from .merging import P2P
from .metadata import (METADATA_FILE, WRITER_FILE, CheckpointMetadata, build_metadata, is_incomplete_checkpoint,
                       writer_alive, writer_is_this_process, writer_record)
from .pipeline import SaveJob, SaveOptions, SavePipeline
from .planner import LocalPlan, SavePlan, decode_plans, make_local_plan, make_save_plan
from .reader import LoadStats
from .replicas import check_replicas
from .resharding import gc_paused
from .staging import StagingPool
from .state import FlatState, check_leaf_fits, flatten
from .storage import Storage

__all__ = ["Engine", "SaveHandle", "SaveStats", "SaveOptions", "get_engine"]

log = logging.getLogger("unickpt")

PLAN_CACHE_SIZE = 8  # distinct layouts remembered per engine (e.g. model-only vs full saves)
OVERLAP_CLONE_BYTES = 64 << 20
"""Overlap snapshots: tensors no optimizer owns (buffers, plain tensors) up to this many bytes in all
are cloned at the call, so that the caller returns without waiting for the plan; more are staged
before the call returns."""
_SIG_BYTES = 48  # error flag, 16-byte plan signature, 8-byte objects digest, 8-byte options digest, 8-byte table digest


@dataclass
class SaveStats:
    """One save on this rank. Seconds (``*_s``), bytes (``bytes*``), counts.

    Stall and stages: ``stall_s`` is the time the save blocked the caller: the call itself (in
    ``sync`` snapshot mode ``plan_s`` + ``pool_wait_s`` + ``stage_s`` and flattening), plus, in
    ``overlap`` mode, any wait of ``optimizer.step()`` for the snapshot; ``snapshot_s`` is the time from the call
    until every byte was staged (equal to the stall in ``sync`` snapshot mode); ``ring_wait_s`` is
    staging time spent waiting for ring space (a state larger than the ring); ``checksum_s``,
    ``merge_wait_s``, ``write_s`` (including fsync), ``upload_s`` are the drain stages' busy times
    (they overlap each other and the staging); ``commit_s`` runs from the end of the drain to the
    commit; ``total_s`` from the call to the commit.

    Sizes: ``bytes_per_rank`` is what every rank writes under the plan, ``max_mean_bytes`` its
    largest over its mean. Collectives: the plan and commit collectives this save ran (gloo
    operations, ``all_gather_object`` counting 2), ``p2p_sends``/``p2p_recvs`` merge transfers.
    """

    path: str
    step: int | None = None
    stall_s: float = 0.0
    plan_s: float = 0.0
    pool_wait_s: float = 0.0
    stage_s: float = 0.0
    snapshot_s: float = 0.0
    ring_wait_s: float = 0.0
    checksum_s: float = 0.0
    merge_wait_s: float = 0.0
    write_s: float = 0.0
    upload_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    bytes_staged: int = 0
    bytes_written: int = 0  # this rank's data + object files
    bytes_uploaded: int = 0
    bytes_per_rank: list = field(default_factory=list)
    max_mean_bytes: float = 1.0
    plan_cache_hit: bool = False  # the layout was planned before: only the signature exchange ran
    collectives_plan: int = 0
    collectives_commit: int = 0
    p2p_sends: int = 0
    p2p_recvs: int = 0
    merge_bytes_sent: int = 0
    merge_bytes_received: int = 0
    pool_capacity: int = 0
    pool_allocations: int = 0  # this ring's (re)allocations so far; unchanged when it was reused
    pool_index: int = 0
    streamed: bool = False  # the rank's bytes exceeded the ring: staged and drained in pieces
    snapshot: str = "sync"
    writer: str = "thread"
    flat_ranges: str = "store"
    committed: bool = False

    @property
    def collectives(self) -> int:
        return self.collectives_plan + self.collectives_commit

    def as_dict(self) -> dict:
        d = asdict(self)
        d["collectives"] = self.collectives
        return d


class SaveHandle:
    """The result of a save: ``wait()`` blocks until committed and raises the save's error, if any."""

    def __init__(self, future: Future, stats: SaveStats, job: SaveJob | None = None):
        self._future = future
        self._job = job
        self.stats = stats
        self.error_reported = False  # a failure is raised once: by wait(), or else by the engine's next wait

    @property
    def path(self) -> str:
        return self.stats.path

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def snapshot_done(self) -> bool:
        """True once every byte of the state is staged (tensors may be changed freely after this)."""
        return self._job is None or self._job.snapshot_done.is_set()

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Block until the snapshot is complete (``overlap`` mode; immediate otherwise). Returns False
        if ``timeout`` seconds passed first. A failed snapshot is raised by :meth:`wait`."""
        return self._job is None or self._job.snapshot_done.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save commits. Raises SaveFailedError (or the save's error) if it failed,
        and concurrent.futures.TimeoutError if ``timeout`` seconds pass first."""
        try:
            self._future.result(timeout)
        except BaseException as e:
            if not isinstance(e, TimeoutError):
                self.error_reported = True
            raise


def _format_exc(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _digest8(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def _storage_ptr(t: Any) -> int | None:
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard
    if not isinstance(local, torch.Tensor) or local.device.type == "meta" or local.numel() == 0:
        return None
    return local.untyped_storage().data_ptr()


def _guarded(flat: FlatState) -> tuple[frozenset, list]:
    """Overlap snapshots: the fqns whose tensors belong to an optimizer of the flattened state (its parameters
    and its state tensors: only ``optimizer.step()`` changes them), and those optimizers."""
    optims = flat.optimizers
    ptrs = set()
    for o in optims:
        for g in o.param_groups:
            ptrs.update(_storage_ptr(p) for p in g["params"])
        for st in o.state.values():
            ptrs.update(_storage_ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
    ptrs.discard(None)
    fqns = frozenset(fqn for fqn, leaf in flat.tensors.items()
                     if fqn not in flat.aliases and leaf.storage_ptr in ptrs)
    return fqns, optims


@dataclass
class _Commit:
    """One save's caller-side data, for the stager (planning) and the commit thread."""

    job: SaveJob
    step: int | None
    framework: str | None
    extra: dict
    on_commit: Callable[[], None] | None
    skeleton: Any = None
    per_rank_blob: bytes | None = None
    started: bool = False
    t0: float = 0.0
    flat: FlatState | None = None
    local: LocalPlan | None = None
    signature: str | None = None
    local_error: BaseException | None = None
    clones: dict = field(default_factory=dict)  # overlap mode: snapshots of tensors no optimizer guards


class _StageFailure(Exception):
    """A pipeline stage's failure text, reported as it is."""


class Engine:
    """Saves and loads for the ranks of one process group (see the module docstring).

    Args:
        process_group: the ranks taking part (default: the world). Its backend is not used.
        timeout_s: deadline of each internal collective.
        options: how saves run (:class:`~unickpt.pipeline.SaveOptions`); see :meth:`configure`.
    """

    def __init__(self, process_group: Any = None, timeout_s: float = 1800.0, options: SaveOptions | None = None):
        self.comm = Comm(process_group, timeout_s)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.options = (options or SaveOptions()).validated()
        self._pools = [StagingPool(0), StagingPool(1)]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unickpt-commit")
        self._pending: list[SaveHandle] = []
        self._in_flight: dict[str, int] = {}  # paths of saves not yet finished (how many)
        self._plan_cache: OrderedDict[tuple, SavePlan] = OrderedDict()
        self._lock = threading.Lock()
        self._seq = 0
        self._hooks: list[tuple[SaveJob, list]] = []  # optimizer step pre-hooks of overlap snapshots
        p2p = None
        if self.world_size > 1:
            import torch.distributed as dist
            from datetime import timedelta

            group = dist.new_group(self.comm.ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                                   use_local_synchronization=local_synchronization(self.comm.ranks))
            p2p = P2P(group, self.comm.ranks)
        self._p2p = p2p
        self._pipeline = SavePipeline(p2p, self.rank)
        self.run_id = uuid.uuid4().hex

    def configure(self, **options: Any) -> SaveOptions:
        """Change how later saves run (fields of :class:`~unickpt.pipeline.SaveOptions`), e.g.
        ``configure(pool_bytes=2 << 30, snapshot="overlap")``. Options that shape the plan
        (``flat_ranges``, ``segment_bytes``, ``upload_to``, ``snapshot``) must be the same on every
        rank (a save raises ValueError otherwise). Raises ValueError for unknown or bad values."""
        unknown = sorted(set(options) - {f.name for f in fields(SaveOptions)})
        if unknown:
            raise ValueError(f"unknown save option(s) {unknown}; see unickpt.pipeline.SaveOptions")
        self.options = replace(self.options, **options).validated()
        return self.options

    # -- save -------------------------------------------------------------------------------------
    def save(self, path: str, state: dict, *, async_save: bool = False, storage_options: dict | None = None,
             step: int | None = None, framework: str | None = None, extra: dict | None = None,
             on_commit: Callable[[], None] | None = None, allow_pickle: bool = False) -> SaveHandle:
        """Save ``state`` to ``path`` (see :func:`unickpt.save`). The caller's part: flatten the state,
        snapshot its plain and per-rank values, then hand the save to the stager thread (planning,
        staging) and wait for it to release the caller (see :mod:`unickpt.pipeline` for the snapshot
        modes). Planning errors are raised here in ``sync`` snapshot mode, on the handle in ``overlap``
        mode."""
        t0 = time.perf_counter()
        opts = self.options
        stats = SaveStats(path=str(path), step=step, snapshot=opts.snapshot, writer=opts.writer,
                          flat_ranges=opts.flat_ranges)
        storage = Storage(path, storage_options)
        path = str(path)
        self._remove_finished_hooks()
        seq, self._seq = self._seq, self._seq + 1
        job = SaveJob(seq, path, storage, None, self.rank, opts, stats, storage_options=storage_options, t0=t0)
        commit = _Commit(job, step, framework, extra or {}, on_commit, t0=t0)
        optims: list = []
        must_wait = opts.snapshot == "sync"
        try:
            # the collector paused while the call allocates its few thousand short-lived objects: a
            # collection pass landing in it walks the whole heap (measured: ~1 ms of a ~4 ms call)
            with gc_paused():
                flat = flatten(state, for_load=False, allow_pickle=allow_pickle)
                for leaf in flat.tensors.values():
                    check_leaf_fits(leaf)
                if opts.snapshot == "overlap":
                    job.guarded, optims, must_wait = self._overlap_snapshot(flat, commit, opts)
                local = make_local_plan(flat, self.rank, job.guarded)
                commit.signature = local.signature()
                local.objects_digest = hashlib.blake2b(repr(sorted(flat.objects)).encode(), digest_size=8).hexdigest()
                commit.local = local
                commit.flat = flat
                if flat.per_rank:
                    encoded = {fqn: codec.encode(pr.state_dict(), allow_pickle=allow_pickle, key=fqn)
                               for fqn, pr in flat.per_rank.items()}
                    commit.per_rank_blob = json.dumps(encoded, separators=(",", ":")).encode()
                if self.rank == 0:
                    commit.skeleton = flat.skeleton
                on_cuda = {t.device for t in (leaf.local for leaf in flat.tensors.values()) if t.is_cuda}
                if on_cuda:
                    from .staging import CudaStager

                    job.cuda_ready = CudaStager.mark_ready(on_cuda)
        except Exception as e:  # every rank must still join the plan exchange, or the others hang
            commit.local_error = e
            commit.local = LocalPlan(rank=self.rank, error=_format_exc(e))
            commit.local.error_type, commit.local.error_message = type(e).__name__, str(e)
            must_wait = True
        with self._lock:
            self._in_flight[path] = self._in_flight.get(path, 0) + 1
        if optims:
            self._guard(job, optims)
        handle = SaveHandle(self._executor.submit(self._drain, commit), stats, job)
        with self._lock:
            self._pending = [h for h in self._pending if not (h.done() and h.error_reported)] + [handle]
        # the hand-off comes last: the stager thread wakes up and competes for the GIL
        self._pipeline.submit(job, lambda j: self._plan_job(commit), lambda j: self._prepare_job(commit))
        if must_wait:
            job.released.wait()
            if job.plan_error is not None:
                handle.error_reported = True  # raised here, not again by the engine's wait()
                with self._lock:
                    self._pending = [h for h in self._pending if h is not handle]
                handle._future.exception()  # its commit-thread part is over: the path is no longer in flight
                raise job.plan_error
        stats.stall_s = time.perf_counter() - t0
        if not async_save:
            handle.wait()
        return handle

    def _overlap_snapshot(self, flat: FlatState, commit: _Commit,
                          opts: SaveOptions) -> tuple[frozenset, list, bool]:
        """Overlap mode: (fqns staged after the caller returns, optimizers to guard, whether the caller
        must wait for the rest to be staged). Tensors no optimizer owns are cloned when they are small
        (at most :data:`OVERLAP_CLONE_BYTES`), so that the caller need not wait at all."""
        guarded, optims = _guarded(flat)
        loose = {fqn: leaf for fqn, leaf in flat.tensors.items() if fqn not in guarded and fqn not in flat.aliases}
        loose_bytes = sum(leaf.local.numel() * leaf.local.element_size() for leaf in loose.values())
        if loose_bytes > min(OVERLAP_CLONE_BYTES, opts.pool_cap(self.world_size) // 4):
            return guarded, optims, True  # stage them before returning (the plan puts them first)
        with torch.no_grad():
            commit.clones = {fqn: leaf.local.clone() for fqn, leaf in loose.items()}
        return frozenset(fqn for fqn in flat.tensors if fqn not in flat.aliases), optims, False

    def _plan_job(self, commit: _Commit) -> None:
        """Stager thread: rank 0 checks the target directory, then every rank agrees on the plan."""
        job, local = commit.job, commit.local
        t0 = time.perf_counter()
        if self.rank == 0 and local is not None and local.error is None:
            try:
                self._prepare_dir(job.storage, job.path)
                if job.options.upload_to is not None:
                    self._prepare_remote(job.options, job.path)
            except Exception as e:
                commit.local_error = e
                commit.local = local = LocalPlan(rank=self.rank, error=_format_exc(e))
                local.error_type, local.error_message = type(e).__name__, str(e)
        assert local is not None
        plan = self._agree_plan(job.path, local, commit.signature, commit.local_error, job.stats, job.options,
                                lambda p, full: self._check_replicas(commit, p, full))
        job.plan = plan
        job.stats.plan_s = time.perf_counter() - t0
        job.stats.bytes_per_rank, job.stats.max_mean_bytes = list(plan.bytes_per_rank), plan.max_mean_bytes

    def _check_replicas(self, commit: _Commit, plan: SavePlan, full: bool) -> None:
        """Stager thread, before staging: the holders of each replicated chunk hold the same bytes
        (:mod:`unickpt.replicas`; raises ReplicaMismatchError on every rank)."""
        if not plan.replicas or self.world_size == 1:
            return
        assert commit.flat is not None
        leaves = {fqn: commit.clones.get(fqn, commit.flat.tensors[fqn].local)
                  for fqn, _, ranks in plan.replicas if self.rank in ranks}
        commit.job.stats.collectives_plan += check_replicas(self.comm, plan.replicas, leaves, full=full)

    def _prepare_job(self, commit: _Commit) -> None:
        """Stager thread, once planned: the staging ring (waiting if both are draining), the leaves
        this rank reads, the drain registration."""
        job = commit.job
        stats, plan, opts, flat = job.stats, job.plan, job.options, commit.flat
        assert plan is not None and flat is not None
        mine = job.mine
        needed = {c.fqn for c in mine} | {s.fqn for s in plan.sends[self.rank]}
        job.leaves = {fqn: commit.clones.get(fqn, flat.tensors[fqn].local) for fqn in needed}
        pin = any(t.is_cuda for t in job.leaves.values()) and torch.cuda.is_available()
        backend = self._pipeline.backend_for(opts, job.storage.is_local, busy=bool(self._pipeline._jobs))
        pool, stats.pool_wait_s = self._acquire_pool()
        job.pool = pool
        try:
            from .hashwrite import stream_layout

            _, stream_len = stream_layout([n for _, n in plan.segments[self.rank]])
            cap = opts.pool_cap(self.world_size)
            pool.reserve(min(stream_len, cap), pin=pin, shared=backend.kind == "process", limit=cap)
            pool.begin()
            stats.pool_capacity, stats.pool_allocations, stats.pool_index = (pool.capacity_bytes, pool.allocations,
                                                                             pool.index)
            stats.streamed = stream_len > pool.capacity_bytes
            if mine:
                job.storage.makedirs(job.storage.join(job.path, "data"))
            self._pipeline.start(job, backend)
            commit.started = True
        except BaseException:
            pool.released.set()
            job.pool = None
            raise

    def _guard(self, job: SaveJob, optims: list) -> None:
        """Overlap snapshots: ``optimizer.step()`` waits until the job's snapshot is complete."""
        def hook(*_: Any) -> None:
            if not job.snapshot_done.is_set():
                t0 = time.perf_counter()
                job.snapshot_done.wait()
                job.stats.stall_s += time.perf_counter() - t0  # the loop is blocked by the save here too
        handles = [o.register_step_pre_hook(hook) for o in optims]
        self._hooks.append((job, handles))

    def _remove_finished_hooks(self) -> None:
        """Caller's thread (never inside ``step``): drop pre-hooks whose snapshot is complete."""
        keep = []
        for job, handles in self._hooks:
            if job.snapshot_done.is_set():
                for h in handles:
                    h.remove()
            else:
                keep.append((job, handles))
        self._hooks = keep

    def _agree_plan(self, path: str, local: LocalPlan, signature: str | None, local_error: BaseException | None,
                    stats: SaveStats, opts: SaveOptions,
                    check: Callable[[SavePlan, bool], None] = lambda plan, full: None) -> SavePlan:
        """Agree on the save plan: one fixed-size signature exchange; the full plans are gathered only
        when this combination of signatures has not been planned before (plan cache). ``check(plan,
        full)`` (the replica check) runs on a miss before the plan is cached, so a layout whose check
        failed is checked again at its next save, and on every save with ``check_replicas="always"``.

        The cache is keyed by every rank's signature and the plan-shaping options, and is filled and
        evicted identically on every rank (same keys in the same order), so all ranks hit or miss
        together. Raises CheckpointExistsError / SaveFailedError (a rank failed before planning),
        ValueError (ranks configured different plan options), StateMismatchError.
        """
        opt_digest = _digest8(repr(opts.plan_key()))
        mine = bytearray(_SIG_BYTES)
        if local.error is None and signature is not None:
            mine[1:17] = bytes.fromhex(signature)
            mine[17:25] = bytes.fromhex(local.objects_digest or "00" * 8)
            mine[25:33] = opt_digest
            mine[33:41] = bytes.fromhex(local.table_digest())
        else:
            mine[0] = 1
        if self.world_size > 1:
            import torch.distributed as dist

            t = torch.frombuffer(mine, dtype=torch.uint8)
            out = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.all_gather(out, t, group=self.comm.plan_group)
            stats.collectives_plan += 1
            rows = [bytes(o.tolist()) for o in out]
        else:
            rows = [bytes(mine)]
        if any(r[0] for r in rows):
            errors = [(local.error, local.error_type, local.error_message)]
            if self.world_size > 1:
                errors = self.comm.all_gather(errors[0], self.comm.plan_group)
                stats.collectives_plan += 2
            failures = {r: e[0] for r, e in enumerate(errors) if e[0]}
            kinds = {e[1] for e in errors if e[0]}
            if kinds == {"UnsafeObjectError"}:  # every failing rank needs pickle: say so with its own type
                raise UnsafeObjectError(next(e[2] for e in errors if e[0])) from local_error
            if kinds == {"CheckpointExistsError"}:  # the target is taken: say so with its own type
                raise CheckpointExistsError(next(e[2] for e in errors if e[0])) from local_error
            raise SaveFailedError(path, failures) from local_error
        if any(r[25:33] != rows[0][25:33] for r in rows):
            raise ValueError(f"{path!r}: ranks configured different save options (flat_ranges, segment_bytes, "
                             f"upload_to, snapshot, check_replicas must agree); this rank has {opts.plan_key()}")
        differ = [r for r, row in enumerate(rows) if row[17:25] != rows[0][17:25]]
        if differ and self.rank == 0:
            log.warning("unickpt: %s: rank(s) %s have other plain (non-tensor) keys than rank 0; only rank 0's "
                        "plain values are saved (declare per-rank values with unickpt.PerRank)", path, differ)
        key = (opts.plan_key(), tuple(r[1:17] for r in rows))
        cached = self._plan_cache.get(key)
        if cached is not None:
            self._plan_cache.move_to_end(key)
            stats.plan_cache_hit = True
            if opts.check_replicas == "always":
                check(cached, True)
            return cached
        plans = [local]
        if self.world_size > 1:
            # a rank whose signature repeats an earlier rank's (a replica's layout) sends nothing, one
            # whose tensor table repeats an earlier rank's sends its specs only: the gathered bytes
            # grow with the distinct layouts and shards, not with world size x keys
            first_of: dict[bytes, int] = {}
            firsts = [first_of.setdefault(row[1:17], r) for r, row in enumerate(rows)]
            table_of: dict[bytes, int] = {}
            table_firsts = [table_of.setdefault(row[33:41], r) for r, row in enumerate(rows)]
            me = self.rank
            mine_bytes = b"" if firsts[me] != me else local.to_bytes(with_table=table_firsts[me] == me)
            blobs = self.comm.all_gather_bytes(mine_bytes, self.comm.plan_group)
            stats.collectives_plan += 2
            plans = decode_plans(blobs, firsts, table_firsts)
        plan = make_save_plan(plans, flat_ranges=opts.flat_ranges, segment_bytes=opts.segment_bytes)
        if opts.check_replicas != "off":
            check(plan, opts.check_replicas == "always")
        self._plan_cache[key] = plan
        while len(self._plan_cache) > PLAN_CACHE_SIZE:
            self._plan_cache.popitem(last=False)
        return plan

    def _prepare_dir(self, storage: Storage, path: str) -> None:
        """Group rank 0: refuse a committed, in-flight or foreign target; clear a crashed save's leftovers."""
        if self.in_flight(path, others=1):  # this save counts itself
            raise CheckpointExistsError(f"{path!r}: a save to this path is still in flight; wait for it first")
        if storage.exists(storage.join(path, METADATA_FILE)):
            raise CheckpointExistsError(
                f"{path!r} already holds a committed checkpoint; committed checkpoints are never "
                "overwritten (choose a new path or step, or delete it first)"
            )
        if storage.exists(path):
            if not is_incomplete_checkpoint(storage, path):
                raise CheckpointExistsError(
                    f"{path!r} exists and is not a unickpt checkpoint directory (it holds other files); "
                    "refusing to delete it: choose another path"
                )
            # this process's own earlier save that failed (none of its engines has it in flight) is a leftover
            ours = writer_is_this_process(storage, path) and not any(
                e.in_flight(path, others=int(e is self)) for _, e in _engines_of(None))
            if writer_alive(storage, path) and not ours:
                raise CheckpointExistsError(
                    f"{path!r}: another process is saving into it (see {WRITER_FILE}); wait for it or "
                    "choose another step"
                )
            log.warning("unickpt: removing incomplete checkpoint directory %s (no %s)", path, METADATA_FILE)
            storage.rm(path)
        storage.makedirs(storage.join(path, "data"))
        storage.write_small(storage.join(path, WRITER_FILE), writer_record())

    def _prepare_remote(self, opts: SaveOptions, path: str) -> None:
        """Group rank 0, with ``upload_to``: the same rules for the remote copy's directory."""
        remote = Storage(opts.upload_to, opts.upload_options)  # type: ignore[arg-type]
        rpath = remote.join(opts.upload_to, os.path.basename(path.rstrip("/")))  # type: ignore[arg-type]
        if remote.exists(remote.join(rpath, METADATA_FILE)):
            raise CheckpointExistsError(f"{rpath!r} (the upload target of {path!r}) already holds a committed "
                                        "checkpoint; committed checkpoints are never overwritten")
        if remote.exists(rpath):
            if not is_incomplete_checkpoint(remote, rpath):
                raise CheckpointExistsError(f"{rpath!r} exists and is not a unickpt checkpoint directory; "
                                            "refusing to delete it")
            remote.rm(rpath)
        remote.makedirs(remote.join(rpath, "data"))

    def in_flight(self, path: str, others: int = 0) -> bool:
        """True while a save to ``path`` started by this process has not finished (any thread);
        ``others``: how many in-flight saves to ignore (the caller's own)."""
        with self._lock:
            return self._in_flight.get(str(path), 0) > others

    def _acquire_pool(self) -> tuple[StagingPool, float]:
        t0 = time.perf_counter()
        while True:
            with self._lock:
                for pool in self._pools:
                    if pool.released.is_set():
                        pool.released.clear()
                        return pool, time.perf_counter() - t0
            # both pools are draining: wait for either (the older one finishes first)
            self._pools[0].released.wait(0.05) or self._pools[1].released.wait(0.05)

    # -- background: drain, then commit -------------------------------------------------------------
    def _drain(self, commit: _Commit) -> None:
        """Commit thread: wait for the drain, gather results, commit. Every rank reaches the collectives."""
        job = commit.job
        try:
            self._write_and_commit(commit)
        finally:
            with self._lock:
                left = self._in_flight.get(job.path, 1) - 1
                if left > 0:
                    self._in_flight[job.path] = left
                else:
                    self._in_flight.pop(job.path, None)

    def _write_and_commit(self, commit: _Commit) -> None:
        job = commit.job
        stats, storage = job.stats, job.storage
        job.prepared.wait()
        if job.plan_error is not None:  # every rank failed the plan exchange alike: nothing to gather
            raise job.plan_error
        t_drain = time.perf_counter()
        if commit.started:
            self._pipeline.wait_drained(job)
        if job.pool is not None:
            job.pool.released.set()
        for k in ("checksum_s", "merge_wait_s", "write_s", "upload_s"):
            setattr(stats, k, job.timings.get(k, 0.0))
        if job.pool is not None:
            stats.ring_wait_s = job.pool.wait_s
        result: dict[str, Any]
        try:
            if job.error is not None:
                raise _StageFailure(job.error)
            if any(d is None for d in job.digests):
                raise RuntimeError("checksum stage: some chunks were written without a checksum")
            per_rank_file = self._write_per_rank(commit)
            result = {"ok": True, "digests": job.digests, "per_rank_file": per_rank_file}
        except BaseException as e:
            result = {"ok": False, "error": str(e) if isinstance(e, _StageFailure) else _format_exc(e)}
        log.debug("unickpt: %s drained in %.3f s", job.path, time.perf_counter() - t_drain)
        t_commit = time.perf_counter()
        try:
            # compact JSON, no pickle: two collectives whatever the world size (see Comm.all_gather_bytes)
            results = [json.loads(b) for b in self.comm.all_gather_bytes(json.dumps(result).encode(),
                                                                          self.comm.background_group)]
            if self.world_size > 1:
                stats.collectives_commit += 2
        except Exception as e:
            raise SaveFailedError(job.path, {self.rank: f"lost contact with the other ranks before the commit "
                                                        f"(a rank died, or the process group was destroyed "
                                                        f"before the save finished): {e!r}"}) from e
        failures = {r: res["error"] for r, res in enumerate(results) if not res["ok"]}
        if failures:
            log.error("unickpt: save to %s failed on rank(s) %s; nothing was committed", job.path, sorted(failures))
            raise SaveFailedError(job.path, failures)
        status = None
        if self.rank == 0:
            try:
                meta = self._build_metadata(commit, results)
                data = meta.to_json().encode()
                if job.options.upload_to is not None:
                    remote = Storage(job.options.upload_to, job.options.upload_options)
                    rdir = self._pipeline.remote_path(job)
                    remote.write_atomic(remote.join(rdir, METADATA_FILE), data)
                storage.write_atomic(storage.join(job.path, METADATA_FILE), data)
            except BaseException as e:
                status = "commit stage: " + _format_exc(e)
            else:
                self._after_commit(commit, t_commit)
        try:
            status = self._broadcast_status(status, stats)
        except Exception as e:
            if self.rank != 0:  # rank 0 knows its own outcome; the others cannot tell
                raise SaveFailedError(job.path, {self.rank: f"lost contact with rank 0 during the commit; whether "
                                                            f"{METADATA_FILE} was written is unknown: {e!r}"}) from e
            log.warning("unickpt: %s committed, but the other ranks could not be told: %r", job.path, e)
        if status is not None:
            log.error("unickpt: commit of %s failed on rank 0; nothing was committed", job.path)
            raise SaveFailedError(job.path, {0: status})
        if self.rank != 0:
            stats.committed = True
            stats.commit_s = time.perf_counter() - t_commit
            stats.total_s = time.perf_counter() - commit.t0

    def _broadcast_status(self, status: str | None, stats: SaveStats) -> str | None:
        """Group rank 0's commit outcome on every rank: one 1-byte broadcast, plus the error text when
        the commit failed."""
        if self.world_size == 1:
            return status
        import torch.distributed as dist

        flag = torch.tensor([0 if status is None else 1], dtype=torch.uint8)
        dist.broadcast(flag, src=self.comm.ranks[0], group=self.comm.background_group)
        stats.collectives_commit += 1
        if int(flag.item()) == 0:
            return None
        stats.collectives_commit += 2
        return self.comm.broadcast(status, self.comm.background_group)

    def _write_per_rank(self, commit: _Commit) -> str | None:
        job = commit.job
        if commit.per_rank_blob is None:
            return None
        rel = f"objects/rank_{self.rank}.json"
        storage = job.storage
        objects = storage.join(job.path, "objects")
        if storage.is_local:  # mkdir, not makedirs: a save directory removed meanwhile is not brought back
            try:
                os.mkdir(storage.strip(objects))
            except FileExistsError:
                pass
        else:
            storage.makedirs(objects)
        job.stats.bytes_written += storage.write_file(storage.join(job.path, rel), [commit.per_rank_blob])
        if job.options.upload_to is not None:
            try:
                job.stats.bytes_uploaded += self._pipeline.upload_file(job, rel)
            except BaseException as e:
                raise RuntimeError("upload stage: " + _format_exc(e)) from e
        return rel

    def _after_commit(self, commit: _Commit, t_commit: float) -> None:
        """Group rank 0, right after ``metadata.json`` landed: stats, ``on_commit``, the log line."""
        stats = commit.job.stats
        stats.committed = True
        stats.commit_s = time.perf_counter() - t_commit
        stats.total_s = time.perf_counter() - commit.t0
        if commit.on_commit is not None:
            try:
                commit.on_commit()
            except Exception:
                log.exception("unickpt: post-commit step (latest pointer / retention) failed for %s", commit.job.path)
        nbytes = sum(stats.bytes_per_rank) or stats.bytes_written  # the job's tensor bytes
        log.info("unickpt: committed %s (step %s): %.1f MB in %.3f s (%.2f GB/s), stall %.3f s, %d rank(s)",
                 commit.job.path, stats.step, nbytes / 1e6, stats.total_s, nbytes / 1e9 / max(stats.total_s, 1e-9),
                 stats.stall_s, self.world_size, extra={"unickpt_event": "save", "unickpt_stats": stats})

    def _build_metadata(self, commit: _Commit, results: list[dict]) -> CheckpointMetadata:
        return build_metadata(commit.job.plan, results, world_size=self.world_size, skeleton=commit.skeleton,
                              step=commit.step, framework=commit.framework, run_id=self.run_id, extra=commit.extra)

    # -- load -------------------------------------------------------------------------------------
    def load(self, path: str, state: dict, *, strict: bool = True, storage_options: dict | None = None,
             allow_pickle: bool = False, verify: bool = True, redistribute: bool | None = None) -> LoadStats:
        """Wait for this engine's pending saves, then load ``path`` into ``state`` (see :func:`unickpt.load`)."""
        self.wait()
        return load_checkpoint(self.comm, str(path), state, strict=strict, storage_options=storage_options,
                               allow_pickle=allow_pickle, verify=verify, redistribute=redistribute)

    # -- lifecycle -----------------------------------------------------------------------------------
    def broadcast(self, obj: Any) -> Any:
        """Group rank 0's ``obj`` on every rank (caller's thread only)."""
        return self.comm.broadcast(obj, self.comm.plan_group)

    def wait(self) -> None:
        """Wait for every pending save; raise the first error not already raised by its handle."""
        with self._lock:
            pending, self._pending = self._pending, []
        first: BaseException | None = None
        for handle in pending:
            try:
                handle._future.result()
            except BaseException as e:  # keep waiting for the rest
                if not handle.error_reported:
                    handle.error_reported = True
                    first = first or e
        self._remove_finished_hooks()
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for the pending saves, then stop the threads, free the staging memory and destroy the
        private groups (no reference to them is kept: torch can then re-initialise on the same store)."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._pipeline.close()
            for pool in self._pools:
                pool.close()
            self.comm.close()
            if self._p2p is not None:
                import torch.distributed as dist

                if dist.is_initialized():
                    try:
                        dist.destroy_process_group(self._p2p.group)
                    except (ValueError, RuntimeError):  # already gone with the default group
                        pass
                self._p2p.group = None
            self._plan_cache.clear()


_ENGINES: dict[Any, Engine] = {}
_ENGINES_LOCK = threading.Lock()


def _engines_of(group: Any) -> list[tuple[Any, Engine]]:
    """The engines that ``destroy_process_group(group)`` takes the process group of: every engine for
    the default group (``None`` / WORLD destroys every group), else the engine of ``group``."""
    import torch.distributed as dist

    with _ENGINES_LOCK:
        if group is None or group is dist.group.WORLD:
            return list(_ENGINES.items())
        return [(k, e) for k, e in _ENGINES.items() if k is group]


def _finish_saves_before_teardown(group: Any) -> BaseException | None:
    """Wait for the in-flight saves of the engines on ``group`` and close those whose private groups
    are about to go; returns the first save error not reported yet (None if none)."""
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


def _finish_saves_at_exit() -> None:
    """Interpreter exit: every engine's in-flight saves finish (commit or fail), and the engines'
    private groups are destroyed, before the interpreter tears the process groups down."""
    error = _finish_saves_before_teardown(None)
    if error is not None:
        log.error("unickpt: a save in flight at exit failed: %s", error)


def _destroy_trampoline(group=None):  # its code replaces torch's destroy_process_group's (see below)
    return _unickpt_destroy_process_group(group)  # noqa: F821 - a global of torch's c10d module


def _install_teardown_guard() -> None:
    """Make ``torch.distributed.destroy_process_group`` (once per process) wait for the saves in flight
    on the group it destroys, then close their engines, before the group goes: a script that ends its
    process group right after an async save (``engine.save_checkpoint(...)``; ``destroy_process_group()``;
    the process ends, however abruptly) keeps that checkpoint. A save that failed is raised from
    ``destroy_process_group`` after the group is destroyed. Also registers an ``atexit`` wait.

    The function object itself is changed (its ``__code__`` becomes a call of the guarded version,
    which runs a copy of torch's original), so that names bound before unickpt was imported
    (``from torch.distributed import destroy_process_group``) get the guard too."""
    import atexit
    import types

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
        error = _finish_saves_before_teardown(group)
        original(group)
        if error is not None:
            raise error

    c10d._unickpt_destroy_process_group = guarded
    target.__code__ = _destroy_trampoline.__code__
    target._unickpt_guard = True  # type: ignore[attr-defined]
    atexit.register(_finish_saves_at_exit)


def get_engine(process_group: Any = None) -> Engine:
    """The engine of ``process_group`` (created on first use, collectively). One per group per process.

    ``UNICKPT_COLLECTIVE_TIMEOUT_S`` (default 1800) bounds each internal collective, so a dead peer
    fails a save instead of hanging it.
    """
    import torch.distributed as dist

    key = process_group if process_group is not None else (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            timeout_s = float(os.environ.get("UNICKPT_COLLECTIVE_TIMEOUT_S", "1800"))
            _install_teardown_guard()
            engine = _ENGINES[key] = Engine(process_group, timeout_s=timeout_s)
        return engine
