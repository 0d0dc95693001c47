"""Loading a checkpoint into a caller's state, collectively: the :class:`Loader` of one process group.

Call sequence (every rank of the group, on the caller's thread): read ``metadata.json``; flatten the
target state; check keys, dtypes and shapes and decode every plain value (:mod:`.checks`), so that a
mismatch leaves the state untouched; work out the byte ranges this rank's targets need
(:mod:`.targets`); gather a signature of those needs with any rank's failure (**1 collective**:
``all_gather_object``, 2 gloo ops; a failure is raised on every rank, :mod:`unickpt.dist.failures`);
on a plan-cache miss gather the distinct needs as compact JSON (**2 collectives**) and build the
zero-redundancy read plan (:mod:`unickpt.plan.read_plan`); run the reads and their redistribution
round by round (:mod:`.exchange`; point-to-point, then **1 collective** for the outcome); finally
replace plain values, restore per-rank state and call ``load_state_dict``.

A ``torch.distributed.checkpoint`` directory is migrated instead (:mod:`.dcp`, opt-in: pickles).
"""
from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from typing import Any

import torch

from ..dist import failures
from ..dist.comm import Comm
from ..errors import IntegrityError, PerRankReshardError, StateMismatchError
from ..format.dtypes import str_to_dtype
from ..format.metadata import CheckpointMetadata, read_metadata
from ..options import LoadOptions, check_options
from ..plan.cache import PlanCache
from ..plan.read_plan import Segment, make_read_plan
from ..state import codec
from ..state.flat import flatten, saved_leaves
from ..storage import open_storage
from . import dcp
from .checks import check_keys, check_target, take_saved_empty_optimizer_states
from .exchange import read_and_exchange
from .stats import LoadStats
from .targets import ChunkTable, TargetReads

__all__ = ["Loader", "PLAN_CACHE_SIZE"]

log = logging.getLogger("unickpt")

PLAN_CACHE_SIZE = 4  # read plans remembered per group (distinct targets, e.g. model-only and full loads)


class Loader:
    """Loads for the ranks of ``comm`` (see the module docstring). Keeps the group's read-plan cache.

    Args:
        comm: the group's collectives (:class:`~unickpt.dist.comm.Comm`; ``Comm.solo()``: this process alone).
    """

    def __init__(self, comm: Comm):
        self.comm = comm
        self.plans: PlanCache[list[Segment]] = PlanCache(PLAN_CACHE_SIZE)

    def load(self, path: str, state: dict, *, strict: bool = True, storage_options: dict | None = None,
             allow_pickle: bool = False, options: LoadOptions | None = None) -> LoadStats:
        """Load ``path`` into ``state`` in place on this rank (collective). See :func:`unickpt.load`.

        Raises, on every rank, what :func:`unickpt.load` lists, and ValueError / TypeError for options
        that are bad on some rank or that the ranks do not share (``redistribute``)."""
        opts = LoadOptions()
        comm = self.comm
        t0 = time.perf_counter()
        stats = LoadStats()
        storage = open_storage(path, storage_options)
        if dcp.is_dcp_checkpoint(storage, path):  # a torch.distributed.checkpoint directory (migration)
            return dcp.load_dcp_checkpoint(comm, storage, path, state, strict=strict, allow_pickle=allow_pickle)
        local_error: BaseException | None = None
        signature = None
        try:
            opts = check_options(options if options is not None else LoadOptions(), LoadOptions, "load").validated()
        except (TypeError, ValueError) as e:  # a bad argument of the call: raised with its own type on every rank
            local_error, tag = e, "options"
        else:
            tag = None
        try:
            if local_error is not None:
                raise local_error
            meta = read_metadata(storage, path)
            flat = flatten(state, for_load=True)
            # tensors and per-rank entries from every rank's plan; plain objects are group rank 0's
            _, _, saved_objects = saved_leaves(meta.state_tree)
            saved_tensors = set(meta.tensors) | set(meta.aliases)
            saved_per_rank = set(meta.per_rank.get("fqns", []))
            take_saved_empty_optimizer_states(flat, saved_objects)
            check_keys(flat, saved_tensors, saved_per_rank, saved_objects, strict, path)
            # Validate and decode everything before the first byte lands in the caller's state, so a
            # mismatch or an unsafe object leaves the state untouched.
            table = ChunkTable(meta)
            need = TargetReads()
            for fqn, leaf in flat.tensors.items():
                if fqn in saved_tensors:
                    source = meta.aliases.get(fqn, fqn)
                    tmeta = meta.tensors[source]
                    check_target(leaf, tmeta)
                    need.add(leaf, tmeta.shape, table.by_fqn[source], str_to_dtype(tmeta.dtype).itemsize, opts.verify)
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
        gathered = failures.agree(comm, path, local_error, (signature, socket.gethostname(), opts.redistribute), tag)
        asked = {g[2] for g in gathered}
        if len(asked) > 1:  # the read plan is collective: every rank must take part in it, or none
            raise ValueError(f"{path!r}: ranks asked for different redistribute settings "
                             f"({', '.join(f'rank {r}: {g[2]}' for r, g in enumerate(gathered))}); pass the same "
                             "LoadOptions(redistribute=...) on every rank")
        stats.redistributed = _should_redistribute(opts.redistribute, storage, {g[1] for g in gathered})
        if stats.redistributed:
            segments = self._read_plan(need, [g[0] for g in gathered], stats)
        else:  # every rank reads its own needs; segments keep the same shape, with only this rank in them
            segments = [Segment(i, cid, s, n, comm.rank, (comm.rank,))
                        for i, (cid, s, n) in enumerate((cid, s, n) for cid, rs in sorted(need.ranges.items())
                                                         for s, n in rs)]
        stats.plan_s = time.perf_counter() - t0
        t_read = time.perf_counter()
        filled = read_and_exchange(comm, storage, path, table, need, segments, opts, stats)
        stats.read_s = time.perf_counter() - t_read - stats.copy_s
        stats.storage_bytes_read = storage.bytes_read  # tensor bytes plus metadata and per-rank files
        for fqn, want in need.expected.items():
            if filled.get(fqn, 0) != want:
                raise IntegrityError(f"{fqn!r}: stored chunks cover {filled.get(fqn, 0)} of the {want} elements "
                                     "this rank needs")
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

    def _read_plan(self, need: TargetReads, signatures: list[str], stats: LoadStats) -> list[Segment]:
        """The job-wide read plan: from the cache when every rank's needs signature matches a past load
        (caches are filled identically on every rank, so all hit or miss together), else gathered."""
        key = tuple(signatures)
        cached = self.plans.get(key)
        if cached is not None:
            stats.plan_cache_hit = True
            return cached
        # ranks whose needs signature repeats an earlier rank's (replicas) send nothing; the others send
        # their needs as compact JSON (no pickle), so what travels grows with the distinct needs
        first_of: dict[str, int] = {}
        firsts = [first_of.setdefault(k, r) for r, k in enumerate(key)]
        mine = json.dumps(list(need.ranges.items())).encode() if firsts[self.comm.rank] == self.comm.rank else b""
        blobs = self.comm.all_gather_bytes(mine, self.comm.plan_group)
        distinct = {r: {int(cid): [(int(s), int(n)) for s, n in rs] for cid, rs in json.loads(blobs[r])}
                    for r in set(firsts)}
        plan = make_read_plan([distinct[f] for f in firsts])
        self.plans.put(key, plan)
        return plan


def _should_redistribute(requested: bool | None, storage: Any, hosts: set[str]) -> bool:
    """Read each byte once job-wide and redistribute over the group (True), or let every rank read
    what it needs (False). ``requested`` None (:attr:`LoadOptions.redistribute` unset): redistribute
    when the storage is remote (fsspec URL) or the ranks span several hosts; on one host with local
    storage the kernel's page cache already reads each stored byte from the device once, and copying
    it between processes over the network stack only adds work (measured in benchmarks/load_bench.py).
    """
    if requested is not None:
        return requested
    return not storage.is_local or len(hosts) > 1


def _needs_signature(need: TargetReads, table: ChunkTable) -> str:
    """Digest of this rank's needs and the layout of the chunks involved (not their checksums), so
    that later checkpoints of the same layout reuse the read plan."""
    items = [(cid, table.chunks[cid][0].file, table.chunks[cid][0].byte_offset, table.chunks[cid][0].byte_length,
              tuple(rs)) for cid, rs in sorted(need.ranges.items())]
    return hashlib.blake2b(repr(items).encode(), digest_size=16).hexdigest()


def _per_rank_states(comm: Comm, storage: Any, path: str, meta: CheckpointMetadata, targets: dict,
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


# -- deprecated (0.1) names, served by ``unickpt.loading`` for one release --------------------------------
DEFAULT_READ_BUFFER_BYTES = 512 << 20  # deprecated: LoadOptions.read_buffer_bytes
DEFAULT_READ_THREADS = 4  # deprecated: LoadOptions.read_threads


def load_checkpoint(comm: Comm, path: str, state: dict, *, strict: bool = True, storage_options: dict | None = None,
                    allow_pickle: bool = False, verify: bool = True, redistribute: bool | None = None) -> LoadStats:
    """Deprecated (0.1): ``Loader(comm).load(...)``. Use :func:`unickpt.load`, or :func:`unickpt.ext.load_solo`
    for this process alone."""
    return Loader(comm).load(path, state, strict=strict, storage_options=storage_options, allow_pickle=allow_pickle,
                             options=LoadOptions(verify=verify, redistribute=redistribute))
