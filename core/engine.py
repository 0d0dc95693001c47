"""The engine: one per process group. Runs saves (plan -> stage -> background write -> commit) and loads.

Save call sequence (every rank of the group):

1. caller's thread: flatten the state, build the local plan, ``all_gather`` its signature on the
   private *plan* group; on a plan-cache miss, ``all_gather`` the plans and derive the same global
   plan on every rank (replicas written once, balanced). Group rank 0 first refuses a committed
   target directory and clears an incomplete one.
2. caller's thread: stage this rank's chunks into a free staging pool (ping-pong of two) and
   snapshot per-rank objects. This is the stall; ``save`` returns here when async.
3. background thread (one per engine, so saves commit in order): write this rank's data file
   (and per-rank object file), fsync, release the pool; ``all_gather`` the results on the private
   *background* group; if every rank succeeded, group rank 0 writes ``metadata.json`` atomically
   (the commit) and runs the ``on_commit`` callback; the outcome is broadcast so every rank's
   handle reports the same result (:class:`~unickpt.errors.SaveFailedError` names failed ranks).

A failure anywhere leaves no ``metadata.json``, so the directory is never loaded, and the
previously committed checkpoints are not touched.
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
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from . import codec
from .collectives import Comm
from .errors import CheckpointExistsError, SaveFailedError
from .loading import load_checkpoint
from .reader import LoadStats
from .metadata import METADATA_FILE, ChunkMeta, is_incomplete_checkpoint, CheckpointMetadata, TensorMeta, chunk_checksums
from .planner import GlobalPlan, LocalPlan, _spec_key, make_global_plan, make_local_plan
from .staging import StagingPool
from .state import check_leaf_fits, flatten
from .storage import Storage

__all__ = ["Engine", "SaveHandle", "SaveStats", "get_engine"]

log = logging.getLogger("unickpt")

PLAN_CACHE_SIZE = 8  # distinct layouts remembered per engine (e.g. model-only vs full saves)


@dataclass
class SaveStats:
    """Timings (seconds) and sizes (bytes) of one save on this rank."""

    path: str
    step: int | None = None
    stall_s: float = 0.0  # time the caller was blocked in save()
    plan_s: float = 0.0
    pool_wait_s: float = 0.0  # part of the stall spent waiting for a free staging pool
    stage_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0  # from the call to the commit
    bytes_staged: int = 0
    bytes_written: int = 0  # this rank's data + object files
    plan_cache_hit: bool = False  # the layout was planned before: no plan exchange, no planning
    committed: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


class SaveHandle:
    """The result of a save: ``wait()`` blocks until committed and raises the save's error, if any."""

    def __init__(self, future: Future, stats: SaveStats):
        self._future = future
        self.stats = stats
        self.error_reported = False  # a failure is raised once: by wait(), or else by the engine's next wait

    @property
    def path(self) -> str:
        return self.stats.path

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save commits. Raises SaveFailedError (or the save's error) if it failed,
        and concurrent.futures.TimeoutError if ``timeout`` seconds pass first."""
        try:
            self._future.result(timeout)
        except BaseException as e:
            if not isinstance(e, TimeoutError):
                self.error_reported = True
            raise


def _local_part(leaf: Any, spec: Any) -> torch.Tensor:
    """The part of ``leaf.local`` holding ``spec`` (a planner may split a replicated box into rows)."""
    if spec == leaf.spec:
        return leaf.local
    t = leaf.local
    for d, (o, lo, n) in enumerate(zip(spec.offsets, leaf.spec.offsets, spec.lengths)):
        t = t.narrow(d, o - lo, n)
    return t


def _format_exc(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


@dataclass
class _SaveJob:
    path: str
    storage: Storage
    plan: GlobalPlan
    plans: list[LocalPlan]
    stats: SaveStats
    step: int | None
    framework: str | None
    extra: dict
    on_commit: Callable[[], None] | None
    skeleton: Any = None
    pool: StagingPool | None = None
    staged: list = field(default_factory=list)  # (PlannedChunk, StagedChunk)
    per_rank_blob: bytes | None = None
    error: BaseException | None = None
    t0: float = 0.0


class Engine:
    """Saves and loads for the ranks of one process group (see the module docstring).

    Args:
        process_group: the ranks taking part (default: the world). Its backend is not used.
        timeout_s: deadline of each internal collective.
    """

    def __init__(self, process_group: Any = None, timeout_s: float = 1800.0):
        self.comm = Comm(process_group, timeout_s)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self._pools = [StagingPool(), StagingPool()]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unickpt-save")
        self._pending: list[SaveHandle] = []
        self._in_flight: set[str] = set()  # paths of saves not yet finished
        self._plan_cache: OrderedDict[tuple, tuple[list[LocalPlan], GlobalPlan]] = OrderedDict()
        self._lock = threading.Lock()
        self.run_id = uuid.uuid4().hex

    # -- save -------------------------------------------------------------------------------------
    def save(self, path: str, state: dict, *, async_save: bool = False, storage_options: dict | None = None,
             step: int | None = None, framework: str | None = None, extra: dict | None = None,
             on_commit: Callable[[], None] | None = None) -> SaveHandle:
        t0 = time.perf_counter()
        stats = SaveStats(path=str(path), step=step)
        storage = Storage(path, storage_options)
        path = str(path)
        local_error: BaseException | None = None
        signature = None
        try:
            flat = flatten(state, for_load=False)
            for leaf in flat.tensors.values():
                check_leaf_fits(leaf)
            local = make_local_plan(flat, self.rank)
            signature = local.signature()
            local.objects_digest = hashlib.blake2b(repr(sorted(flat.objects)).encode(), digest_size=8).hexdigest()
            if self.rank == 0:
                self._prepare_dir(storage, path)
        except Exception as e:  # every rank must still join the gather, or the others hang
            local_error, local = e, LocalPlan(rank=self.rank, error=_format_exc(e))
            local.error_type, local.error_message = type(e).__name__, str(e)
        plans, plan = self._global_plan(path, local, signature, local_error, stats)
        stats.plan_s = time.perf_counter() - t0

        job = _SaveJob(path, storage, plan, plans, stats, step, framework, extra or {}, on_commit, t0=t0)
        try:
            job.pool, stats.pool_wait_s = self._acquire_pool()
            t_stage = time.perf_counter()
            mine = plan.writes_for(self.rank)
            layout = job.pool.stage([_local_part(flat.tensors[c.fqn], c.spec) for c in mine])
            job.staged = list(zip(mine, layout))
            stats.bytes_staged = sum(c.nbytes for c in mine)
            if flat.per_rank:
                encoded = {fqn: codec.encode(pr.state_dict()) for fqn, pr in flat.per_rank.items()}
                job.per_rank_blob = json.dumps(encoded, separators=(",", ":")).encode()
            if self.rank == 0:
                job.skeleton = flat.skeleton
            stats.stage_s = time.perf_counter() - t_stage
        except Exception as e:
            job.error = e
        with self._lock:
            self._in_flight.add(path)
        handle = SaveHandle(self._executor.submit(self._drain, job), stats)
        with self._lock:
            self._pending = [h for h in self._pending if not (h.done() and h.error_reported)] + [handle]
        stats.stall_s = time.perf_counter() - t0
        if not async_save:
            handle.wait()
        return handle

    def _global_plan(self, path: str, local: LocalPlan, signature: str | None, local_error: BaseException | None,
                     stats: SaveStats) -> tuple[list[LocalPlan], GlobalPlan]:
        """Agree on the global plan: one small gather of plan signatures; the full plans are gathered
        only when this combination of signatures has not been planned before (plan cache).

        The cache is keyed by every rank's signature and filled and evicted identically on every
        rank (same keys in the same order), so all ranks hit or miss together.
        """
        gathered = self.comm.all_gather((signature, local.error, local.error_type, local.error_message,
                                         local.objects_digest), self.comm.plan_group)
        failures = {r: g[1] for r, g in enumerate(gathered) if g[1]}
        if failures:
            kinds = {g[2] for g in gathered if g[1]}
            if kinds == {"CheckpointExistsError"}:  # the target is taken: say so with its own type
                raise CheckpointExistsError(next(g[3] for g in gathered if g[1])) from local_error
            raise SaveFailedError(path, failures) from local_error
        differ = [r for r, g in enumerate(gathered) if g[4] != gathered[0][4]]
        if differ and self.rank == 0:
            log.warning("unickpt: %s: rank(s) %s have other plain (non-tensor) keys than rank 0; only rank 0's "
                        "plain values are saved (declare per-rank values with unickpt.PerRank)", path, differ)
        key = tuple(g[0] for g in gathered)
        cached = self._plan_cache.get(key)
        if cached is not None:
            self._plan_cache.move_to_end(key)
            stats.plan_cache_hit = True
            return cached
        plans = self.comm.all_gather(local, self.comm.plan_group)
        plan = make_global_plan(plans)
        self._plan_cache[key] = (plans, plan)
        while len(self._plan_cache) > PLAN_CACHE_SIZE:
            self._plan_cache.popitem(last=False)
        return plans, plan

    def _prepare_dir(self, storage: Storage, path: str) -> None:
        """Group rank 0: refuse a committed, in-flight or foreign target; clear a crashed save's leftovers."""
        if self.in_flight(path):
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
            log.warning("unickpt: removing incomplete checkpoint directory %s (no %s)", path, METADATA_FILE)
            storage.rm(path)
        storage.makedirs(storage.join(path, "data"))

    def in_flight(self, path: str) -> bool:
        """True while a save to ``path`` started by this process has not finished (any thread)."""
        with self._lock:
            return str(path) in self._in_flight

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

    def _drain(self, job: _SaveJob) -> None:
        """Background thread: write, gather results, commit. Every rank reaches both collectives."""
        try:
            self._write_and_commit(job)
        finally:
            with self._lock:
                self._in_flight.discard(job.path)

    def _write_and_commit(self, job: _SaveJob) -> None:
        stats, storage = job.stats, job.storage
        result: dict[str, Any]
        t_write = time.perf_counter()
        try:
            if job.error is not None:
                raise job.error
            result = {"ok": True, "records": self._write_files(job)}
        except BaseException as e:
            result = {"ok": False, "error": _format_exc(e)}
        finally:
            if job.pool is not None:
                job.pool.released.set()
        stats.write_s = time.perf_counter() - t_write
        t_commit = time.perf_counter()
        try:
            results = self.comm.all_gather(result, self.comm.background_group)
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
                meta = self._build_metadata(job, [res["records"] for res in results])
                storage.write_atomic(storage.join(job.path, METADATA_FILE), meta.to_json().encode())
            except BaseException as e:
                status = _format_exc(e)
            else:
                self._after_commit(job, t_commit)
        try:
            status = self.comm.broadcast(status, self.comm.background_group)
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
            stats.total_s = time.perf_counter() - job.t0

    def _after_commit(self, job: _SaveJob, t_commit: float) -> None:
        """Group rank 0, right after ``metadata.json`` landed: stats, ``on_commit``, the log line."""
        stats = job.stats
        stats.committed = True
        stats.commit_s = time.perf_counter() - t_commit
        stats.total_s = time.perf_counter() - job.t0
        if job.on_commit is not None:
            try:
                job.on_commit()
            except Exception:
                log.exception("unickpt: post-commit step (latest pointer / retention) failed for %s", job.path)
        log.info("unickpt: committed %s: %.1f MB by rank 0, stall %.3f s, total %.3f s", job.path,
                 stats.bytes_written / 1e6, stats.stall_s, stats.total_s)

    def _write_files(self, job: _SaveJob) -> dict:
        storage, pool = job.storage, job.pool
        records = []
        if job.staged:
            rel = f"data/{self.rank}_0.bin"
            offset = 0
            buffers = []
            for chunk, staged in job.staged:
                mv = memoryview(pool.view(staged).numpy())
                digest, blocks, block_bytes = chunk_checksums(mv)
                records.append((chunk.fqn, chunk.spec, rel, offset, staged.nbytes, digest, blocks, block_bytes))
                buffers.append(mv)
                offset += staged.nbytes
            job.stats.bytes_written += storage.write_file(storage.join(job.path, rel), buffers)
        per_rank_file = None
        if job.per_rank_blob is not None:
            per_rank_file = f"objects/rank_{self.rank}.json"
            storage.makedirs(storage.join(job.path, "objects"))
            job.stats.bytes_written += storage.write_file(storage.join(job.path, per_rank_file), [job.per_rank_blob])
        return {"chunks": records, "per_rank_file": per_rank_file}

    def _build_metadata(self, job: _SaveJob, records: list[dict]) -> CheckpointMetadata:
        chunks: dict[str, list[ChunkMeta]] = {fqn: [] for fqn in job.plan.tensors}
        for rank_records in records:
            for fqn, spec, rel, offset, nbytes, digest, blocks, block_bytes in rank_records["chunks"]:
                chunks[fqn].append(ChunkMeta(spec, rel, offset, nbytes, digest, blocks, block_bytes))
        tensors = {
            fqn: TensorMeta(dtype, shape, tuple(sorted(chunks[fqn], key=lambda c: _spec_key(c.spec))))
            for fqn, (dtype, shape) in job.plan.tensors.items()
        }
        per_rank_fqns = sorted({f for p in job.plans for f in p.per_rank_fqns})
        per_rank = {}
        if per_rank_fqns:
            per_rank = {"world_size": self.world_size, "fqns": per_rank_fqns,
                        "files": [r["per_rank_file"] for r in records]}
        return CheckpointMetadata(
            tensors=tensors, state_tree=job.skeleton, layout={"world_size": self.world_size},
            aliases=job.plan.aliases, per_rank=per_rank, step=job.step, framework=job.framework,
            run_id=self.run_id, extra=job.extra,
        )

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
        if first is not None:
            raise first

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self.comm.close()


_ENGINES: dict[Any, Engine] = {}
_ENGINES_LOCK = threading.Lock()


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
            engine = _ENGINES[key] = Engine(process_group, timeout_s=timeout_s)
        return engine
