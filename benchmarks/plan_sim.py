"""Planner simulation: the real save and load planners for simulated jobs of 8 to 10,000 ranks, in one
process, without tensor data.

Each simulated rank is described by the :class:`unickpt.planner.LocalPlan` its engine would build
(``fqn -> (dtype, global shape, box or flat range)``, what :func:`unickpt.planner.make_local_plan`
derives from a flattened state); only shapes and offsets exist, no tensor is allocated. Then the
code the engine runs is called as it is:

* save: :func:`unickpt.planner.make_save_plan` (global plan: dedup of replicas, coverage check,
  writer balancing, files and offsets) on the plans the engine would gather (ranks whose plan
  signature repeats an earlier rank's send nothing: :func:`unickpt.planner.expand_plans`),
  the metadata the commit writes (:func:`unickpt.metadata.build_metadata`, with synthetic checksums
  of the real length), its JSON size and its parse time (:meth:`CheckpointMetadata.from_json`);
* resharding load: every target rank's byte ranges per stored chunk
  (:func:`unickpt.read_plan.chunk_needs`, what :class:`unickpt.reader.TargetReads` records) and the
  zero-redundancy read plan (:func:`unickpt.read_plan.make_read_plan`).

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

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_sim.py            # the table (a few minutes)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_sim.py --quick    # 8..512 ranks
    .venv/bin/python benchmarks/plan_sim.py --profile --model 405b --layout 3d --world 4096

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
import sys
import time
from dataclasses import dataclass

from unickpt.codec import str_to_dtype
from unickpt.metadata import CHECKSUM_BLOCK_BYTES, CheckpointMetadata, block_size, build_metadata
from unickpt.planner import LocalPlan, expand_plans, make_save_plan
from unickpt.read_plan import make_read_plan
from unickpt.reader import merge_ranges, piece_runs, widen_to_blocks
from unickpt.resharding import Box, ChunkIndex, FlatRange, chunk_pieces

HERE = os.path.dirname(os.path.abspath(__file__))


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


def fsdp_plans(cfg: ModelConfig, world: int, optim: bool = True) -> list[LocalPlan]:
    """FSDP2 (``fully_shard``): every parameter and moment split along dim 0 over all ranks."""
    params = model_params(cfg)
    states = STATES if optim else STATES[:1]
    plans = []
    for r in range(world):
        t = {}
        for fqn, shape, _, _ in params:
            box = _dim0(shape[0], world, r, shape)
            for prefix, dtype in states:
                t[prefix + fqn] = (dtype, shape, box)
        plans.append(_plan(r, t))
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
    group = fsdp_plans(cfg, shard_group, optim)
    return [LocalPlan(rank=r, tensors=group[r % shard_group].tensors) for r in range(world)]


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
    """Megatron-style TP x PP x DP (rank = (pp_idx * dp + dp_idx) * tp + tp_idx): parameters TP-split
    and replicated over DP; AdamW moments ZeRO-1-split along dim 0 of each TP shard over DP."""
    tp, pp, dp = grid(world, tp)
    params = model_params(cfg)
    param_cache: dict[tuple[int, int], dict] = {}
    plans = []
    for r in range(world):
        tp_i, dp_i, pp_i = r % tp, (r // tp) % dp, r // (tp * dp)
        key = (pp_i, tp_i)
        if key not in param_cache:
            t = {}
            for fqn, shape, split, unit in params:
                if pp_stage(unit, cfg.layers, pp) != pp_i:
                    t[fqn] = ("bfloat16", shape, None)
                    continue
                t[fqn] = ("bfloat16", shape, _tp_box(shape, split, tp, tp_i))
            param_cache[key] = t
        t = dict(param_cache[key])
        if optim:
            for fqn, shape, split, unit in params:
                box = t[fqn][2]
                part = _dim0(box.lengths[0], dp, dp_i, box.lengths, box.offsets) if box is not None else None
                for prefix, dtype in STATES[1:]:
                    t[prefix + fqn] = (dtype, shape, part)
        plans.append(_plan(r, t))
    return plans


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
def synthetic_digests(plan) -> list[list[tuple[str, tuple[str, ...], int]]]:
    """Per rank, per written chunk: a checksum, block checksums and block size of the lengths the
    save pipeline produces (format v1: one xxh3-64 per chunk, one per block for chunks > 1 MiB)."""
    out = []
    for r, writes in enumerate(plan.writes):
        rank = []
        for i, c in enumerate(writes):
            digest = f"xxh3_64:{(r * 1_000_003 + i) & 0xFFFFFFFFFFFFFFFF:016x}"
            if c.nbytes > CHECKSUM_BLOCK_BYTES:
                b = block_size(c.nbytes)
                rank.append((digest, tuple(digest for _ in range(-(-c.nbytes // b))), b))
            else:
                rank.append((digest, (), 0))
        out.append(rank)
    return out


def measure_save(plans: list[LocalPlan], *, parse: bool = True) -> tuple[dict, CheckpointMetadata]:
    """Plan a save as the engine does on a plan-cache miss: the ranks that are first with their
    signature encode their plans (:meth:`LocalPlan.to_bytes`), every rank decodes the gathered
    bytes, expands them and runs :func:`make_save_plan`; then the commit's metadata is built,
    serialized and parsed."""
    world = len(plans)
    firsts = _firsts(plans)
    t0 = time.perf_counter()
    blobs = [p.to_bytes() if firsts[r] == r else b"" for r, p in enumerate(plans)]
    encode_s = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    gathered = expand_plans([LocalPlan.from_bytes(b) if firsts[r] == r else None for r, b in enumerate(blobs)], firsts)
    decode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = make_save_plan(gathered)
    plan_s = time.perf_counter() - t0
    del gathered
    digests = synthetic_digests(plan)
    t0 = time.perf_counter()
    meta = build_metadata(plan, [{"digests": d, "per_rank_file": None} for d in digests], world_size=world,
                          skeleton={"t": "dict"}, step=0, run_id="sim")
    text = meta.to_json().encode()
    build_s = time.perf_counter() - t0
    del meta, digests
    parsed, parse_s = None, None
    if parse:
        gc.collect()
        t0 = time.perf_counter()
        parsed = CheckpointMetadata.from_json(text)
        parse_s = time.perf_counter() - t0
    chunks = sum(len(w) for w in plan.writes)
    rec = {
        "world": world, "plan_entries": sum(len(p.tensors) for p in plans), "distinct_plans": sum(
            1 for r, f in enumerate(firsts) if r == f), "gathered_bytes": sum(len(b) for b in blobs),
        "chunks": chunks, "tensors": len(plan.tensors),
        "encode_all_s": round(encode_s, 3), "decode_s": round(decode_s, 3), "plan_s": round(plan_s, 3),
        "planning_s": round(decode_s + plan_s, 3), "metadata_build_s": round(build_s, 3),
        "metadata_bytes": len(text), "metadata_bytes_per_chunk": round(len(text) / max(1, chunks), 1),
        "metadata_parse_s": None if parse_s is None else round(parse_s, 3),
        "max_mean_bytes": round(plan.max_mean_bytes, 4), "bytes": sum(plan.bytes_per_rank),
    }
    return rec, parsed


def _firsts(plans: list[LocalPlan]) -> list[int]:
    """For each rank, the first rank whose plan has the same content (the engine compares
    signatures; the simulation's replicas share one tensors dict)."""
    seen: dict[int, int] = {}
    return [seen.setdefault(id(p.tensors), i) for i, p in enumerate(plans)]


def measure_load(meta: CheckpointMetadata, targets: list[LocalPlan], *, verify: bool = True) -> dict:
    """Resharding load of ``meta`` into ``targets``: each rank's needs as
    :meth:`unickpt.reader.TargetReads.add` computes them (chunk index, overlaps, byte runs, merged,
    widened to checksum blocks), then the job-wide read plan every rank computes from the gathered
    needs. Ranks with identical plans (replicas) compute identical needs; they are computed once."""
    t0 = time.perf_counter()
    ids, index, chunk_meta = {}, {}, {}
    cid = 0
    for fqn in sorted(meta.tensors):  # the numbering of loading._ChunkTable
        t = meta.tensors[fqn]
        ids[fqn] = list(range(cid, cid + len(t.chunks)))
        chunk_meta[fqn] = t.chunks
        index[fqn] = ChunkIndex(t.shape, [c.spec for c in t.chunks])
        cid += len(t.chunks)
    index_s = time.perf_counter() - t0
    itemsize = {fqn: str_to_dtype(t.dtype).itemsize for fqn, t in meta.tensors.items()}
    needs: list[dict] = []
    need_s: list[float] = []
    cache: dict[int, dict] = {}
    for p in targets:
        if id(p.tensors) in cache:
            needs.append(cache[id(p.tensors)])
            continue
        t0 = time.perf_counter()
        ranges: dict[int, list] = {}
        for fqn, (_, shape, spec) in p.tensors.items():
            if spec is None:
                continue
            by_chunk: dict[int, list] = {}
            for piece in chunk_pieces(spec, shape):
                for i, pc, inter in index[fqn].overlapping(piece.box):
                    by_chunk.setdefault(i, []).append((pc, inter))
            isz = itemsize[fqn]
            for i, found in by_chunk.items():
                rs = merge_ranges(piece_runs(found, isz))
                ranges[ids[fqn][i]] = widen_to_blocks(rs, chunk_meta[fqn][i]) if verify else rs
        need_s.append(time.perf_counter() - t0)
        cache[id(p.tensors)] = ranges
        needs.append(ranges)
    gc.collect()
    t0 = time.perf_counter()
    segments = make_read_plan(needs)
    read_plan_s = time.perf_counter() - t0
    return {"target_world": len(targets), "need_entries": sum(len(n) for n in needs), "segments": len(segments),
            "index_s": round(index_s, 3), "needs_per_rank_max_s": round(max(need_s), 4),
            "needs_all_ranks_s": round(sum(need_s), 3), "read_plan_s": round(read_plan_s, 3),
            "bytes_read": sum(s.length for s in segments)}
