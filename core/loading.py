"""Loading a checkpoint into a caller's state, collectively: checks, the zero-redundancy read plan,
reads and point-to-point redistribution, in-place copies, objects, per-rank state, then
``load_state_dict`` calls. Everything is validated and decoded before the first byte is written into
the caller's state, so a mismatch leaves the state untouched; one rank's failure is raised on every
rank (no hang).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import traceback
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import torch
import torch.distributed as dist

from . import codec, dcp_compat
from .codec import str_to_dtype
from .collectives import Comm
from .errors import (CheckpointNotFoundError, FormatVersionError, IntegrityError, LoadFailedError,
                     PerRankReshardError, StateMismatchError, UnsafeObjectError)
from .metadata import ChunkMeta, CheckpointMetadata, TensorMeta, read_metadata
from .read_plan import Segment, batches, make_read_plan
from .reader import LoadStats, TargetReads, copy_overlaps, read_ranges, verify_ranges
from .state import _has_special, flatten, saved_leaves
from .storage import Storage

__all__ = ["load_checkpoint", "DEFAULT_READ_BUFFER_BYTES", "DEFAULT_READ_THREADS"]

log = logging.getLogger("unickpt")

DEFAULT_READ_BUFFER_BYTES = 512 << 20  # per rank per round; UNICKPT_LOAD_BUFFER_BYTES overrides
DEFAULT_READ_THREADS = 4  # ranged reads in flight per rank; UNICKPT_READ_THREADS overrides


def load_checkpoint(comm: Comm, path: str, state: dict, *, strict: bool = True, storage_options: dict | None = None,
                    allow_pickle: bool = False, verify: bool = True, redistribute: bool | None = None) -> LoadStats:
    """Load ``path`` into ``state`` in place on this rank of ``comm`` (collective). See :func:`unickpt.load`.

    Call sequence (every rank): read the metadata, check and decode everything locally; gather a
    signature of what each rank needs (and any rank's failure, raised on every rank); on a plan-cache
    miss gather the needs and build the zero-redundancy read plan; then, round by round within the
    read-buffer budget, read the segments assigned to this rank (in parallel threads) and exchange
    segments with the ranks that need them (point-to-point on the private gloo group), and copy into
    the caller's tensors; finally replace objects, restore per-rank state and call ``load_state_dict``.
    """
    t0 = time.perf_counter()
    stats = LoadStats()
    storage = Storage(path, storage_options)
    if dcp_compat.is_dcp_checkpoint(storage, path):  # a torch.distributed.checkpoint directory (migration)
        return dcp_compat.load_dcp_checkpoint(comm, storage, path, state, strict=strict, allow_pickle=allow_pickle)
    local_error: BaseException | None = None
    signature = None
    try:
        meta = read_metadata(storage, path)
        flat = flatten(state, for_load=True)
        # tensors and per-rank entries from every rank's plan; plain objects are group rank 0's
        _, _, saved_objects = saved_leaves(meta.state_tree)
        saved_tensors = set(meta.tensors) | set(meta.aliases)
        saved_per_rank = set(meta.per_rank.get("fqns", []))
        _take_saved_empty_containers(flat, saved_objects)
        _check_keys(flat, saved_tensors, saved_per_rank, saved_objects, strict, path)
        # Validate and decode everything before the first byte lands in the caller's state, so a
        # mismatch or an unsafe object leaves the state untouched.
        table = _ChunkTable(meta)
        need = TargetReads()
        for fqn, leaf in flat.tensors.items():
            if fqn in saved_tensors:
                source = meta.aliases.get(fqn, fqn)
                tmeta = meta.tensors[source]
                _check_target(leaf, tmeta)
                need.add(leaf, tmeta.shape, table.by_fqn[source], str_to_dtype(tmeta.dtype).itemsize, verify)
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
        signature = _needs_signature(need, table)
    except Exception as e:  # every rank must still join the gather, or the others hang
        local_error = e
    gathered = comm.all_gather((signature, _failure(local_error), socket.gethostname()), comm.plan_group)
    _raise_failures(path, [g[1] for g in gathered], local_error)
    stats.redistributed = _should_redistribute(redistribute, storage, {g[2] for g in gathered})
    if stats.redistributed:
        segments = _read_plan(comm, need, gathered, stats)
    else:  # every rank reads its own needs; segments keep the same shape, with only this rank in them
        segments = [Segment(i, cid, s, n, comm.rank, (comm.rank,))
                    for i, (cid, s, n) in enumerate((cid, s, n) for cid, rs in sorted(need.ranges.items()) for s, n in rs)]
    stats.plan_s = time.perf_counter() - t0
    t_read = time.perf_counter()
    filled = _read_and_exchange(comm, storage, path, table, need, segments, verify, stats)
    stats.read_s = time.perf_counter() - t_read - stats.copy_s
    stats.storage_bytes_read = storage.bytes_read  # tensor bytes plus metadata and per-rank files
    for fqn, want in need.expected.items():
        if filled.get(fqn, 0) != want:
            raise IntegrityError(f"{fqn!r}: stored chunks cover {filled.get(fqn, 0)} of the {want} elements this rank needs")
    with torch.no_grad():
        for staging, target in need.fixups:
            target.copy_(staging)
    for container, key, value in objects.values():
        if not isinstance(container, tuple):
            container[key] = value
    for fqn, value in per_rank.items():
        flat.per_rank[fqn].load_state_dict(value)
    for apply in flat.appliers:
        apply()
    stats.total_s = time.perf_counter() - t0
    if comm.rank == 0:
        got = stats.bytes_read + stats.bytes_received
        log.info("unickpt: loaded %s (step %s): %.1f MB into rank 0 (%.1f MB read, %.1f MB received) in %.3f s "
                 "(%.2f GB/s), stall %.3f s, %d rank(s)", path, meta.step, got / 1e6, stats.bytes_read / 1e6,
                 stats.bytes_received / 1e6, stats.total_s, got / 1e9 / max(stats.total_s, 1e-9), stats.total_s,
                 comm.world_size, extra={"unickpt_event": "load", "unickpt_stats": stats})
    return stats


def _should_redistribute(requested: bool | None, storage: Storage, hosts: set[str]) -> bool:
    """Read each byte once job-wide and redistribute over the group (True), or let every rank read
    what it needs (False). Default (None, or ``UNICKPT_LOAD_REDISTRIBUTE`` = 0/1): redistribute when
    the storage is remote (fsspec URL) or the ranks span several hosts; on one host with local
    storage the kernel's page cache already reads each stored byte from the device once, and copying
    it between processes over the network stack only adds work (measured in benchmarks/load_bench.py).
    """
    if requested is None and os.environ.get("UNICKPT_LOAD_REDISTRIBUTE") in ("0", "1"):
        requested = os.environ["UNICKPT_LOAD_REDISTRIBUTE"] == "1"
    if requested is not None:
        return requested
    return not storage.is_local or len(hosts) > 1


class _ChunkTable:
    """Every stored chunk numbered the same way on every rank: ids in (fqn, chunk) order."""

    def __init__(self, meta: CheckpointMetadata):
        self.chunks: list[tuple[ChunkMeta, torch.dtype]] = []
        self.by_fqn: dict[str, list[tuple[int, ChunkMeta]]] = {}
        for fqn in sorted(meta.tensors):
            t = meta.tensors[fqn]
            dtype = str_to_dtype(t.dtype)
            self.by_fqn[fqn] = []
            for c in t.chunks:
                self.by_fqn[fqn].append((len(self.chunks), c))
                self.chunks.append((c, dtype))


def _needs_signature(need: TargetReads, table: _ChunkTable) -> str:
    """Digest of this rank's needs and the layout of the chunks involved (not their checksums), so
    that later checkpoints of the same layout reuse the read plan."""
    items = [(cid, table.chunks[cid][0].file, table.chunks[cid][0].byte_offset, table.chunks[cid][0].byte_length,
              tuple(rs)) for cid, rs in sorted(need.ranges.items())]
    return hashlib.blake2b(repr(items).encode(), digest_size=16).hexdigest()


_PLAN_CACHES: "weakref.WeakKeyDictionary[Comm, OrderedDict]" = weakref.WeakKeyDictionary()
PLAN_CACHE_SIZE = 4


def _read_plan(comm: Comm, need: TargetReads, gathered: list, stats: LoadStats) -> list[Segment]:
    """The job-wide read plan: from the cache when every rank's needs signature matches a past load
    (caches are filled identically on every rank, so all hit or miss together), else gathered."""
    cache = _PLAN_CACHES.setdefault(comm, OrderedDict())
    key = tuple(g[0] for g in gathered)
    if key in cache:
        cache.move_to_end(key)
        stats.plan_cache_hit = True
        return cache[key]
    # ranks whose needs signature repeats an earlier rank's (replicas) send nothing; the others send
    # their needs as compact JSON (no pickle), so what travels grows with the distinct needs
    first_of: dict[str, int] = {}
    firsts = [first_of.setdefault(k, r) for r, k in enumerate(key)]
    mine = json.dumps(list(need.ranges.items())).encode() if firsts[comm.rank] == comm.rank else b""
    blobs = comm.all_gather_bytes(mine, comm.plan_group)
    distinct = {r: {int(cid): [(int(s), int(n)) for s, n in rs] for cid, rs in json.loads(blobs[r])}
                for r in set(firsts)}
    cache[key] = make_read_plan([distinct[f] for f in firsts])
    while len(cache) > PLAN_CACHE_SIZE:
        cache.popitem(last=False)
    return cache[key]


def _read_and_exchange(comm: Comm, storage: Storage, path: str, table: _ChunkTable, need: TargetReads,
                       segments: list[Segment], verify: bool, stats: LoadStats) -> dict[str, int]:
    """Run the read plan round by round; returns elements copied per fqn."""
    me = comm.rank
    filled: dict[str, int] = {}
    budget = int(os.environ.get("UNICKPT_LOAD_BUFFER_BYTES", DEFAULT_READ_BUFFER_BYTES))
    sizes = {cid: table.chunks[cid][0].byte_length for cid in {s.chunk_id for s in segments}}
    threads = int(os.environ.get("UNICKPT_READ_THREADS", DEFAULT_READ_THREADS))
    error: BaseException | None = None
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="unickpt-read") as pool:
        for round_segments in batches(segments, sizes, budget):
            stats.rounds += 1
            buffers: dict[int, tuple[torch.Tensor, int]] = {}
            for cid in dict.fromkeys(s.chunk_id for s in round_segments):
                if cid in need.direct:
                    buffers[cid] = (need.direct[cid], 0)
                elif cid in need.ranges:
                    rs = need.ranges[cid]
                    buffers[cid] = (torch.empty(rs[-1][0] + rs[-1][1] - rs[0][0], dtype=torch.uint8), rs[0][0])
            stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, sum(
                b.numel() for cid, (b, _) in buffers.items() if cid not in need.direct))

            def view(seg: Segment) -> torch.Tensor:
                buf, lo = buffers[seg.chunk_id]
                return buf[seg.start - lo : seg.start - lo + seg.length]

            works = []
            for seg in round_segments:
                if seg.reader != me and me in seg.needers:
                    works.append(dist.irecv(view(seg), src=comm.ranks[seg.reader], group=comm.plan_group, tag=seg.seg_id))
                    stats.bytes_received += seg.length

            def read(job: list[Segment]) -> tuple[int, int]:
                """Worker thread: one ranged read of touching segments; (bytes read, blocks verified)."""
                chunk, _ = table.chunks[job[0].chunk_id]
                buf, lo = buffers[job[0].chunk_id]
                span = [(job[0].start, job[-1].start + job[-1].length - job[0].start)]
                file = storage.join(path, chunk.file)
                nbytes = read_ranges(storage, file, chunk, span, buf, lo)
                return nbytes, (verify_ranges(buf, lo, span, chunk, file) if verify else 0)

            mine = {pool.submit(read, job): job for job in _coalesce([s for s in round_segments if s.reader == me])}
            for fut in as_completed(mine):
                try:
                    nbytes, blocks = fut.result()
                    stats.bytes_read, stats.reads = stats.bytes_read + nbytes, stats.reads + 1
                    stats.blocks_verified += blocks
                except Exception as e:  # keep serving the peers (they are waiting), fail after the round
                    error = error or e
                for seg in mine[fut]:
                    for dst in seg.needers:
                        if dst != me:
                            works.append(dist.isend(view(seg), dst=comm.ranks[dst], group=comm.plan_group,
                                                    tag=seg.seg_id))
                            stats.bytes_sent += seg.length
            for w in works:
                w.wait()
            if error is not None:  # keep serving the peers in later rounds; copy nothing; report at the end
                continue
            t_copy = time.perf_counter()
            for cid, (buf, lo) in buffers.items():
                if cid in need.direct:  # already in place
                    o = need.overlaps[cid][0]
                    filled[o.fqn] = filled.get(o.fqn, 0) + o.inter.numel
                    continue
                for fqn, n in _copy(buf, lo, need.overlaps.get(cid, []), table.chunks[cid][1]).items():
                    filled[fqn] = filled.get(fqn, 0) + n
            stats.copy_s += time.perf_counter() - t_copy
    if comm.world_size > 1 or error is not None:
        _raise_failures(path, comm.all_gather(_failure(error), comm.plan_group), error)
    return filled


def _coalesce(segments: list[Segment]) -> list[list[Segment]]:
    """Group one reader's segments into read requests: touching segments of one chunk go together."""
    jobs: list[list[Segment]] = []
    for seg in sorted(segments, key=lambda s: (s.chunk_id, s.start)):
        last = jobs[-1][-1] if jobs else None
        if last is not None and last.chunk_id == seg.chunk_id and last.start + last.length == seg.start:
            jobs[-1].append(seg)
        else:
            jobs.append([seg])
    return jobs


def _copy(buf: torch.Tensor, lo: int, overlaps: list, dtype: torch.dtype) -> dict[str, int]:
    by_fqn: dict[str, list] = {}
    for o in overlaps:
        by_fqn.setdefault(o.fqn, []).append(o)
    return {fqn: copy_overlaps(buf, lo, os_, dtype) for fqn, os_ in by_fqn.items()}


def _failure(e: BaseException | None) -> tuple[str, str, str] | None:
    if e is None:
        return None
    return type(e).__name__, str(e), "".join(traceback.format_exception(type(e), e, e.__traceback__))


_SAME_TYPE_ERRORS = {cls.__name__: cls for cls in (StateMismatchError, IntegrityError, CheckpointNotFoundError,
                                                     FormatVersionError, PerRankReshardError, UnsafeObjectError)}


def _raise_failures(path: str, failures: list, local_error: BaseException | None) -> None:
    """Raise the same error on every rank when any rank failed: the local exception where this rank
    failed; elsewhere the failing ranks' error type if they agree on one of unickpt's, else LoadFailedError."""
    failed = {r: f for r, f in enumerate(failures) if f is not None}
    if not failed:
        return
    if local_error is not None:
        raise local_error
    kinds = {f[0] for f in failed.values()}
    first = min(failed)
    if len(kinds) == 1 and failed[first][0] in _SAME_TYPE_ERRORS:
        raise _SAME_TYPE_ERRORS[failed[first][0]](f"rank {first}: {failed[first][1]}")
    raise LoadFailedError(path, {r: f[2] for r, f in failed.items()})


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


def _take_saved_empty_containers(flat, saved_objects: dict) -> None:
    """Where the checkpoint holds a plain value at an fqn where the target has a container of tensors,
    and every tensor of the target's container lies under a container that is empty in the saved
    value, the saved value replaces the target's container whole: an optimizer saved before its first
    step is ``{"state": {}, "param_groups": [...]}``, while the target optimizer's state was initialised
    by torch to have tensors to load into. Exactly the saved state comes back (``load_state_dict`` of
    an empty ``state`` empties it again). Any other shape of difference is left to the key check."""
    for fqn, (container, key) in list(flat.containers.items()):
        if fqn not in saved_objects or fqn not in flat.containers:  # removed as part of an outer one
            continue
        try:
            value = codec.decode(saved_objects[fqn])
        except Exception:  # the key check and the object decoding report it
            continue
        if not _covered(container[key], value):
            continue
        inner = fqn + "."
        for entries in (flat.tensors, flat.objects, flat.per_rank, flat.aliases, flat.containers):
            for name in [n for n in entries if n.startswith(inner)]:
                del entries[name]
        del flat.containers[fqn]
        flat.objects[fqn] = (container, key)


def _covered(target: Any, saved: Any) -> bool:
    """True if every tensor / per-rank / stateful leaf of ``target`` lies under a container that is
    empty in ``saved`` (matched key by key)."""
    if isinstance(saved, (dict, list)) and not saved and isinstance(target, type(saved)):
        return True
    if not _has_special(target):
        return True
    if isinstance(target, dict) and isinstance(saved, dict):
        return all(k in saved and _covered(v, saved[k]) for k, v in target.items())
    if isinstance(target, list) and isinstance(saved, list) and len(target) == len(saved):
        return all(_covered(t, v) for t, v in zip(target, saved))
    return False


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


