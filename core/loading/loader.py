"""Loading a checkpoint into a caller's state, collectively: the :class:`Loader` of one process group.

Call sequence (every rank of the group, on the caller's thread): read ``metadata.json``; flatten the
target state; check keys, dtypes and shapes and decode every plain value (:mod:`.checks`), so that a
mismatch leaves the state untouched; work out the byte ranges this rank's targets need
(:mod:`.targets`); gather a signature of those needs with any rank's failure (**1 collective**:
``all_gather_object``, 2 gloo ops; a failure is raised on every rank, :mod:`unickpt.dist.failures`);
on a plan-cache miss gather the distinct needs as compact JSON (**2 collectives**) and build the
zero-redundancy read plan (:mod:`unickpt.plan.read_plan`): a target that is its rank's part of an
even split of the group (FSDP2) sends only that rule, and the chunks it reads are planned by the
ranks needing them (:func:`~unickpt.loading.targets.split_needs`), so what travels and what is
planned grows with the distinct needs, not ranks x tensors; run the reads and their redistribution
round by round (:mod:`.exchange`; point-to-point, then **1 collective** for the outcome); finally
replace plain values, restore per-rank state and call ``load_state_dict``.

A ``torch.distributed.checkpoint`` directory is migrated instead (:mod:`.dcp`, opt-in: pickles).
"""
from __future__ import annotations

import bisect
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
from ..geometry import EvenSplit
from ..format.metadata import CheckpointMetadata
from ..options import LoadOptions, check_options
from ..plan.cache import PlanCache
from ..plan.read_plan import Segment, chunk_segments, make_read_plan, segments_of
from ..state import codec
from ..state.flat import flatten, saved_leaves, undone_on_error
from ..storage import open_storage
from . import convert, dcp
from .checks import (check_keys, check_memory, check_param_groups, check_target, drop_states_the_checkpoint_lacks,
                     read_committed, saved_param_groups, take_saved_empty_optimizer_states)
from .exchange import read_and_exchange
from .stats import LoadStats
from .targets import ChunkTable, TargetReads, split_needs

__all__ = ["Loader", "PLAN_CACHE_SIZE", "needs_doc", "plan_reads"]

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
             allow_pickle: bool = False, options: LoadOptions | None = None, mapping: Any = None) -> LoadStats:
        """Load ``path`` into ``state`` in place on this rank (collective). See :func:`unickpt.load`.

        Raises, on every rank, what :func:`unickpt.load` lists, and ValueError / TypeError for options
        that are bad on some rank or that the ranks do not share (``redistribute``), TypeError for a
        ``mapping`` that is not None, ``"auto"`` or a :class:`unickpt.Mapping` on some rank.

        A load that raises leaves an optimizer that had no state without state
        (:func:`~unickpt.state.flat.undone_on_error`); a refusal (keys, dtypes, shapes, plain values)
        comes before any byte lands, so the rest of the state is untouched too."""
        with undone_on_error():
            return self._load(path, state, strict, storage_options, allow_pickle, options, mapping)

    def _load(self, path: str, state: dict, strict: bool, storage_options: dict | None, allow_pickle: bool,
              options: LoadOptions | None, mapping: Any) -> LoadStats:
        opts = LoadOptions()
        try:
            mapping = convert.as_mapping(mapping)
        except TypeError as e:  # raised in the collective part below, with the options' errors
            mapping, bad_mapping = None, e
        else:
            bad_mapping = None
        comm = self.comm
        t0 = time.perf_counter()
        stats = LoadStats()
        storage = open_storage(path, storage_options)
        # a torch.distributed.checkpoint directory (migration)
        if mapping is None and bad_mapping is None and dcp.is_dcp_checkpoint(storage, path):
            return dcp.load_dcp_checkpoint(comm, storage, path, state, strict=strict, allow_pickle=allow_pickle)
        local_error: BaseException | None = None
        signature = None
        try:
            opts = check_options(options if options is not None else LoadOptions(), LoadOptions, "load").validated()
            if bad_mapping is not None:
                raise bad_mapping
        except (TypeError, ValueError) as e:  # a bad argument of the call: raised with its own type on every rank
            local_error, tag = e, "options"
        else:
            tag = None
        try:
            if local_error is not None:
                raise local_error
            if mapping is not None:  # a framework's own handle of a checkpoint (save_dir, pointer file, ...)
                path = convert.locate_checkpoint(path, storage)
            meta = read_committed(storage, path)
            flat = flatten(state, for_load=True)
            table = ChunkTable(meta)
            need = TargetReads(comm.rank, comm.world_size)
            if mapping is not None:
                objects, per_rank, values = self._mapped_needs(meta, flat, mapping, strict, path, table, need, opts,
                                                               stats)
            else:
                objects, per_rank = self._needs(comm, storage, path, meta, flat, strict, allow_pickle, table, need,
                                                opts)
                values = {}
            # format v2: the index records of the split parts this rank needs (it reads only parts it
            # needs), before the agreement so that a damaged index fails every rank alike
            before = storage.bytes_read
            table.resolve(storage, path, need.ranges)
            stats.index_bytes_read = storage.bytes_read - before
            signature = _needs_signature(need, table, opts.verify)
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
            segments = self._read_plan(need, table, [g[0] for g in gathered], opts.verify, stats)
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
            for fqn, value in values.items():
                flat.tensors[fqn].local.copy_(value)
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
            log.debug("unickpt: loaded %s (step %s): %.1f MB into rank 0 (%.1f MB read, %.1f MB received) in %.3f s "
                      "(%.2f GB/s), stall %.3f s, %d rank(s)", path, meta.step, got / 1e6, stats.bytes_read / 1e6,
                      stats.bytes_received / 1e6, stats.total_s, got / 1e9 / max(stats.total_s, 1e-9), stats.total_s,
                      comm.world_size, extra={"unickpt_event": "load", "unickpt_stats": stats})
            if stats.conversion is not None:
                c = stats.conversion
                log.debug("unickpt: %s was written by %s: %d tensors and %s moved through the mapping; left behind "
                          "(that framework's own): %s; kept as they are: %s", path, c["from"], c["tensors"],
                          c["values"] or "no plain values", c["left_behind"] or "nothing", c["kept"] or "nothing")
        return stats

    def _needs(self, comm: Comm, storage: Any, path: str, meta: CheckpointMetadata, flat: Any, strict: bool,
               allow_pickle: bool, table: ChunkTable, need: TargetReads, opts: LoadOptions) -> tuple[dict, dict]:
        """Checks and needs of a load by name: the checkpoint's fqns are the state's. Returns the plain
        values to set ``{fqn: (container, key, value)}`` and this rank's per-rank states."""
        # tensors and per-rank entries from every rank's plan; plain objects are group rank 0's
        _, _, saved_objects = saved_leaves(meta.state_tree)
        saved_tensors = set(meta.tensors) | set(meta.aliases)
        saved_per_rank = set(meta.per_rank.get("fqns", []))
        saved_groups = saved_param_groups(flat, saved_objects)
        check_param_groups(flat, saved_groups, path)
        take_saved_empty_optimizer_states(flat, saved_objects)
        drop_states_the_checkpoint_lacks(flat, saved_groups, saved_tensors, saved_per_rank, saved_objects)
        check_keys(flat, saved_tensors, saved_per_rank, saved_objects, strict, path)
        # Validate and decode everything before the first byte lands in the caller's state, so a
        # mismatch or an unsafe object leaves the state untouched.
        for fqn, leaf in flat.tensors.items():
            if fqn in saved_tensors:
                source = meta.aliases.get(fqn, fqn)
                tmeta = meta.tensors[source]
                check_target(leaf, tmeta)
                need.add(leaf, table, source, opts.verify)
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
        return objects, per_rank

    def _mapped_needs(self, meta: CheckpointMetadata, flat: Any, mapping: Any, strict: bool, path: str,
                      table: ChunkTable, need: TargetReads, opts: LoadOptions, stats: LoadStats
                      ) -> tuple[dict, dict, dict]:
        """Checks and needs of a cross-framework load through ``mapping`` (:mod:`.convert`): every target
        tensor is read from the pieces of stored tensors its view names. Per-rank state and the
        framework's private entries stay as they are (reported in ``stats.conversion``)."""
        view = convert.build_view(meta, flat, mapping, strict=strict, path=path)
        for fqn, pieces in view.tensors.items():
            leaf = flat.tensors[fqn]
            check_memory(leaf)
            need.add_pieces(leaf, [(p.region, p.source, p.offsets) for p in pieces], table, opts.verify)
        objects = {}
        for fqn, value in view.objects.items():
            container, key = flat.objects[fqn]
            if isinstance(container, tuple):
                raise StateMismatchError(f"{fqn!r}: the value to load sits inside a tuple, which cannot be updated "
                                         "in place (use a list)")
            objects[fqn] = (container, key, value)
        stats.conversion = view.report
        stats.conversion_values = view.source_plain
        return objects, {}, view.values

    def _read_plan(self, need: TargetReads, table: ChunkTable, signatures: list[str], verify: bool,
                   stats: LoadStats) -> list[Segment]:
        """This rank's part of the job-wide read plan (the segments it reads or needs, by chunk id):
        from the cache when every rank's needs signature matches a past load (caches are filled
        identically on every rank, so all hit or miss together), else gathered and planned."""
        key = tuple(signatures)
        cached = self.plans.get(key)
        if cached is not None:
            stats.plan_cache_hit = True
            return cached
        # ranks whose needs signature repeats an earlier rank's (replicas, or an FSDP2 layout over the
        # group) send nothing; the others send their listed needs and their split rules as compact JSON
        # (no pickle), so what travels grows with the distinct needs
        me = self.comm.rank
        first_of: dict[str, int] = {}
        firsts = [first_of.setdefault(k, r) for r, k in enumerate(key)]
        mine = needs_doc(need, table, verify) if firsts[me] == me else b""
        blobs = self.comm.all_gather_bytes(mine, self.comm.plan_group)
        plan = plan_reads(me, table, firsts, {r: json.loads(blobs[r]) for r in set(firsts)}, need.ranges)
        self.plans.put(key, plan)
        return plan


def needs_doc(need: TargetReads, table: ChunkTable, verify: bool) -> bytes:
    """What a rank sends to the read plan: its listed needs ``{"n": [[chunk id, ranges]]}``, its
    split targets ``{"s": {stored fqn: [dim, parts]}}`` (their needs are implied) and whether its
    ranges are widened to checksum blocks (``"v"``), as compact JSON."""
    listed = [(cid, rs) for cid, rs in need.ranges.items() if table.locate(cid)[0] not in need.splits]
    return json.dumps({"n": listed, "s": {f: [sp.dim, sp.parts] for f, sp in need.splits.items()}, "v": verify},
                      separators=(",", ":")).encode()


def plan_reads(me: int, table: ChunkTable, firsts: list[int], docs: dict[int, dict], my_ranges: dict) -> list[Segment]:
    """Rank ``me``'s part of the zero-redundancy read plan (the segments it reads or needs, sorted by
    chunk id and start), from every rank's needs: rank ``r``'s are ``docs[firsts[r]]`` (a
    :func:`needs_doc`; ranks sharing a doc are planned as one group). A split every rank with a
    non-empty part declared (:func:`_agreed_splits`) is planned chunk by chunk for the chunks ``me``
    needs (``my_ranges``), O(its chunks x their needers); a split only some ranks declared is listed
    for them (O(ranks) for that tensor). Deterministic: every rank derives consistent parts of one
    plan. Costs O(listed needs of the distinct docs + this rank's chunks of split targets)."""
    splits = _agreed_splits(table, docs, firsts)
    decoded = {f: {int(cid): list(map(tuple, rs)) for cid, rs in doc["n"]} for f, doc in docs.items()}
    per_rank: list[dict] = []
    for r, f in enumerate(firsts):  # listed needs, plus the needs of splits not every rank declared
        extra = [(fqn, sp) for fqn, sp in docs[f]["s"].items() if fqn not in splits]
        if not extra:
            per_rank.append(decoded[f])  # ranks sharing a doc share one dict: planned as one group
            continue
        own = dict(decoded[f])
        for fqn, (dim, parts) in extra:
            split = EvenSplit(int(dim), int(parts))
            for k in _chunks_of(table, fqn, split, r):
                cid = table.base[fqn] + k
                own[cid] = split_needs(table, fqn, cid, split, docs[f]["v"], only=r)[r]
        per_rank.append(own)
    plan = segments_of(me, make_read_plan(per_rank))
    if splits:
        verify = docs[firsts[me]]["v"]  # the same on every rank (or nothing is agreed)
        for cid in sorted(my_ranges):  # the chunks of split targets this rank needs, planned chunk by chunk
            fqn = table.locate(cid)[0]
            split = splits.get(fqn)
            if split is not None:
                plan += segments_of(me, chunk_segments(cid, split_needs(table, fqn, cid, split, verify)))
        plan.sort(key=lambda s: (s.chunk_id, s.start))
    return plan


def _agreed_splits(table: ChunkTable, docs: dict[int, dict], firsts: list[int]) -> dict[str, EvenSplit]:
    """The stored fqns whose targets are their ranks' parts of one split of the group: every rank
    whose part is not empty declared it (the others need nothing of it) and no rank lists needs of
    it. Costs O(docs x their entries)."""
    members: dict[int, list[int]] = {}
    for r, f in enumerate(firsts):
        members.setdefault(f, []).append(r)
    declared: dict[str, list[tuple[EvenSplit, int]]] = {}
    listed: set[str] = set()
    for f, doc in docs.items():
        for fqn, (d, p) in doc["s"].items():
            declared.setdefault(fqn, []).append((EvenSplit(int(d), int(p)), f))
        listed.update(table.locate(int(cid))[0] for cid, _ in doc["n"])
    out: dict[str, EvenSplit] = {}
    if len({bool(doc["v"]) for doc in docs.values()}) > 1:  # ranks widen differently: list every need
        return out
    for fqn, decl in declared.items():
        split = decl[0][0]
        if fqn in listed or split.parts != len(firsts) or any(s != split for s, _ in decl):
            continue
        m = split.nonempty(table.meta.tensors[fqn].shape)
        if sum(bisect.bisect_left(members[f], m) for _, f in decl) == m:
            out[fqn] = split
    return out


def _chunk_count(table: ChunkTable, fqn: str) -> int:
    t = table.meta.tensors[fqn]
    return t.split.parts if t.split is not None else len(t.explicit)


def _chunks_of(table: ChunkTable, fqn: str, split: EvenSplit, rank: int) -> list[int]:
    """Numbers of ``fqn``'s stored chunks that part ``rank`` of ``split`` overlaps."""
    box = split.part(table.meta.tensors[fqn].shape, rank)
    return [] if box is None else sorted({k for k, _, _ in table.index(fqn).overlapping(box)})


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


def _needs_signature(need: TargetReads, table: ChunkTable, verify: bool) -> str:
    """Digest of this rank's needs and the chunks involved (ids and sizes, not their files or
    checksums), so that later checkpoints of the same layout reuse the read plan. A target that is
    its rank's part of a split counts as the rule alone: every rank of an FSDP2 load has one digest."""
    items = [(cid, table.byte_length(cid), tuple(rs)) for cid, rs in sorted(need.ranges.items())
             if table.locate(cid)[0] not in need.splits]
    splits = [(f, _chunk_count(table, f), table.meta.tensors[f].split, s.dim, s.parts)
              for f, s in sorted(need.splits.items())]
    return hashlib.blake2b(repr((items, splits, verify)).encode(), digest_size=16).hexdigest()


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
            raw = storage.read_bytes(storage.join(path, rel))
            try:
                files[r] = json.loads(raw)
            except ValueError as e:  # a truncated or damaged file: never a bare JSONDecodeError
                raise IntegrityError(f"{path!r}: the per-rank state file {rel!r} of rank {r} is damaged or "
                                     f"truncated ({len(raw)} bytes): {e}") from e
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
                f"{fqn!r}: per-rank state was saved by {saved_ws} ranks and is being loaded by {comm.world_size}; "
                f"give {target.how_to_reshard} to say how to redistribute it: "
                "fn(saved_states, rank, world_size) gets every saved rank's state (index = saved rank) and returns "
                "this rank's, e.g. fn = lambda states, rank, world_size: states[rank % len(states)]"
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
