"""The commit of a save: every rank's bytes are durable, then group rank 0 writes ``metadata.json``.

Runs on the engine's commit thread (one per engine, so saves commit in the order they were called),
on the private *background* gloo group, after the drain (:meth:`~unickpt.saving.pipeline.SavePipeline.wait_drained`):

1. each rank checks that each of its data files holds the bytes the plan gives it (a short write,
   a disk that reported more than it kept, fails the save here: one ``size`` per file), then writes
   its per-rank object file and, when the plan has split tensors (format v2), its index file
   ``index/<rank>.idx`` (the files, offsets and checksums of its parts of them), each checked the
   same way; both are uploaded with ``upload_to``;
2. ``all_gather`` of every rank's outcome as compact JSON (**2 collectives**, no pickle: places and
   checksums of its explicit chunks, its object file, or its failure with the stage's name);
3. if every rank succeeded, group rank 0 builds the metadata (:func:`build_metadata`) and writes it
   atomically: the remote copy's first when uploading, then the local one. Its presence is the
   commit (:mod:`unickpt.lifecycle.directory`); then ``on_commit`` runs (``latest``, retention);
4. group rank 0's outcome is broadcast (**1 collective**: a 1-byte flag, plus 2 carrying the error
   text when the commit failed), so every rank's handle reports the same result.

A failure anywhere leaves no ``metadata.json``: the directory is never loaded, the previously
committed checkpoints are not touched, and every rank raises the same
:class:`~unickpt.errors.SaveFailedError` naming the failed ranks and stages. Group rank 0 marks the
failed save's writer record (:func:`~unickpt.lifecycle.directory.mark_failed`) and removes the
directory (and its remote copy) at once when every rank joined the gather (all are past their
writes), else (or when the removal fails: read-only storage) after this engine's next successful
commit; never while another save into it is in flight in this process, nor once its writer record
changed (another save took it over).
"""
from __future__ import annotations

import errno
import json
import logging
import time
from typing import Any, Callable

import torch

from ..dist.comm import Comm
from ..dist.failures import lost_contact
from ..errors import SaveFailedError
from ..format.files import INDEX_DIR, METADATA_FILE, index_file, objects_file
from ..format.hf_shards import INDEX_NAME
from ..format.index import IndexRecord, encode_index
from ..format.integrity import CHECKSUM_BLOCK_BYTES, MAX_BLOCKS_PER_CHUNK
from ..format.metadata import CheckpointMetadata, ChunkMeta, TensorMeta, spec_order
from ..lifecycle.directory import CheckpointDir
from ..plan.save_plan import SavePlan
from ..storage import open_storage
from ..storage.base import StorageBackend
from .request import SaveStats, SaveTask
from .run import DrainResult
from .snapshot import Snapshot, format_exc
from .upload import Uploader, format_upload_error, remote_dir

__all__ = ["Committer", "build_metadata"]

log = logging.getLogger("unickpt")


class _StageFailure(Exception):
    """A pipeline stage's failure text, reported as it is."""


def build_metadata(plan: SavePlan, results: list[dict], *, world_size: int, skeleton: Any, step: int | None = None,
                   framework: str | None = None, run_id: str | None = None, extra: dict | None = None,
                   partial: bool = False) -> CheckpointMetadata:
    """The metadata a save commits: every explicit chunk of ``plan`` (a
    :class:`~unickpt.plan.save_plan.SavePlan`) with its file, offset and checksums, tensors' chunks
    in spec order; each split tensor as its rule and index slot (format v2; its parts' records are in
    the writers' index files).

    Args:
        results: per rank, ``{"digests": [(checksum, block checksums, block bytes)], "places":
            [(data file number, byte offset)]`` of its explicit chunks in the order of
            ``plan.explicit[rank]``, ``"per_rank_file": relative path or None}``.
        world_size: the saving world (``layout.world_size``; also ``per_rank.world_size``).
        partial: the save was a part of a job-wide state (``SaveOptions.partial``): ``layout.partial``
            is set, and readers accept tensors that the chunks do not cover entirely.

    Linear in the number of explicit chunks (one sort per tensor) plus the tensors and ranks.
    """
    chunks: dict[str, list[ChunkMeta]] = {fqn: [] for fqn in plan.tensors if fqn not in plan.splits}
    for r in range(world_size):
        res = results[r]
        for (fqn, spec, nbytes), (digest, blocks, block_bytes), (seg, off) in zip(plan.explicit[r], res["digests"],
                                                                                 res["places"]):
            chunks[fqn].append(ChunkMeta(spec, plan.segments[r][seg][0], off, nbytes, digest, tuple(blocks), block_bytes))
    tensors = {}
    for fqn, (dtype, shape) in plan.tensors.items():
        if fqn in plan.splits:
            split, slot = plan.splits[fqn]
            tensors[fqn] = TensorMeta(dtype, shape, split=split, slot=slot)
        else:
            tensors[fqn] = TensorMeta(dtype, shape, tuple(sorted(chunks[fqn], key=lambda c: spec_order(c.spec))))
    index = {}
    if plan.splits:
        index = {"writers": world_size, "slots": len(plan.splits), "block_bytes": CHECKSUM_BLOCK_BYTES,
                 "max_blocks": MAX_BLOCKS_PER_CHUNK}
    per_rank = {}
    if plan.per_rank_fqns:
        per_rank = {"world_size": world_size, "fqns": list(plan.per_rank_fqns),
                    "files": [r["per_rank_file"] for r in results]}
    layout: dict = {"world_size": world_size, **({"partial": True} if partial else {})}
    return CheckpointMetadata(tensors=tensors, state_tree=skeleton, layout=layout,
                              aliases=plan.aliases, per_rank=per_rank, step=step, framework=framework,
                              run_id=run_id, extra=extra or {}, index=index)


def _never_busy(path: str, others: int = 0) -> bool:
    return False


class Committer:
    """The commits of one group's saves (see the module docstring).

    Args:
        comm: the group's collectives; ``run_id``: recorded in every ``metadata.json`` of this engine.
    """

    def __init__(self, comm: Comm, run_id: str):
        self.comm, self.run_id = comm, run_id
        self.rank, self.world_size = comm.rank, comm.world_size
        # group rank 0: this engine's failed saves, (path, storage options, save options, writer record
        # bytes after the failure), removed after the next successful commit (see the module docstring)
        self._failed: list[tuple[str, Any, Any, bytes]] = []
        # busy(path, others): more than ``others`` saves into path are in flight in this process (set by the saver)
        self.busy: Callable[[str, int], bool] = _never_busy

    def commit(self, req: SaveTask, plan: SavePlan, snap: Snapshot, drained: DrainResult, error: str | None,
               stats: SaveStats) -> None:
        """Commit thread: steps 1-4 of the module docstring. ``error``: this rank's first stage failure.
        Returns once committed on every rank; raises SaveFailedError otherwise."""
        result: dict[str, Any]
        try:
            if error is not None:
                raise _StageFailure(error)
            if any(d is None for d in drained.digests):
                raise RuntimeError("checksum stage: some chunks were written without a checksum")
            self._check_lengths(req, plan)
            per_rank_file = self._write_per_rank(req, snap, stats)
            mine = plan.writes[self.rank]
            if plan.splits:
                self._write_index(req, plan, mine, drained.digests, stats)
            explicit = [i for i, c in enumerate(mine) if c.slot < 0]
            result = {"ok": True, "digests": [drained.digests[i] for i in explicit],
                      "places": [(mine[i].segment, mine[i].offset) for i in explicit], "per_rank_file": per_rank_file}
        except BaseException as e:
            result = {"ok": False, "error": str(e) if isinstance(e, _StageFailure) else format_exc(e)}
        t_commit = time.perf_counter()
        try:
            # compact JSON, no pickle: two collectives whatever the world size (see Comm.all_gather_bytes)
            results = [json.loads(b) for b in self.comm.all_gather_bytes(json.dumps(result).encode(),
                                                                          self.comm.background_group)]
            if self.world_size > 1:
                stats.collectives_commit += 2
        except Exception as e:
            self._failed_attempt(req, now=False)  # the other ranks may still be writing into it
            raise lost_contact(SaveFailedError, req.path, self.rank, self.world_size,
                               "before the commit (or the process group was destroyed first)", e) from e
        failures = {r: res["error"] for r, res in enumerate(results) if not res["ok"]}
        if failures:
            log.error("unickpt: save to %s failed on rank(s) %s; nothing was committed", req.path, sorted(failures))
            self._failed_attempt(req, now=True)
            raise SaveFailedError(req.path, failures)
        status = None
        if self.rank == 0:
            try:
                meta = build_metadata(plan, results, world_size=self.world_size, skeleton=snap.skeleton,
                                      step=req.step, framework=req.framework, run_id=self.run_id, extra=req.extra,
                                      partial=req.options.partial)
                data = meta.to_json().encode()
                if plan.hf_index is not None:  # safetensors shards of several writers: their index, before the commit
                    req.storage.write_atomic(req.storage.join(req.path, INDEX_NAME), plan.hf_index)
                    if req.options.upload_to is not None:
                        Uploader.upload_file(req, INDEX_NAME)
                if req.options.upload_to is not None:
                    Uploader.commit(req, data)
                CheckpointDir(req.storage, req.path).commit(data)
            except BaseException as e:
                status = "commit stage: " + format_exc(e)
            else:
                self._after_commit(req, stats, t_commit)
        try:
            status = self._broadcast_status(status, stats)
        except Exception as e:
            if self.rank != 0:  # rank 0 knows its own outcome; the others cannot tell
                raise SaveFailedError(req.path, {self.rank: f"lost contact with rank 0 during the commit; whether "
                                                           f"{METADATA_FILE} was written is unknown: {e!r}"},
                                      committed=None) from e
            log.warning("unickpt: %s committed, but the other ranks could not be told: %r", req.path, e)
        if status is not None:
            log.error("unickpt: commit of %s failed on rank 0; nothing was committed", req.path)
            self._failed_attempt(req, now=True)
            raise SaveFailedError(req.path, {0: status})
        if self.rank != 0:
            stats.committed = True
            stats.commit_s = time.perf_counter() - t_commit
            stats.total_s = time.perf_counter() - req.t0

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

    def _write_per_rank(self, req: SaveTask, snap: Snapshot, stats: SaveStats) -> str | None:
        if snap.per_rank_blob is None:
            return None
        rel = objects_file(self.rank)
        storage = req.storage
        # mkdir, not makedirs: a save directory removed meanwhile is not brought back
        storage.mkdir(storage.join(req.path, rel.split("/")[0]))
        stats.bytes_written += _write_checked(storage, storage.join(req.path, rel), snap.per_rank_blob)
        if req.options.upload_to is not None:
            try:
                stats.bytes_uploaded += Uploader.upload_file(req, rel)
            except BaseException as e:
                raise RuntimeError(format_upload_error(e)) from e
        return rel

    def _write_index(self, req: SaveTask, plan: SavePlan, mine: list, digests: list, stats: SaveStats) -> None:
        """Format v2: this rank's index file, a record per split tensor (its part: file, offset,
        checksums; an empty record where its part is empty), durable before the commit."""
        records = {c.slot: IndexRecord(c.segment, c.offset, c.nbytes, d[0], tuple(d[1]), d[2])
                   for c, d in zip(mine, digests) if c.slot >= 0}
        rel = index_file(self.rank)
        storage = req.storage
        storage.mkdir(storage.join(req.path, INDEX_DIR))
        stats.bytes_written += _write_checked(storage, storage.join(req.path, rel),
                                              encode_index(self.rank, len(plan.splits), records))
        if req.options.upload_to is not None:
            try:
                stats.bytes_uploaded += Uploader.upload_file(req, rel)
            except BaseException as e:
                raise RuntimeError(format_upload_error(e)) from e

    def _check_lengths(self, req: SaveTask, plan: SavePlan) -> None:
        """Each of this rank's data files holds the bytes the plan gives it (a disk that accepted a
        write and kept less, a file cut meanwhile); raises OSError(EIO) naming the file, the bytes
        written and the bytes it holds. One ``size`` per file."""
        storage = req.storage
        for rel, nbytes in plan.segments[self.rank]:
            _check_size(storage, storage.join(req.path, rel), nbytes)

    def _failed_attempt(self, req: SaveTask, now: bool) -> None:
        """Group rank 0, the save into ``req.path`` failed: mark its writer record and remove its
        directory (``now``: every rank is past its writes, having joined the commit's gather), or,
        where that is not known or the removal fails, after the next successful commit."""
        if self.rank != 0:
            return
        try:
            record = CheckpointDir(req.storage, req.path).mark_failed()
        except Exception:  # best effort: the directory is left for retention or `unickpt prune`
            log.warning("unickpt: could not mark %s as failed", req.path, exc_info=True)
            return
        if record is not None:  # a directory this save made (every save into it writes a record first)
            self._failed.append((req.path, req.storage_options, req.options, record))
            if now:
                self._remove_failed(req.path, committed=False)

    def _remove_failed(self, current: str, committed: bool) -> None:
        """Group rank 0, after the save into ``current`` committed or failed: remove the directories
        (and remote copies) of this engine's failed saves that are still as they were left:
        uncommitted, nothing but a save's files inside, the same writer record, no (other) save into
        them in flight in this process. What cannot be removed now is tried again next time."""
        pending, self._failed = self._failed, []
        for entry in pending:
            path, storage_options, options, record = entry
            if committed and path == current:
                continue  # a retry into it just committed
            if self.busy(path, 1 if path == current else 0):  # the failing save itself is still counted
                self._failed.append(entry)  # a retry in flight: looked at again after the next commit
                continue
            try:
                storage = open_storage(path, storage_options)  # a new handle: not the failed save's
                ckpt = CheckpointDir(storage, path)  # incomplete: uncommitted, nothing but a save's files
                if not ckpt.is_incomplete() or storage.read_bytes(ckpt.writer_path) != record:
                    continue  # taken over by another save, or holding other files: not ours to remove
                targets = [(storage, path)]
                if options.upload_to is not None:
                    targets.insert(0, remote_dir(options, path))
                for store, target in targets:  # the remote copy first: the local one's record guards both
                    if CheckpointDir(store, target).is_incomplete():
                        store.rm(target)
                log.info("unickpt: removed %s, left by a failed save", path)
            except FileNotFoundError:
                continue  # removed meanwhile
            except Exception as e:  # storage still failing: tried again after the next commit
                log.warning("unickpt: could not remove %s, left by a failed save: %s", path, e)
                self._failed.append(entry)

    def _after_commit(self, req: SaveTask, stats: SaveStats, t_commit: float) -> None:
        """Group rank 0, right after ``metadata.json`` landed: stats, ``on_commit``, the removal of
        earlier failed saves' directories, the log line."""
        stats.committed = True
        stats.commit_s = time.perf_counter() - t_commit
        stats.total_s = time.perf_counter() - req.t0
        if req.on_commit is not None:
            try:
                req.on_commit()
            except Exception:
                log.exception("unickpt: post-commit step (latest pointer / retention) failed for %s", req.path)
        if self._failed:
            self._remove_failed(req.path, committed=True)
        nbytes = sum(stats.bytes_per_rank) or stats.bytes_written  # the job's tensor bytes
        log.debug("unickpt: committed %s (step %s): %.1f MB in %.3f s (%.2f GB/s), stall %.3f s, %d rank(s)",
                  req.path, stats.step, nbytes / 1e6, stats.total_s, nbytes / 1e9 / max(stats.total_s, 1e-9),
                  stats.stall_s, self.world_size, extra={"unickpt_event": "save", "unickpt_stats": stats})


def _check_size(storage: StorageBackend, path: str, nbytes: int) -> None:
    """``path`` holds the ``nbytes`` bytes written to it; else OSError(EIO) naming the file, the bytes
    written and the bytes it holds (a short write: a disk that accepted a write and kept less)."""
    held = storage.size(path)
    if held != nbytes:
        raise OSError(errno.EIO, f"{path}: {nbytes} bytes were written, the file holds {held} (a short write)")


def _write_checked(storage: StorageBackend, path: str, blob: bytes) -> int:
    """Write ``blob`` (a per-rank object file, an index file) to ``path`` and check the file holds all of
    it (:func:`_check_size`). Returns the bytes written."""
    n = storage.write_file(path, [blob])
    _check_size(storage, path, len(blob))
    return n
