"""Planner simulation: the real save and load planners for simulated jobs of 8 to 10,000 ranks, in one
process, without tensor data.

Each simulated rank is described by the :class:`unickpt.plan.save_plan.LocalPlan` its engine would
build (``fqn -> (dtype, global shape, spec)``, what :func:`~unickpt.plan.save_plan.make_local_plan`
derives from a flattened state: a box or flat range, or, for a shard that is exactly the rank's part
of an even split of the group as FSDP2 holds it, that :class:`~unickpt.geometry.EvenSplit`); only
shapes and offsets exist, no tensor is allocated. Then the code the engine runs is called as it is:

* save: the ranks first with their plan signature encode their plans, every rank decodes them
  (:func:`~unickpt.plan.save_plan.decode_plans`) and runs :func:`~unickpt.plan.save_plan.make_save_plan`
  (global plan: splits recognised, dedup of replicas, coverage check, writer balancing); rank 0's own
  files and offsets (``plan.writes[0]``) and index file (format v2); the metadata the commit writes
  (:func:`unickpt.saving.commit.build_metadata`, with synthetic checksums of the real count and
  length), its JSON size and its parse time (:meth:`CheckpointMetadata.from_json`);
* resharding load: every target rank's needs as the loader computes them
  (:func:`unickpt.plan.needs.spec_needs`), what it sends (:func:`unickpt.plan.read_plan.needs_doc`)
  and its part of the zero-redundancy read plan (:func:`unickpt.plan.read_plan.plan_reads`), for a
  sample of ranks (first, second, middle, last).

Models: Llama-2-7B, Llama-3-70B, Llama-3.1-405B shapes (layers, hidden, ffn, vocab, kv heads from
the published configs), bf16 parameters plus AdamW's two fp32 moments. Layouts:

* ``fsdp``: FSDP2 dim-0 sharding over all ranks (``torch.chunk`` semantics: ``ceil(rows / world)``
  rows per rank, trailing ranks empty);
* ``fsdp-flat``: FSDP1 / ZeRO-3 flat parameters, one per transformer block, split evenly
  (flat ranges, cut inside rows);
* ``hsdp``: dim-0 sharding inside groups of ``--shard-group`` ranks (default 8), replicated across
  groups;
* ``3d``: Megatron-style TP x PP x DP (TP 8; q/k/v/gate/up and the vocab dims split along dim 0,
  o/down along dim 1, norms replicated over TP; PP stages hold contiguous layers, the embedding on
  the first, final norm and output head on the last; parameters replicated over DP, optimizer
  moments split along dim 0 of each TP shard over DP, i.e. ZeRO-1).

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_sim.py            # the table (~30 min here)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_sim.py --quick    # 8..512 ranks
    .venv/bin/python benchmarks/plan_sim.py --model 405b --layout fsdp --world 2048 [--target 1536] [--profile]

Output: ``benchmarks/results/plan_sim.json`` (one record per case) and ``plan_sim.md`` (tables and
fitted growth exponents: the slope of log(seconds) against log(ranks x chunks per rank)).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import platform
import pstats
import time
from dataclasses import dataclass

from unickpt.format.dtypes import str_to_dtype
from unickpt.format.index import HEADER, RECORD, IndexRecord, encode_index
from unickpt.format.integrity import CHECKSUM_BLOCK_BYTES, block_size
from unickpt.format.metadata import CheckpointMetadata
from unickpt.saving.commit import build_metadata
from unickpt.plan.save_plan import LocalPlan, decode_plans, make_save_plan
from unickpt.loading.targets import TargetReads
from unickpt.plan.needs import ChunkTable, spec_needs
from unickpt.plan.read_plan import needs_doc, plan_reads
from unickpt.geometry import Box, EvenSplit, FlatRange

HERE = os.path.dirname(os.path.abspath(__file__))
_clock = time.process_time
"""Seconds are this process's CPU time: the machine is shared, and CPU time does not count the time
other processes hold the cores (single-threaded code: CPU time ~ wall time on an idle machine)."""


# --------------------------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------------------------- #
@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: ``layers`` blocks of width ``hidden``, SwiGLU MLP of width ``ffn``,
    ``kv_heads`` key/value heads of ``hidden / heads`` dims, untied ``vocab`` x ``hidden`` embedding
    and output head."""

    name: str
    layers: int
    hidden: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int


MODELS = {  # from the published Hugging Face configs
    "7b": ModelConfig("Llama-2-7B", 32, 4096, 11008, 32000, 32, 32),
    "70b": ModelConfig("Llama-3-70B", 80, 8192, 28672, 128256, 64, 8),
    "405b": ModelConfig("Llama-3.1-405B", 126, 16384, 53248, 128256, 128, 8),
    "tiny": ModelConfig("tiny (tests)", 4, 256, 688, 1000, 8, 4),  # Llama-shaped, for fast exact checks
}

COL, ROW, REP = "col", "row", "rep"  # TP split: along dim 0 (output features), dim 1 (input), replicated


def block_params(cfg: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """``(fqn, shape, TP split)`` of transformer block ``i``, in module order."""
    h, kv = cfg.hidden, cfg.kv_heads * (cfg.hidden // cfg.heads)
    p = f"model.layers.{i}."
    return [(p + "input_layernorm.weight", (h,), REP),
            (p + "self_attn.q_proj.weight", (h, h), COL), (p + "self_attn.k_proj.weight", (kv, h), COL),
            (p + "self_attn.v_proj.weight", (kv, h), COL), (p + "self_attn.o_proj.weight", (h, h), ROW),
            (p + "post_attention_layernorm.weight", (h,), REP),
            (p + "mlp.gate_proj.weight", (cfg.ffn, h), COL), (p + "mlp.up_proj.weight", (cfg.ffn, h), COL),
            (p + "mlp.down_proj.weight", (h, cfg.ffn), ROW)]


def model_params(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str, int]]:
    """``(fqn, shape, TP split, unit)`` of every parameter; ``unit`` is the block index (-1: embedding,
    ``layers``: final norm and output head), the FSDP wrapping unit and the PP placement key."""
    out = [("model.embed_tokens.weight", (cfg.vocab, cfg.hidden), COL, -1)]
    for i in range(cfg.layers):
        out += [(f, s, t, i) for f, s, t in block_params(cfg, i)]
    out += [("model.norm.weight", (cfg.hidden,), REP, cfg.layers), ("lm_head.weight", (cfg.vocab, cfg.hidden), COL, cfg.layers)]
    return out


def param_count(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for _, s, _, _ in model_params(cfg))


STATES = (("", "bfloat16"), ("optim.exp_avg.", "float32"), ("optim.exp_avg_sq.", "float32"))


# --------------------------------------------------------------------------------------------- #
# Layouts: the LocalPlan of every rank
# --------------------------------------------------------------------------------------------- #
def _dim0(rows: int, parts: int, i: int, shape: tuple[int, ...], base: tuple[int, ...] | None = None) -> Box | None:
    """Part ``i`` of ``parts`` of a box of ``shape`` (at ``base``) split along dim 0 as torch.chunk
    does (``ceil(rows / parts)`` rows each, trailing parts empty); None when empty."""
    per = -(-rows // parts)
    lo, hi = min(i * per, rows), min((i + 1) * per, rows)
    if hi <= lo:
        return None
    base = base or (0,) * len(shape)
    return Box((base[0] + lo,) + base[1:], (hi - lo,) + tuple(shape[1:]))


def _plan(rank: int, tensors: dict) -> LocalPlan:
    return LocalPlan(rank=rank, tensors=tensors)


def as_local(tensors: dict, rank: int, world: int) -> dict:
    """What :func:`unickpt.plan.save_plan.make_local_plan` records for these shards on ``rank`` of
    ``world``: a shard that is exactly the rank's part of an even split of the group becomes that
    :class:`EvenSplit` (format v2)."""
    return {fqn: (d, shape, EvenSplit.detect(shape, spec, rank, world) or spec) for fqn, (d, shape, spec) in tensors.items()}


def fsdp_boxes(cfg: ModelConfig, world: int, rank: int, optim: bool = True) -> dict:
    """Rank ``rank``'s shards under FSDP2 over ``world`` ranks (boxes, as the state holds them)."""
    t = {}
    for fqn, shape, _, _ in model_params(cfg):
        box = _dim0(shape[0], world, rank, shape)
        for prefix, dtype in (STATES if optim else STATES[:1]):
            t[prefix + fqn] = (dtype, shape, box)
    return t


SAMPLE = lambda world: sorted({0, 1, world // 2, world - 1} & set(range(world)))  # noqa: E731


def fsdp_plans(cfg: ModelConfig, world: int, optim: bool = True) -> list[LocalPlan]:
    """FSDP2 (``fully_shard``): every parameter and moment split along dim 0 over all ranks. A rank's
    local plan records each non-empty shard as its part of ``EvenSplit(0, world)`` and the rest as
    empty, so ranks whose parts are empty for the same tensors have equal plans (the engine's
    signature exchange finds them equal and gathers one): the ranks between two consecutive
    "first empty part" thresholds share one plan, built for the first and checked on the last."""
    edges = sorted({0, world} | {min(world, -(-shape[0] // -(-shape[0] // world))) for _, shape, _, _ in model_params(cfg)})
    plans: list[LocalPlan] = []
    for lo, hi in zip(edges, edges[1:]):
        shared = as_local(fsdp_boxes(cfg, world, lo, optim), lo, world)
        assert as_local(fsdp_boxes(cfg, world, hi - 1, optim), hi - 1, world) == shared
        plans += [_plan(r, shared) for r in range(lo, hi)]
    return plans


def fsdp_flat_plans(cfg: ModelConfig, world: int, optim: bool = True) -> list[LocalPlan]:
    """FSDP1 / ZeRO-3: each unit's parameters concatenated (module order), padded to a multiple of
    ``world`` and split evenly; a rank's shard of each tensor is a flat range."""
    units: dict[int, list] = {}
    for fqn, shape, _, unit in model_params(cfg):
        units.setdefault(unit, []).append((fqn, shape))
    states = STATES if optim else STATES[:1]
    tensors: list[dict] = [{} for _ in range(world)]
    for members in units.values():
        total = sum(math.prod(s) for _, s in members)
        per = -(-total // world)
        pos = 0
        for fqn, shape in members:
            n = math.prod(shape)
            first, last = pos // per, min(world - 1, (pos + n - 1) // per)
            for r in range(world):
                lo, hi = max(pos, r * per), min(pos + n, (r + 1) * per)
                spec = FlatRange(lo - pos, hi - lo) if first <= r <= last and hi > lo else None
                for prefix, dtype in states:
                    tensors[r][prefix + fqn] = (dtype, shape, spec)
            pos += n
    return [_plan(r, t) for r, t in enumerate(tensors)]


def hsdp_plans(cfg: ModelConfig, world: int, shard_group: int = 8, optim: bool = True) -> list[LocalPlan]:
    """HSDP: FSDP2 sharding inside groups of ``shard_group`` consecutive ranks, replicas across
    groups (replicas hold identical boxes and share one plan object here, as their identical
    signatures let the engine gather it once)."""
    if world % shard_group:
        raise ValueError(f"world {world} is not a multiple of the shard group {shard_group}")
    group = [fsdp_boxes(cfg, shard_group, i, optim) for i in range(shard_group)]
    for r in SAMPLE(world):  # no shard is its rank's part of a split of the whole group: boxes stay
        assert as_local(group[r % shard_group], r, world) == group[r % shard_group] or world == shard_group
    if world == shard_group:  # FSDP2 over all ranks
        group = [as_local(t, i, world) for i, t in enumerate(group)]
    return [LocalPlan(rank=r, tensors=group[r % shard_group]) for r in range(world)]


def pp_stage(unit: int, layers: int, pp: int) -> int:
    """The pipeline stage holding ``unit`` (blocks split as evenly as possible, embedding on the
    first stage, final norm and head on the last)."""
    if unit < 0:
        return 0
    if unit >= layers:
        return pp - 1
    return unit * pp // layers


def grid(world: int, tp: int = 8) -> tuple[int, int, int]:
    """``(tp, pp, dp)`` for ``world`` ranks: ``tp`` (at most the world), then the largest pipeline
    depth <= 16 that divides what remains, data parallel for the rest."""
    tp = min(tp, world)
    rest = world // tp
    if rest * tp != world:
        raise ValueError(f"world {world} is not a multiple of tp {tp}")
    pp = max(d for d in range(1, 17) if rest % d == 0)
    return tp, pp, rest // pp


def plans_3d(cfg: ModelConfig, world: int, tp: int = 8, optim: bool = True) -> list[LocalPlan]:
    """Megatron-style TP x PP x DP (rank = (pp_idx * dp + dp_idx) * tp + tp_idx). A rank's state holds
    its stage's tensors only. Parameters: TP-split, replicated over DP. AdamW moments: the
    distributed optimizer (ZeRO-1): per (PP, TP) group the stage's TP shards, concatenated in module
    order, are split evenly over DP, each cut rounded up to a whole row of the tensor it falls in
    (so that every piece is a box); a rank's piece of a tensor is a box of whole rows of its TP shard,
    and most tensors lie within one or two ranks' pieces."""
    tp, pp, dp = grid(world, tp)
    params = model_params(cfg)
    plans = []
    for pp_i in range(pp):
        stage = [(fqn, shape, split) for fqn, shape, split, unit in params if pp_stage(unit, cfg.layers, pp) == pp_i]
        for tp_i in range(tp):
            boxes = [(fqn, shape, _tp_box(shape, split, tp, tp_i)) for fqn, shape, split in stage]
            base = {fqn: ("bfloat16", shape, box) for fqn, shape, box in boxes}
            per_dp: list[dict] = [dict(base) for _ in range(dp)] if optim else [base] * dp
            if optim:
                total = sum(box.numel for _, _, box in boxes)
                per = -(-total // dp)
                pos = 0
                for fqn, shape, box in boxes:
                    row = box.numel // box.lengths[0]
                    for d in range(dp):
                        lo = min(box.lengths[0], max(0, -(-(d * per - pos) // row)))
                        hi = min(box.lengths[0], max(0, -(-((d + 1) * per - pos) // row)))
                        part = (Box((box.offsets[0] + lo,) + box.offsets[1:], (hi - lo,) + box.lengths[1:])
                                if hi > lo else None)
                        for prefix, dtype in STATES[1:]:
                            per_dp[d][prefix + fqn] = (dtype, shape, part)
                    pos += box.numel
            for dp_i in range(dp):
                plans.append(_plan((pp_i * dp + dp_i) * tp + tp_i, per_dp[dp_i]))
    plans.sort(key=lambda p: p.rank)
    # what make_local_plan records: the boxes, except that a rank holding nothing of a tensor whose part
    # of an even split of the group would be empty too records that split (FSDP2's trailing ranks do)
    return [_plan(p.rank, as_local(p.tensors, p.rank, world)) for p in plans]


def _tp_box(shape: tuple[int, ...], split: str, tp: int, i: int) -> Box:
    if split == REP:
        return Box((0,) * len(shape), shape)
    dim = 0 if split == COL else 1
    per = shape[dim] // tp
    offsets = [0] * len(shape)
    lengths = list(shape)
    offsets[dim], lengths[dim] = i * per, per
    return Box(tuple(offsets), tuple(lengths))


LAYOUTS = {
    "fsdp": fsdp_plans,
    "fsdp-flat": fsdp_flat_plans,
    "hsdp": hsdp_plans,
    "3d": plans_3d,
}


def make_plans(model: str, layout: str, world: int, optim: bool = True) -> list[LocalPlan]:
    """The LocalPlan of every rank of a simulated job."""
    return LAYOUTS[layout](MODELS[model], world, optim=optim)


# --------------------------------------------------------------------------------------------- #
# Measurements
# --------------------------------------------------------------------------------------------- #
def _digest(i: int) -> str:
    return f"xxh3_64:{i & 0xFFFFFFFFFFFFFFFF:016x}"


_BLOCKS: dict[int, tuple] = {}  # one tuple per block count (the JSON text is what is measured)


def _synthetic(nbytes: int, i: int) -> tuple[str, tuple[str, ...], int]:
    """A checksum, block checksums and block size of the lengths the save pipeline produces (one
    xxh3-64 per chunk, one per block for chunks > 1 MiB)."""
    if nbytes <= CHECKSUM_BLOCK_BYTES:
        return _digest(i), (), 0
    b = block_size(nbytes)
    n = -(-nbytes // b)
    if n not in _BLOCKS:
        _BLOCKS[n] = tuple(_digest(k) for k in range(n))
    return _digest(i), _BLOCKS[n], b


def _split_parts(plan) -> list[tuple[int, int]]:
    """``(part bytes, count)`` of every split tensor's non-empty parts (full parts and the last)."""
    out = []
    for fqn, (split, _) in plan.splits.items():
        dtype, shape = plan.tensors[fqn]
        m = split.nonempty(shape)
        row = math.prod(shape) // shape[split.dim] * str_to_dtype(dtype).itemsize
        step = split.step(shape)
        out += [(step * row, m - 1), ((shape[split.dim] - (m - 1) * step) * row, 1)]
    return [(n, c) for n, c in out if c and n]


def measure_save(plans: list[LocalPlan], *, parse: bool = True) -> tuple[dict, CheckpointMetadata]:
    """Plan a save as the engine does on a plan-cache miss: the ranks that are first with their
    signature encode their plans (:meth:`LocalPlan.to_bytes`, without the tensor table when an earlier
    rank has the same), every rank decodes the gathered bytes, expands them and runs
    :func:`make_save_plan`; then rank 0's layout of its own files (what a rank executes), its index
    file (format v2, with synthetic checksums), the commit's metadata (with synthetic checksums of the
    real count and length, from every rank's explicit chunks), serialized and parsed."""
    world = len(plans)
    firsts = _firsts(plans)
    digests: dict[int, str] = {}  # each rank computes its own table digest (in parallel, at every save)
    table_of: dict[str, int] = {}
    table_firsts = [table_of.setdefault(digests.setdefault(id(p.tensors), p.table_digest()) if id(p.tensors) not in
                                        digests else digests[id(p.tensors)], r) for r, p in enumerate(plans)]
    t0 = _clock()
    blobs = [p.to_bytes(with_table=table_firsts[r] == r) if firsts[r] == r else b"" for r, p in enumerate(plans)]
    encode_s = _clock() - t0
    gc.collect()
    t0 = _clock()
    gathered = decode_plans(blobs, firsts, table_firsts)
    decode_s = _clock() - t0
    t0 = _clock()
    plan = make_save_plan(gathered)
    plan_s = _clock() - t0
    del gathered
    t0 = _clock()
    mine = plan.writes[0]  # what rank 0 stages and writes (every rank lays out its own, in parallel)
    rank_layout_s = _clock() - t0
    t0 = _clock()
    index = encode_index(0, len(plan.splits), {c.slot: IndexRecord(c.segment, c.offset, c.nbytes, *_synthetic(c.nbytes, i))
                                                for i, c in enumerate(mine) if c.slot >= 0}) if plan.splits else b""
    index_s = _clock() - t0
    results = []
    explicit_chunks = explicit_blocks = 0
    for r in range(world):
        ex = plan.explicit[r]
        ds = [_synthetic(n, r * 1_000_003 + i) for i, (_, _, n) in enumerate(ex)]
        results.append({"digests": ds, "places": [(0, 0)] * len(ex), "per_rank_file": None})
        explicit_chunks += len(ex)
        explicit_blocks += sum(len(d[1]) for d in ds)
    t0 = _clock()
    meta = build_metadata(plan, results, world_size=world, skeleton={"t": "dict"}, step=0, run_id="sim")
    text = meta.to_json().encode()
    build_s = _clock() - t0
    del meta, results
    parsed, parse_s = None, None
    if parse:
        gc.collect()
        t0 = _clock()
        parsed = CheckpointMetadata.from_json(text)
        parse_s = _clock() - t0
    parts = _split_parts(plan)
    split_chunks = sum(c for _, c in parts)
    split_blocks = sum(c * (-(-n // block_size(n)) if n > CHECKSUM_BLOCK_BYTES else 0) for n, c in parts)
    index_total = (world * (HEADER.size + RECORD.size * len(plan.splits)) + 8 * split_blocks) if plan.splits else 0
    rec = {
        "world": world, "plan_entries": sum(len(p.tensors) for p in plans), "distinct_plans": sum(
            1 for r, f in enumerate(firsts) if r == f), "gathered_bytes": sum(len(b) for b in blobs),
        "chunks": explicit_chunks + split_chunks, "explicit_chunks": explicit_chunks,
        "split_tensors": len(plan.splits), "tensors": len(plan.tensors),
        "encode_all_s": round(encode_s, 3), "decode_s": round(decode_s, 3), "plan_s": round(plan_s, 3),
        "planning_s": round(decode_s + plan_s, 3), "rank_layout_s": round(rank_layout_s, 4),
        "index_encode_s": round(index_s, 4), "metadata_build_s": round(build_s, 3),
        "metadata_bytes": len(text), "metadata_bytes_per_chunk": round(len(text) / max(1, explicit_chunks + split_chunks), 1),
        "metadata_parse_s": None if parse_s is None else round(parse_s, 3),
        "block_checksums": explicit_blocks, "block_checksum_bytes": explicit_blocks * len('"xxh3_64:0123456789abcdef",'),
        "index_bytes_rank0": len(index), "index_bytes_total": index_total,
        "max_mean_bytes": round(plan.max_mean_bytes, 4), "bytes": sum(plan.bytes_per_rank),
    }
    return rec, parsed


def _firsts(plans: list[LocalPlan]) -> list[int]:
    """For each rank, the first rank whose plan has the same content: what the engine's signature
    exchange finds (ranks sharing one tensors dict are equal; distinct dicts are compared by their
    :meth:`LocalPlan.signature`, one per distinct dict)."""
    by_id: dict[int, int] = {}
    by_sig: dict[str, int] = {}
    out = []
    for r, p in enumerate(plans):
        f = by_id.get(id(p.tensors))
        if f is None:
            f = by_id[id(p.tensors)] = by_sig.setdefault(p.signature(), r)
        out.append(f)
    return out


def measure_load(meta: CheckpointMetadata, targets: list[LocalPlan], *, verify: bool = True,
                 all_ranks: bool = False) -> dict:
    """Resharding load of ``meta`` into ``targets``, with the loader's own functions: each rank's
    needs (:func:`unickpt.plan.needs.spec_needs`, what ``TargetReads.add`` records; ranks with
    identical plans compute identical needs, computed once) and what it sends to the read plan
    (:func:`~unickpt.plan.read_plan.needs_doc`); ranks whose docs are equal send one (the engine
    compares needs signatures). Then :func:`~unickpt.plan.read_plan.plan_reads`, the rank's part of
    the read plan, for a sample of ranks (first, second, middle, last: the job-wide part is the same
    on every rank, the chunk-by-chunk part of split targets is the rank's own): ``read_plan_s`` is
    the slowest. ``all_ranks``: every rank's part, and ``bytes_read``, the bytes all readers read
    (each stored byte once: the zero-redundancy check of the tests)."""
    t0 = _clock()
    table = ChunkTable(meta)
    index_s = _clock() - t0
    world = len(targets)
    need_s: list[float] = []
    cache: dict[int, tuple] = {}
    docs_by_text: dict[bytes, int] = {}
    firsts, docs, ranges_of = [], {}, {}
    sample = set(range(world)) if all_ranks else set(SAMPLE(world))
    entries = 0
    for r, p in enumerate(targets):
        got = cache.get(id(p.tensors))
        if got is None or r in sample:
            t0 = _clock()
            need = TargetReads(r, world)
            for fqn, (_, shape, spec) in p.tensors.items():
                if isinstance(spec, EvenSplit):  # the local plan's form of the rank's box: the box itself
                    spec = spec.part(shape, r)
                ranges, split = spec_needs(table, fqn, spec, r, world, verify)
                if split is not None:
                    need.splits[fqn] = split
                need.ranges.update(ranges)
            doc = needs_doc(need, table, verify)
            need_s.append(_clock() - t0)
            got = cache[id(p.tensors)] = (doc, need.ranges)
        doc, ranges = got
        f = docs_by_text.setdefault(doc, r)
        if f == r:
            docs[r] = json.loads(doc)
        firsts.append(f)
        entries += len(ranges)  # a rank outside the sample needs as many chunks as its plan's first rank
        if r in sample:
            ranges_of[r] = ranges
    plan_s, segments, bytes_read = [], 0, 0
    for r in sorted(sample):
        if not all_ranks:
            gc.collect()
        t0 = _clock()
        mine = plan_reads(r, table, firsts, docs, ranges_of[r])
        plan_s.append(_clock() - t0)
        segments = max(segments, len(mine))
        bytes_read += sum(s.length for s in mine if s.reader == r)
    rec = {"target_world": world, "need_entries": entries, "distinct_needs": len(docs),
           "listed_need_entries": sum(len(d["n"]) for d in docs.values()),
           "split_targets": len(docs[0]["s"]) if 0 in docs else 0, "segments_per_rank_max": segments,
           "index_s": round(index_s, 3), "needs_per_rank_max_s": round(max(need_s), 4),
           "read_plan_s": round(max(plan_s), 3)}
    if all_ranks:
        rec["bytes_read"] = bytes_read
    return rec


# --------------------------------------------------------------------------------------------- #
# The table
# --------------------------------------------------------------------------------------------- #
WORLDS = (8, 64, 512, 4096, 10000)
FSDP_WORLDS = (8, 64, 512, 2048, 4096, 10000)
LOAD_TARGET = {8: 16, 64: 48, 512: 384, 2048: 1536, 4096: 3072, 10000: 7680}  # resharding loads: ~3/4 of the ranks
QUICK_WORLDS = (8, 64, 512)


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) against log(x) (the growth exponent: 1.0 is linear), over the
    points with x >= 64 ranks' worth and y >= 10 ms (smaller ones are dominated by constant costs)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y >= 0.01]
    if len(pts) < 2:
        return None
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / den, 2) if den else None


def run_case(model: str, layout: str, world: int, target: int | None, optim: bool = True) -> dict:
    """One simulated job: its save (planning, metadata) and, with ``target``, a resharding load of
    the same layout family at ``target`` ranks. ``optim``: AdamW moments too (else parameters only)."""
    t0 = _clock()
    plans = make_plans(model, layout, world, optim)
    gen_s = _clock() - t0
    rec, meta = measure_save(plans)
    del plans
    rec.update(model=model, layout=layout, state="params+adam" if optim else "params", generate_s=round(gen_s, 2),
               load=None)
    if target:
        targets = make_plans(model, layout, target, optim)
        rec["load"] = measure_load(meta, targets)
        del targets
    del meta
    gc.collect()
    return rec


def _growth(records: list[dict]) -> dict:
    out = {}
    for key in sorted({(r["model"], r["layout"], r["state"]) for r in records}):
        rs = sorted((r for r in records if (r["model"], r["layout"], r["state"]) == key), key=lambda r: r["world"])
        if len(rs) < 3:
            continue
        ent = [r["plan_entries"] for r in rs]
        loads = [r for r in rs if r["load"]]
        out[f"{key[0]}/{key[1]}/{key[2]}"] = {
            "planning_s_vs_entries": fit_exponent(ent, [r["planning_s"] for r in rs]),
            "planning_s_vs_world": fit_exponent([r["world"] for r in rs], [r["planning_s"] for r in rs]),
            "metadata_bytes_vs_chunks": fit_exponent([r["chunks"] for r in rs], [r["metadata_bytes"] for r in rs]),
            "metadata_bytes_vs_world": fit_exponent([r["world"] for r in rs], [r["metadata_bytes"] for r in rs]),
            "index_bytes_vs_world": fit_exponent([r["world"] for r in rs], [r["index_bytes_total"] for r in rs]),
            "read_plan_s_vs_world": fit_exponent([r["load"]["target_world"] for r in loads],
                                                 [r["load"]["read_plan_s"] for r in loads]),
            "read_plan_s_vs_need_entries": fit_exponent([r["load"]["need_entries"] for r in loads],
                                                        [r["load"]["read_plan_s"] for r in loads]),
        }
    return out


def markdown(records: list[dict], growth: dict, machine: dict) -> str:
    lines = ["# Planner simulation (benchmarks/plan_sim.py)", "",
             f"Machine: {machine['cpus']} CPUs, load average {machine['load_avg']} at the start, "
             f"{machine['load_avg_end']} at the end (shared with other jobs: seconds are upper bounds). "
             "Planning = decode of the gathered compact plans + make_save_plan, as every rank runs it on a "
             "plan-cache miss. Chunks = stored chunks (split tensors' parts included); metadata = metadata.json "
             "(in brackets: its block checksums); index = all index files (format v2), each writer's alone in "
             "brackets. Read plan = the slowest sampled rank's part of the read plan (plan_reads: the job-wide "
             "plan of listed needs, and its own split targets' chunks); needs/rank = the slowest sampled rank's "
             "own need computation (ranks compute theirs in parallel).", "",
             "| model | layout | state | ranks | plan entries | distinct plans | chunks | planning s | metadata MB "
             "| index MB | parse s | max/mean bytes | load into | read plan s | needs/rank s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        ld = r["load"] or {}
        lines.append(f"| {r['model']} | {r['layout']} | {r['state']} | {r['world']:,} | {r['plan_entries']:,} | "
                     f"{r['distinct_plans']:,} | {r['chunks']:,} | {r['planning_s']:.2f} | "
                     f"{r['metadata_bytes'] / 1e6:.1f} ({r['block_checksum_bytes'] / 1e6:.1f}) | "
                     f"{r['index_bytes_total'] / 1e6:.1f} ({r['index_bytes_rank0'] / 1e6:.2f}) | "
                     f"{r['metadata_parse_s']:.2f} | {r['max_mean_bytes']:.3f} | {ld.get('target_world', '-')} | "
                     f"{ld.get('read_plan_s', '-')} | {ld.get('needs_per_rank_max_s', '-')} |")
    lines += ["", "Fitted growth exponents (slope of log-log; 1.0 = linear):", "",
              "| model/layout | planning vs ranks x entries | planning vs ranks | metadata bytes vs chunks | "
              "metadata bytes vs ranks | index bytes vs ranks | read plan vs need entries | read plan vs ranks |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k, g in growth.items():
        lines.append(f"| {k} | {g['planning_s_vs_entries']} | {g['planning_s_vs_world']} | "
                     f"{g['metadata_bytes_vs_chunks']} | {g['metadata_bytes_vs_world']} | {g['index_bytes_vs_world']} | "
                     f"{g['read_plan_s_vs_need_entries']} | {g['read_plan_s_vs_world']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8, 64, 512 ranks only")
    ap.add_argument("--model", choices=sorted(MODELS), help="one case: model")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), help="one case: layout")
    ap.add_argument("--world", type=int, help="one case: ranks")
    ap.add_argument("--target", type=int, help="one case: ranks of the resharding load (0: none)")
    ap.add_argument("--params-only", action="store_true", help="one case: parameters only (no AdamW moments)")
    ap.add_argument("--profile", action="store_true", help="one case under cProfile (top 25 by own time)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "plan_sim.json"))
    args = ap.parse_args(argv)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(),
               "load_avg": round(os.getloadavg()[0], 1)}
    if args.model or args.layout or args.world:
        model, layout, world = args.model or "405b", args.layout or "3d", args.world or 512
        target = LOAD_TARGET.get(world) if args.target is None else args.target
        if args.profile:
            prof = cProfile.Profile()
            rec = prof.runcall(run_case, model, layout, world, target, not args.params_only)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        else:
            rec = run_case(model, layout, world, target, not args.params_only)
        print(json.dumps(rec, indent=1))
        return
    worlds = QUICK_WORLDS if args.quick else WORLDS
    cases = [("405b", "3d", w, True) for w in worlds] + [("405b", "hsdp", w, True) for w in worlds]
    cases += [("405b", "fsdp", w, True) for w in (QUICK_WORLDS if args.quick else FSDP_WORLDS)]
    cases += [("405b", "fsdp-flat", w, True) for w in QUICK_WORLDS]
    cases += [("405b", "3d", worlds[-1], False), ("405b", "hsdp", worlds[-1], False)]
    records = []
    for model, layout, world, optim in cases:
        rec = run_case(model, layout, world, LOAD_TARGET[world], optim)
        print(f"{model:5} {layout:9} {rec['state']:11} {world:6}: planning {rec['planning_s']:7.2f} s, {rec['chunks']:8,} chunks, "
              f"metadata {rec['metadata_bytes'] / 1e6:7.1f} MB parsed in {rec['metadata_parse_s']:.2f} s, "
              f"read plan {rec['load']['read_plan_s']:.2f} s", flush=True)
        records.append(rec)
        md = _write(args.out, records, machine)  # after every case: a long run leaves what it measured
    print(md)


def _write(out: str, records: list[dict], machine: dict) -> str:
    machine["load_avg_end"] = round(os.getloadavg()[0], 1)
    growth = _growth(records)
    with open(out, "w") as f:
        json.dump({"machine": machine, "records": records, "growth": growth}, f, indent=1)
    md = markdown(records, growth, machine)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md)
    return md


if __name__ == "__main__":
    main()
