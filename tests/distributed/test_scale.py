"""Planning at scale: the real planners on simulated jobs (benchmarks/plan_sim.py), their exactness,
the size of the metadata, the structure that keeps them near-linear, and the collectives a save runs
(real engine, real gloo process groups)."""
from __future__ import annotations

import importlib.util
import math
import os
import random
import sys

import pytest

import scale_workers as sw
from unickpt.format.metadata import CheckpointMetadata
from unickpt.plan.save_plan import LocalPlan, decode_plans, make_global_plan, make_local_plan, make_save_plan
from unickpt.plan.read_plan import make_read_plan
from unickpt.plan.needs import merge_byte_ranges
from unickpt.geometry import Box, ChunkIndex, EvenSplit, FlatRange, check_exact_cover, chunk_pieces, intersect

_spec = importlib.util.spec_from_file_location(
    "plan_sim", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "plan_sim.py"))
ps = importlib.util.module_from_spec(_spec)
sys.modules["plan_sim"] = ps  # dataclasses look their module up while the class is created
_spec.loader.exec_module(ps)

BYTES_PER_PARAM = 2 + 4 + 4  # bf16 parameter + two fp32 AdamW moments


def _contains(outer, inner, shape=None, rank=None) -> bool:
    if isinstance(outer, EvenSplit):  # the rank's part of a split of the group (format v2)
        outer = outer.part(shape, rank)
    if isinstance(outer, FlatRange) or isinstance(inner, FlatRange):
        return outer == inner
    return all(o <= i and i + n <= o + m for o, m, i, n in zip(outer.offsets, outer.lengths, inner.offsets, inner.lengths))


@pytest.mark.parametrize("layout,world", [("fsdp", 16), ("fsdp-flat", 16), ("hsdp", 64), ("3d", 128)])
def test_simulated_save_plan_writes_every_byte_once_from_a_holder(layout, world):
    plans = ps.make_plans("7b", layout, world)
    rec, meta = ps.measure_save(plans)
    assert rec["bytes"] == ps.param_count(ps.MODELS["7b"]) * BYTES_PER_PARAM  # each unique byte once
    # the engine path: ranks repeating an earlier rank's plan send nothing, ranks repeating its tensor
    # table send their specs only; every rank gets the same plan
    firsts = ps._firsts(plans)
    table_of: dict = {}
    table_firsts = [table_of.setdefault(p.table_digest(), r) for r, p in enumerate(plans)]
    blobs = [p.to_bytes(with_table=table_firsts[r] == r) if firsts[r] == r else b"" for r, p in enumerate(plans)]
    if layout == "3d":  # ranks of one pipeline stage share the table
        assert len(set(table_firsts)) == ps.grid(world)[1] and sum(map(len, blobs)) < 0.5 * sum(
            len(p.to_bytes()) for p in plans)
    gathered = decode_plans(blobs, firsts, table_firsts)
    assert [(p.rank, p.tensors) for p in gathered] == [(p.rank, p.tensors) for p in plans]
    plan = make_save_plan(gathered)
    assert plan.bytes_per_rank == make_save_plan(plans).bytes_per_rank
    by_fqn: dict = {}
    for r, writes in enumerate(plan.writes):
        for c in writes:
            _, shape, held = plans[r].tensors[c.fqn]
            assert _contains(held, c.spec, shape, r), (c.fqn, c.spec, r)  # the writer holds it
            by_fqn.setdefault(c.fqn, []).append(c.spec)
    for fqn, (_, shape) in plan.tensors.items():
        check_exact_cover(fqn, shape, by_fqn[fqn])  # no gap, no overlap
    assert set(meta.tensors) == set(plan.tensors)
    if layout == "fsdp":  # every tensor is each rank's part of one split: one plan gathered, no chunk listed
        assert rec["distinct_plans"] == 1 and rec["explicit_chunks"] == 0 and len(plan.splits) == len(plan.tensors)
        assert all(t.split == EvenSplit(0, world) for t in meta.tensors.values())
    if layout == "hsdp":  # replicas balanced over their holders
        assert plan.max_mean_bytes < 1.15
    if layout == "3d":  # pipeline stages differ in size; the DP replicas of one (stage, TP rank) balance
        tp, pp, dp = ps.grid(world)
        groups: dict = {}
        for r, b in enumerate(plan.bytes_per_rank):
            groups.setdefault((r // (tp * dp), r % tp), []).append(b)
        assert all(max(g) <= 1.15 * sum(g) / len(g) for g in groups.values())


def test_metadata_grows_with_unique_chunks_not_with_ranks():
    small, _ = ps.measure_save(ps.make_plans("7b", "hsdp", 16))
    large, meta = ps.measure_save(ps.make_plans("7b", "hsdp", 128))
    assert large["plan_entries"] == 8 * small["plan_entries"]  # ranks x keys grows 8x ...
    assert small["chunks"] == 8 * len(meta.tensors)  # one chunk per shard of the 8-rank shard group
    # the unique chunks do not grow with the ranks: only the large replicated ones are cut, into parts of
    # at least 1/4 of the mean bytes per rank (for balance), so at most 4 x ranks extra chunks
    assert small["chunks"] <= large["chunks"] <= small["chunks"] + 4 * 128
    assert large["chunks"] < 1.3 * small["chunks"] and large["metadata_bytes"] < 1.3 * small["metadata_bytes"]
    assert large["max_mean_bytes"] < 1.15
    assert large["distinct_plans"] == small["distinct_plans"] == 8  # nor what the ranks gather
    fsdp, _ = ps.measure_save(ps.make_plans("7b", "fsdp", 16))  # every rank's shard is a unique chunk
    assert fsdp["chunks"] == fsdp["plan_entries"]
    for rec in (fsdp, large):  # at most ~250 bytes per chunk plus 27 per block checksum (chunks > 1 MiB)
        assert rec["metadata_bytes"] < 250 * rec["chunks"] + 28 * rec["block_checksums"]


def test_fsdp_metadata_and_gathered_plans_do_not_grow_with_ranks():
    small, meta = ps.measure_save(ps.make_plans("7b", "fsdp", 16))
    large, _ = ps.measure_save(ps.make_plans("7b", "fsdp", 512))
    assert large["plan_entries"] == 32 * small["plan_entries"] and large["chunks"] > 20 * small["chunks"]
    # what travels: one plan per set of tensors whose parts are empty (ranks past a tensor's rows hold
    # nothing of it: at 512 ranks, the 7B's 32,000-row embeddings and 4,096-row weights leave 3 sets),
    # each the same rules, sent as specs only after the first (same tensor table)
    assert small["distinct_plans"] == 1 and large["distinct_plans"] == 3
    assert large["gathered_bytes"] < 1.5 * small["gathered_bytes"]
    # metadata.json holds one line per tensor
    assert large["metadata_bytes"] - small["metadata_bytes"] < 1000 and large["metadata_bytes"] < 200 * len(meta.tensors)
    # the parts' records: a fixed-size table per writer (plus 8 bytes per block checksum), read by range
    for rec, world in ((small, 16), (large, 512)):
        table = 32 + 48 * len(meta.tensors)
        assert (rec["index_bytes_rank0"] - table) % 8 == 0 and table <= rec["index_bytes_rank0"] <= table + 8 * 32 * len(
            meta.tensors)
        assert world * table <= rec["index_bytes_total"] <= world * (table + 8 * 32 * len(meta.tensors))


def test_replicated_split_is_bounded_by_the_world_not_ranks_times_tensors():
    world, big = 512, Box((0, 0), (4096, 1024))  # 16 MiB fp32 tensors held by every rank
    shared = {f"w{i}": ("float32", (4096, 1024), big) for i in range(32)}
    plans = [LocalPlan(rank=r, tensors=shared) for r in range(world)]
    gp = make_global_plan(plans)
    # before: every replicated box >= 1 MiB was cut into one part per holder (32 x 512 chunks)
    assert len(gp.chunks) <= 4 * world + 32
    loads = gp.bytes_per_rank(world)
    assert sum(loads) == 32 * 16 << 20 and max(loads) <= 1.15 * sum(loads) / world


def test_least_loaded_writer_matches_a_linear_scan():
    rnd = random.Random(3)
    world = 40
    plans = [LocalPlan(rank=r, tensors={}) for r in range(world)]
    for t in range(300):  # small tensors (never split), random holder sets, some single-holder
        holders = rnd.sample(range(world), rnd.choice([1, 2, 5, 17, world]))
        shape = (rnd.randint(1, 300),)
        for r in range(world):
            plans[r].tensors[f"t{t}"] = ("float32", shape, Box((0,), shape) if r in holders else None)
    gp = make_global_plan(plans)
    # the reference: fixed writers first, then largest first to min(holders, key=(load, rank))
    load = [0] * world
    fixed, rep = {}, []
    for t in range(300):
        fqn = f"t{t}"
        hs = [r for r in range(world) if plans[r].tensors[fqn][2] is not None]
        nbytes = plans[hs[0]].tensors[fqn][1][0] * 4
        if len(hs) == 1:
            load[hs[0]] += nbytes
            fixed[fqn] = hs[0]
        else:
            rep.append((nbytes, fqn, hs))
    want = dict(fixed)
    for nbytes, fqn, hs in sorted(rep, key=lambda x: (-x[0], x[1])):
        w = min(hs, key=lambda r: (load[r], r))
        load[w] += nbytes
        want[fqn] = w
    assert {c.fqn: c.writer for c in gp.chunks} == want


def _brute_read_plan_pieces(needs):
    out = []
    chunks = sorted({c for n in needs for c in n})
    for cid in chunks:
        cuts = sorted({x for n in needs for s, k in n.get(cid, []) for x in (s, s + k)})
        for a, b in zip(cuts, cuts[1:]):
            who = tuple(r for r, n in enumerate(needs) if any(s <= a < s + k for s, k in n.get(cid, [])))
            if who:
                out.append((cid, a, b - a, who))
    return out


def test_read_plan_sweep_matches_brute_force():
    rnd = random.Random(5)
    needs = []
    for r in range(12):
        n = {}
        for cid in range(6):
            if rnd.random() < 0.6:
                n[cid] = merge_byte_ranges([(s, rnd.randint(1, 40)) for s in rnd.sample(range(200), rnd.randint(1, 5))])
        needs.append(n)
    segs = make_read_plan(needs)
    pieces = _brute_read_plan_pieces(needs)
    # segments are the brute-force pieces, adjacent ones with the same reader and needers merged
    covered = [(s.chunk_id, s.start, s.length, s.needers) for s in segs]
    i = 0
    for cid, start, length, who in covered:
        end = start + length
        pos = start
        while pos < end:
            p = pieces[i]
            assert (p[0], p[1], p[3]) == (cid, pos, who)
            pos += p[2]
            i += 1
        assert pos == end
    assert i == len(pieces)
    assert all(s.reader in s.needers for s in segs)


def test_chunk_index_finds_exactly_the_overlapping_pieces():
    rnd = random.Random(7)
    shape = (37, 11, 3)
    total = math.prod(shape)
    cuts = sorted(rnd.sample(range(1, total), 25))
    specs = [FlatRange(a, b - a) for a, b in zip([0] + cuts, cuts + [total])]
    specs += [Box((0, 0, 0), (37, 5, 3)), Box((3, 5, 0), (10, 6, 3))]  # a second, different tiling mixed in
    index = ChunkIndex(shape, specs)
    for _ in range(200):
        lo = [rnd.randrange(n) for n in shape]
        box = Box(tuple(lo), tuple(rnd.randint(1, n - o) for o, n in zip(lo, shape)))
        want = [(i, p.elem_offset, intersect(box, p.box)) for i, s in enumerate(specs) for p in chunk_pieces(s, shape)
                if intersect(box, p.box) is not None]
        got = [(i, p.elem_offset, inter) for i, p, inter in index.overlapping(box)]
        assert got == want


def test_simulated_plans_are_what_make_local_plan_builds():
    import torch

    import unickpt
    from unickpt.state.flat import flatten

    world, rank = 4, 1
    plans = ps.make_plans("7b", "fsdp", world)
    state = {}
    for fqn, (dtype, shape, spec) in ps.fsdp_boxes(ps.MODELS["7b"], world, rank).items():
        local = torch.empty(spec.lengths, dtype=getattr(torch, dtype), device="meta")
        state[fqn] = unickpt.Shard(local, shape, offsets=spec.offsets)
    local = make_local_plan(flatten(state, for_load=False), rank, world_size=world)
    assert local.tensors == plans[rank].tensors
    assert all(isinstance(s, EvenSplit) for _, _, s in local.tensors.values())  # FSDP2 over the group: rules
    boxes = make_local_plan(flatten(state, for_load=False), rank)  # alone (world 1): the boxes themselves
    assert boxes.tensors == ps.fsdp_boxes(ps.MODELS["7b"], world, rank)
    assert LocalPlan.from_bytes(local.to_bytes()) == local and len(local.to_bytes()) < 120 * len(local.tensors)
    local = boxes
    other = make_local_plan(flatten({f: unickpt.Shard(torch.empty(s.lengths, dtype=getattr(torch, d), device="meta"),
                                                      shape, offsets=s.offsets)
                                     for f, (d, shape, s) in ps.fsdp_boxes(ps.MODELS["7b"], world, 2).items()},
                                    for_load=False), 2)
    assert other.table_digest() == local.table_digest() and other.signature() != local.signature()
    specs_only = other.to_bytes(with_table=False)
    assert len(specs_only) < 0.4 * len(other.to_bytes()) and LocalPlan.from_bytes(specs_only, local) == other
    with pytest.raises(ValueError, match="names tensor table .* which was not received"):
        LocalPlan.from_bytes(specs_only, LocalPlan(rank=0, tensors={"x": ("float32", (1,), None)}))


@pytest.mark.parametrize("saved,loaded", [("3d", "hsdp"), ("fsdp", "fsdp"), ("hsdp", "fsdp"), ("fsdp", "hsdp")])
def test_resharding_load_reads_every_byte_once(saved, loaded):
    plans = ps.make_plans("tiny", saved, 64)
    rec, meta = ps.measure_save(plans)
    load = ps.measure_load(meta, ps.make_plans("tiny", loaded, 48), all_ranks=True)
    assert load["bytes_read"] == rec["bytes"]  # the read plan reads each stored byte once, job-wide
    assert CheckpointMetadata.from_json(meta.to_json()).tensors.keys() == meta.tensors.keys()
    if loaded == "fsdp":  # the targets are their ranks' parts of splits: nothing listed, one doc per set of
        # tensors whose parts are empty (48 ranks over 256, 128 and 688 rows: 3 sets)
        assert load["distinct_needs"] == 3 and load["listed_need_entries"] == 0
    if loaded == "hsdp":  # replicas send one doc per shard-group position and are planned as one
        assert load["distinct_needs"] == 8


def test_read_plan_plans_replicas_as_one_group():
    shared = [{0: [(0, 100)], 1: [(50, 50)]}, {1: [(0, 60)]}]
    needs = [shared[r % 2] for r in range(1000)]  # 500 replicas of each of two needs
    segs = make_read_plan(needs)
    evens, odds = tuple(range(0, 1000, 2)), tuple(range(1, 1000, 2))
    assert [(s.chunk_id, s.start, s.length, s.needers) for s in segs] == [
        (0, 0, 100, evens), (1, 0, 50, odds), (1, 50, 10, tuple(range(1000))), (1, 60, 40, evens)]
    assert all(s.reader in s.needers for s in segs)


@pytest.mark.parametrize("world", [2, 4])
def test_save_collectives_are_bounded_and_cached(pool, tmp_path, world):
    results = pool(world).run(sw.save_counting, str(tmp_path), 3)
    for per_rank in results:
        first, *steady = per_rank
        # a miss: signature exchange + plan gather (lengths, payloads) + the replica check of the one
        # replicated tensor (MIN and MAX all_reduce); commit: results (2) + status (1)
        assert first["counts"] == {"all_gather": 3, "all_reduce": 4, "broadcast": 1}
        assert (first["plan_cache_hit"], first["collectives_plan"], first["collectives_commit"]) == (False, 5, 3)
        for s in steady:  # plan cache: only the fixed-size signature exchange, no plan gather
            assert s["counts"] == {"all_gather": 2, "all_reduce": 1, "broadcast": 1}
            assert (s["plan_cache_hit"], s["collectives_plan"], s["collectives_commit"]) == (True, 1, 3)
        assert "all_gather_object" not in first["counts"]  # no pickled objects
