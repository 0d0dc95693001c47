"""Loading a checkpoint into a caller's state, collectively: the :class:`Loader` of one process group.

Call sequence (every rank of the group, on the caller's thread): read ``metadata.json``; flatten the
target state; check keys, dtypes and shapes and decode every plain value (:mod:`.checks`), so that a
mismatch leaves the state untouched; work out the byte ranges this rank's targets need
(:mod:`.targets`); gather a signature of those needs with any rank's failure (**1 collective**:
``all_gather_object``, 2 gloo ops; a failure is raised on every rank, :mod:`unickpt.dist.failures`);
on a plan-cache miss gather the distinct needs as compact JSON (**2 collectives**) and build the
zero-redundancy read plan (:mod:`unickpt.plan.read_plan`, pure): a target that is its rank's part of an
even split of the group (FSDP2) sends only that rule, and the chunks it reads are planned by the
ranks needing them (:func:`~unickpt.plan.needs.split_needs`), so what travels and what is
planned grows with the distinct needs, not ranks x tensors; run the reads and their redistribution
round by round (:mod:`.exchange`; point-to-point, then **1 collective** for the outcome); finally
replace plain values, restore per-rank state and call ``load_state_dict``.

A ``torch.distributed.checkpoint`` directory is migrated instead (:mod:`.from_dcp`, opt-in: pickles).
"""
from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..dist import failures
from ..dist.comm import Comm
from ..errors import IntegrityError, PerRankReshardError, StateMismatchError
from ..format.metadata import CheckpointMetadata
from ..interop.locate import locate_checkpoint
from ..interop.view import as_mapping, build_view
from ..options import LoadOptions, check_options
from ..plan.cache import PlanCache
from ..plan.mapping import Mapping
from ..plan.needs import ChunkTable
from ..plan.read_plan import Segment, needs_doc, needs_signature, plan_reads
from ..requests import LoadRequest
from ..state import codec
from ..state.flat import FlatState, flatten, saved_leaves, undone_on_error
from ..storage import open_storage
from ..storage.base import StorageBackend
from . import from_dcp
from .checks import (check_keys, check_memory, check_param_groups, check_target, drop_states_the_checkpoint_lacks,
                     read_committed, saved_param_groups, take_saved_empty_optimizer_states)
from .exchange import read_and_exchange
from .stats import LoadStats
from .targets import TargetReads, resolve_parts

__all__ = ["Loader", "PLAN_CACHE_SIZE"]

log = logging.getLogger("unickpt")

PLAN_CACHE_SIZE = 4  # read plans remembered per group (distinct targets, e.g. model-only and full loads)


@dataclass(frozen=True)
class _Inputs:
    """What the checks and needs of one load read on this rank (:meth:`Loader._needs`)."""

    comm: Comm
    storage: StorageBackend
    path: str
    meta: CheckpointMetadata
    flat: FlatState
    table: ChunkTable
    need: TargetReads
    request: LoadRequest
    options: LoadOptions  # validated


@dataclass(frozen=True)
class _Needs:
    """What a load found it needs on this rank, before the agreement: the inputs, plain values to set
    ``{fqn: (container, key, value)}``, per-rank states, tensors given whole by a mapping, and the
    needs signature (:func:`~unickpt.plan.read_plan.needs_signature`)."""

    inputs: _Inputs
    objects: dict[str, tuple[Any, Any, Any]]
    per_rank: dict[str, Any]
    values: dict[str, torch.Tensor]
    signature: str


class Loader:
    """Loads for the ranks of ``comm`` (see the module docstring). Keeps the group's read-plan cache.

    Args:
        comm: the group's collectives (:class:`~unickpt.dist.comm.Comm`; ``Comm.solo()``: this process alone).
    """

    def __init__(self, comm: Comm):
        self.comm = comm
        self.plans: PlanCache[list[Segment]] = PlanCache(PLAN_CACHE_SIZE)

    def load(self, request: LoadRequest, state: dict) -> LoadStats:
        """Load ``request.path`` into ``state`` in place on this rank (collective). See :func:`unickpt.load`.

        Raises, on every rank, what :func:`unickpt.load` lists, and ValueError / TypeError for options
        that are bad on some rank or that the ranks do not share (``redistribute``), TypeError for a
        ``mapping`` that is not None, ``"auto"`` or a :class:`unickpt.Mapping` on some rank.

        A load that raises leaves an optimizer that had no state without state
        (:func:`~unickpt.state.flat.undone_on_error`); a refusal (keys, dtypes, shapes, plain values)
        comes before any byte lands, so the rest of the state is untouched too."""
        with undone_on_error():
            t0 = time.perf_counter()
            stats = LoadStats()
            storage = open_storage(request.path, request.storage_options)
            bad_call: BaseException | None = None
            try:
                mapping = as_mapping(request.mapping)
            except TypeError as e:  # raised in the collective part below, with the options' errors
                mapping, bad_call = None, e
            if mapping is None and bad_call is None and from_dcp.is_dcp_checkpoint(storage, request.path):  # migration
                return from_dcp.load_dcp_checkpoint(self.comm, storage, request.path, state, strict=request.strict,
                                               allow_pickle=request.allow_pickle)
            opts, bad_call = _checked_options(request, bad_call)
            needs: _Needs | None = None
            error = bad_call
            if error is None:
                try:
                    needs = self._find_needs(request, storage, state, opts, mapping, stats)
                except Exception as e:  # every rank must still join the gather, or the others hang
                    error = e
            tag = "options" if bad_call is not None else None
            signatures = self._agree(request.path, needs, error, opts, storage, stats, tag)
            assert needs is not None  # a failure on any rank was raised on every rank by the agreement
            segments = self._segments(needs.inputs, signatures, stats)
            stats.plan_s = time.perf_counter() - t0
            self._read(needs.inputs, segments, stats)
            _apply(needs)
            stats.total_s = time.perf_counter() - t0
            if self.comm.rank == 0:
                _log_load(request.path, needs.inputs.meta, stats, self.comm.world_size)
            return stats

    def _find_needs(self, request: LoadRequest, storage: StorageBackend, state: dict, opts: LoadOptions,
                    mapping: Mapping | None, stats: LoadStats) -> _Needs:
        """Read the metadata, flatten and check the target state (nothing lands in it yet) and work out
        this rank's needs and their signature (no collective)."""
        path = request.path
        if mapping is not None:  # a framework's own handle of a checkpoint (save_dir, pointer file, ...)
            path = locate_checkpoint(path, storage)
        meta = read_committed(storage, path)
        comm = self.comm
        inputs = _Inputs(comm, storage, path, meta, flatten(state, for_load=True), ChunkTable(meta),
                         TargetReads(comm.rank, comm.world_size), request, opts)
        if mapping is not None:
            objects, per_rank, values = _mapped_needs(inputs, mapping, stats)
        else:
            (objects, per_rank), values = _needs(inputs), {}
        # format v2: the index records of the split parts this rank needs (it reads only parts it
        # needs), before the agreement so that a damaged index fails every rank alike
        before = storage.bytes_read
        resolve_parts(inputs.table, storage, path, inputs.need.ranges)
        stats.index_bytes_read = storage.bytes_read - before
        return _Needs(inputs, objects, per_rank, values, needs_signature(inputs.need, inputs.table, opts.verify))

    def _agree(self, path: str, needs: _Needs | None, error: BaseException | None, opts: LoadOptions,
               storage: StorageBackend, stats: LoadStats, tag: str | None) -> list[str]:
        """Every rank's needs signature, once no rank failed (**1 collective**; a failure is raised on
        every rank); decides whether to redistribute (``stats.redistributed``). Raises ValueError when
        the ranks asked for different ``redistribute`` settings."""
        signature = None if needs is None else needs.signature
        gathered = failures.gather_load_outcomes(self.comm, path, error, (signature, socket.gethostname(), opts.redistribute), tag)
        asked = {g[2] for g in gathered}
        if len(asked) > 1:  # the read plan is collective: every rank must take part in it, or none
            raise ValueError(f"{path!r}: ranks asked for different redistribute settings "
                             f"({', '.join(f'rank {r}: {g[2]}' for r, g in enumerate(gathered))}); pass the same "
                             "LoadOptions(redistribute=...) on every rank")
        stats.redistributed = _should_redistribute(opts.redistribute, storage, {g[1] for g in gathered})
        return [g[0] for g in gathered]

    def _segments(self, inputs: _Inputs, signatures: list[str], stats: LoadStats) -> list[Segment]:
        """This rank's segments: its part of the job-wide read plan when redistributing, else its own
        needs, each read by itself (segments keep the same shape, with only this rank in them)."""
        need, me = inputs.need, self.comm.rank
        if stats.redistributed:
            return self._read_plan(need, inputs.table, signatures, inputs.options.verify, stats)
        own = ((cid, s, n) for cid, rs in sorted(need.ranges.items()) for s, n in rs)
        return [Segment(i, cid, s, n, me, (me,)) for i, (cid, s, n) in enumerate(own)]

    def _read(self, inputs: _Inputs, segments: list[Segment], stats: LoadStats) -> None:
        """Run the reads and the redistribution (:mod:`.exchange`), then check that every target
        element was filled (IntegrityError otherwise)."""
        t_read = time.perf_counter()
        need, storage = inputs.need, inputs.storage
        filled = read_and_exchange(self.comm, storage, inputs.path, inputs.table, need, segments, inputs.options,
                                   stats)
        stats.read_s = time.perf_counter() - t_read - stats.copy_s
        stats.storage_bytes_read = storage.bytes_read  # tensor bytes plus metadata and per-rank files
        for fqn, want in need.expected.items():
            if filled.get(fqn, 0) != want:
                raise IntegrityError(f"{fqn!r}: stored chunks cover {filled.get(fqn, 0)} of the {want} elements "
                                     "this rank needs")

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


def _checked_options(request: LoadRequest, bad_mapping: BaseException | None
                     ) -> tuple[LoadOptions, BaseException | None]:
    """The validated options of ``request`` and the error of a bad call argument (the options' first,
    else ``bad_mapping``), raised in the collective part with its own type on every rank."""
    try:
        return check_options(request.options, LoadOptions, "load").validated(), bad_mapping
    except (TypeError, ValueError) as e:
        return LoadOptions(), e


def _needs(inputs: _Inputs) -> tuple[dict, dict]:
    """Checks and needs of a load by name: the checkpoint's fqns are the state's. Returns the plain
    values to set ``{fqn: (container, key, value)}`` and this rank's per-rank states."""
    meta, flat, path, allow_pickle = inputs.meta, inputs.flat, inputs.path, inputs.request.allow_pickle
    # tensors and per-rank entries from every rank's plan; plain objects are group rank 0's
    _, _, saved_objects = saved_leaves(meta.state_tree)
    saved_tensors = set(meta.tensors) | set(meta.aliases)
    saved_per_rank = set(meta.per_rank.get("fqns", []))
    saved_groups = saved_param_groups(flat, saved_objects)
    check_param_groups(flat, saved_groups, path)
    take_saved_empty_optimizer_states(flat, saved_objects)
    drop_states_the_checkpoint_lacks(flat, saved_groups, saved_tensors, saved_per_rank, saved_objects)
    check_keys(flat, saved_tensors, saved_per_rank, saved_objects, inputs.request.strict, path)
    # Validate and decode everything before the first byte lands in the caller's state, so a
    # mismatch or an unsafe object leaves the state untouched.
    for fqn, leaf in flat.tensors.items():
        if fqn in saved_tensors:
            source = meta.aliases.get(fqn, fqn)
            check_target(leaf, meta.tensors[source])
            inputs.need.add(leaf, inputs.table, source, inputs.options.verify)
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
    per_rank = _per_rank_states(inputs.comm, inputs.storage, path, meta, flat.per_rank, saved_per_rank, allow_pickle)
    return objects, per_rank


def _mapped_needs(inputs: _Inputs, mapping: Mapping, stats: LoadStats) -> tuple[dict, dict, dict]:
    """Checks and needs of a cross-framework load through ``mapping`` (:mod:`unickpt.interop.view`): every target
    tensor is read from the pieces of stored tensors its view names. Per-rank state and the
    framework's private entries stay as they are (reported in ``stats.conversion``)."""
    flat = inputs.flat
    view = build_view(inputs.meta, flat, mapping, strict=inputs.request.strict, path=inputs.path)
    for fqn, pieces in view.tensors.items():
        leaf = flat.tensors[fqn]
        check_memory(leaf)
        inputs.need.add_pieces(leaf, [(p.region, p.source, p.offsets) for p in pieces], inputs.table,
                               inputs.options.verify)
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


def _apply(needs: _Needs) -> None:
    """Once every byte has landed: copy staged targets back, set plain values, restore per-rank
    states and call the appliers (``load_state_dict`` of modules, optimizers, stateful objects)."""
    flat = needs.inputs.flat
    with torch.no_grad():
        for staging, target in needs.inputs.need.fixups:
            target.copy_(staging)
        for fqn, value in needs.values.items():
            flat.tensors[fqn].local.copy_(value)
    for container, key, value in needs.objects.values():
        if not isinstance(container, tuple):
            container[key] = value
    for fqn, value in needs.per_rank.items():
        flat.per_rank[fqn].load_state_dict(value)
    for apply in flat.appliers:
        apply()


def _log_load(path: str, meta: CheckpointMetadata, stats: LoadStats, world_size: int) -> None:
    """Group rank 0's debug record of a finished load (with the stats attached for log handlers)."""
    got = stats.bytes_read + stats.bytes_received
    log.debug("unickpt: loaded %s (step %s): %.1f MB into rank 0 (%.1f MB read, %.1f MB received) in %.3f s "
              "(%.2f GB/s), stall %.3f s, %d rank(s)", path, meta.step, got / 1e6, stats.bytes_read / 1e6,
              stats.bytes_received / 1e6, stats.total_s, got / 1e9 / max(stats.total_s, 1e-9), stats.total_s,
              world_size, extra={"unickpt_event": "load", "unickpt_stats": stats})
    if stats.conversion is not None:
        c = stats.conversion
        log.debug("unickpt: %s was written by %s: %d tensors and %s moved through the mapping; left behind "
                  "(that framework's own): %s; kept as they are: %s", path, c["from"], c["tensors"],
                  c["values"] or "no plain values", c["left_behind"] or "nothing", c["kept"] or "nothing")


def _should_redistribute(requested: bool | None, storage: StorageBackend, hosts: set[str]) -> bool:
    """Read each byte once job-wide and redistribute over the group (True), or let every rank read
    what it needs (False). ``requested`` None (:attr:`LoadOptions.redistribute` unset): redistribute
    when the storage is remote (fsspec URL) or the ranks span several hosts; on one host with local
    storage the kernel's page cache already reads each stored byte from the device once, and copying
    it between processes over the network stack only adds work (measured in benchmarks/load_bench.py).
    """
    if requested is not None:
        return requested
    return not storage.is_local or len(hosts) > 1


def _per_rank_states(comm: Comm, storage: StorageBackend, path: str, meta: CheckpointMetadata, targets: dict,
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
