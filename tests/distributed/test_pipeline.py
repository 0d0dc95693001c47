"""The save pipeline: bounded staging rings (reuse, ping-pong, streaming), pipelined drain (threads and
writer process, direct I/O, upload), plan cache and collective counts, balance, merging of flat
ranges, overlap snapshots, and failures in every stage. Distributed cases run on real gloo groups."""
from __future__ import annotations

import json
import os
import random
import sys
import threading
import time

import pytest
import torch
from torch import nn

import pipeline_workers as w
import unickpt
from unickpt.engine import get_engine
from unickpt.format.integrity import ChunkHasher
from unickpt.plan.stream import GRANULE_BYTES, stream_layout
from unickpt.plan.merge import merge_ranges
from unickpt.format.integrity import CHECKSUM_BLOCK_BYTES, block_size, chunk_checksums
from unickpt.plan.save_plan import LocalPlan, RecvFill, _split_replica, make_save_plan
from unickpt.geometry import Box, FlatRange, check_exact_cover
from unickpt.saving.staging import PoolAborted, StagingPool, byte_view, copy_bytes


@pytest.fixture
def engine():
    """The world-of-one engine, its options restored afterwards."""
    e = get_engine()
    saved = e.options
    yield e
    e.wait()
    e.options = saved


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------------- #
# units
# ---------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("nbytes", [0, 1, 4095, CHECKSUM_BLOCK_BYTES, CHECKSUM_BLOCK_BYTES + 1, 9 * CHECKSUM_BLOCK_BYTES + 17,
                                    70 * CHECKSUM_BLOCK_BYTES])
def test_streaming_checksum_equals_one_shot_for_any_cuts(nbytes):
    data = memoryview(bytes(random.Random(nbytes).getrandbits(8) for _ in range(min(nbytes, 4096))) * (nbytes // 4096 + 1))[:nbytes]
    rnd = random.Random(1)
    h = ChunkHasher(nbytes, block_size(nbytes) if nbytes > CHECKSUM_BLOCK_BYTES else 0)
    pos = 0
    while pos < nbytes:
        k = rnd.randint(1, 3 * CHECKSUM_BLOCK_BYTES // 2)
        h.update(data[pos : pos + k])
        pos += k
    assert h.finish() == chunk_checksums(data)


def test_merge_ranges_gives_row_boxes_and_short_transfers():
    shape = (37, 11)
    cuts = [0, 50, 51, 300, 407]
    ranges = [(a, b - a, r) for r, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    merged = merge_ranges(shape, 4, ranges)
    check_exact_cover("a", shape, [m.spec for m in merged])
    assert all(isinstance(m.spec, Box) for m in merged)
    # the shortest range (1 element) forces rows of the last dimension: every writer gets >= 1 row
    assert {m.writer for m in merged} == {0, 1, 2, 3}
    for m in merged:
        assert sum(n for _, n, _, _ in m.parts) == m.nbytes
        moved = [n for _, n, src, _ in m.parts if src != m.writer]
        assert all(n < 11 * 4 for n in moved)  # less than one row moves
    # long ranges: one box of whole rows per writer
    merged = merge_ranges((10, 7), 4, [(0, 23, 0), (23, 28, 1), (51, 19, 2)])
    assert [m.spec for m in merged] == [Box((0, 0), (4, 7)), Box((4, 0), (4, 7)), Box((8, 0), (2, 7))]
    assert [[(src, n) for _, n, src, _ in m.parts] for m in merged] == [[(0, 92), (1, 20)], [(1, 92), (2, 20)], [(2, 56)]]
    with pytest.raises(ValueError, match="gap or overlap"):
        merge_ranges((10,), 4, [(0, 4, 0), (5, 5, 1)])


def test_save_plan_packs_chunks_and_cuts_receives_at_granules():
    shape = (3000, 1000)
    n = 3000 * 1000
    cuts = [0, 1_500_123, n]
    plans = [LocalPlan(rank=r, tensors={"w": ("float32", shape, FlatRange(cuts[r], cuts[r + 1] - cuts[r])),
                                         "x": ("int8", (5,), Box((0,), (5,)))}) for r in range(2)]
    plan = make_save_plan(plans, flat_ranges="merge", segment_bytes=2 << 20)
    for r in range(2):
        sizes = [size for _, size in plan.segments[r]]
        bases, _ = stream_layout(sizes)
        ends: dict = {}
        for c in plan.writes[r]:
            assert c.offset == ends.get(c.file, 0)  # packed back to back, format v1
            ends[c.file] = c.offset + c.nbytes
            for f in c.fills:
                if isinstance(f, RecvFill):
                    start = bases[c.segment] + c.offset + f.byte_start
                    assert start // GRANULE_BYTES == (start + f.nbytes - 1) // GRANULE_BYTES
        assert [ends[f] for f, _ in plan.segments[r]] == sizes
    recvs = sorted((f.index, f.nbytes, f.src, r) for r in range(2) for c in plan.writes[r] for f in c.fills
                   if isinstance(f, RecvFill))
    sends = sorted((s.index, s.nbytes, r, s.dst) for r in range(2) for s in plan.sends[r])
    assert recvs == sends and sum(x[1] for x in recvs) == (1_501_000 - 1_500_123) * 4
    check_exact_cover("w", shape, [c.spec for ws in plan.writes for c in ws if c.fqn == "w"])


def test_large_replicated_box_splits_along_a_long_enough_dim():
    parts = _split_replica(Box((0, 0), (2, 1_000_000)), 8_000_000, 4)
    assert [p.lengths for _, p in parts] == [(2, 250_000)] * 4
    assert [p.offsets for _, p in parts] == [(0, 0), (0, 250_000), (0, 500_000), (0, 750_000)]


def test_skewed_replicated_sizes_plan_balanced():
    rnd = random.Random(0)
    sizes = [(4096, 1024), (3, 1_000_000), (1000,), (77, 13)] + [(rnd.randint(1, 300), 257) for _ in range(40)]
    plans = [LocalPlan(rank=r, tensors={f"t{i}": ("float32", s, Box((0,) * len(s), s)) for i, s in enumerate(sizes)})
             for r in range(4)]
    plan = make_save_plan(plans)
    assert plan.max_mean_bytes < 1.1
    assert sum(plan.bytes_per_rank) == sum(4 * Box((0,) * len(s), s).numel for s in sizes)  # each replica once


def test_ring_blocks_until_freed_and_aborts():
    pool = StagingPool(0)
    assert pool.reserve(3 << 20)
    assert pool.capacity_bytes == 3 << 20 and not pool.reserve(1 << 20)  # reused, not shrunk
    pool.begin()
    pool.acquire(3 << 20)  # fits without waiting
    got = []
    t = threading.Thread(target=lambda: (pool.acquire(5 << 20), got.append(time.perf_counter())))
    t0 = time.perf_counter()
    t.start()
    time.sleep(0.2)
    assert not got
    pool.freed(2 << 20)
    t.join(5)
    assert got and got[0] - t0 >= 0.2 and pool.wait_s >= 0.2
    a, b = pool.region((2 << 20) + 5, (4 << 20) - 3)  # wraps
    assert a.numel() + b.numel() == (2 << 20) - 8
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(PoolAborted, pool.acquire, 100 << 20)))
    t.start()
    pool.abort("writer failed")
    t.join(5)
    assert errors and "writer failed" in str(errors[0].value)
    pool.close()


def _resident_pages(t: torch.Tensor) -> list[bool]:
    """Per page of ``t`` (page aligned), whether it is resident (``mincore``)."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    n = -(-t.numel() // page)
    vec = (ctypes.c_ubyte * n)()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), vec) == 0
    return [bool(v & 1) for v in vec]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_fresh_ring_is_faulted_in_ahead_of_the_stager_without_writing_to_it():
    # issue #21 (first saves): a fresh ring's pages are faulted in by a helper thread from 64 MiB on,
    # while the stager copies into the start; what the stager wrote is never touched
    from unickpt.saving import staging

    pool = StagingPool(0)
    pool.reserve(192 << 20)
    ring = pool.region(0, 192 << 20)[0]
    ring[(100 << 20) : (101 << 20)].fill_(42)  # bytes staged already, beyond the helper's start
    assert pool.prefault(192 << 20)
    pool._prefaulter.join(30)
    resident = _resident_pages(ring)
    page = os.sysconf("SC_PAGE_SIZE")
    if not all(resident[(64 << 20) // page :]):
        pytest.skip("MADV_POPULATE_WRITE is not supported by this kernel (Linux < 5.14)")
    assert not any(resident[: (32 << 20) // page])  # the stager's part is left to the stager
    assert bool((ring[(100 << 20) : (101 << 20)] == 42).all())
    assert not pool.prefault(192 << 20)  # once per allocation
    pool.reserve(256 << 20)  # grown: fresh again
    assert pool.prefault(256 << 20)
    pool.close()  # stops and joins the helper before the memory goes
    assert pool._prefaulter is None


@pytest.mark.parametrize("make", [lambda: torch.arange(60.0).reshape(6, 10).t(), lambda: torch.tensor(2.5),
                                  lambda: torch.randn(4, 3, dtype=torch.complex64).conj(),
                                  lambda: torch.rand(7, 5) > 0.5, lambda: torch.arange(100.0).reshape(10, 10)[2:5, ::3],
                                  lambda: torch.randn(3, 4, 5).to(torch.bfloat16)[:, 1:3]],
                         ids=["transposed", "0d", "conj", "bool", "strided", "bf16-slice"])
def test_byte_copies_cut_anywhere(make):
    t = make()
    want = _bits(t.resolve_conj())
    n = want.numel()
    src = byte_view(t)
    for cut in sorted({0, 1, n // 3, n - 1, n}):
        out = torch.zeros(n, dtype=torch.uint8)
        copy_bytes([out[:cut], out[cut:]], src, 0, n)
        assert torch.equal(out, want)
    if n > 4:
        out = torch.zeros(n - 3, dtype=torch.uint8)
        copy_bytes([out], src, 2, n - 3)
        assert torch.equal(out, want[2 : n - 1])


# ---------------------------------------------------------------------------------------------- #
# one process
# ---------------------------------------------------------------------------------------------- #
def test_pool_is_reused_without_reallocation(engine, tmp_path):
    state = {"a": torch.randn(500, 700), "b": torch.arange(1000)}
    stats = []
    for i in range(4):
        state["a"].add_(1)
        h = unickpt.save(tmp_path / f"c{i}", state)
        stats.append(h.stats)
        out = {"a": torch.zeros(500, 700), "b": torch.zeros(1000, dtype=torch.int64)}
        unickpt.load(tmp_path / f"c{i}", out)
        assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"])
    pool = engine.saver.pipeline.pools[stats[0].pool_index]
    allocs = [s.pool_allocations for s in stats if s.pool_index == pool.index]
    assert len(allocs) >= 2 and len(set(allocs)) == 1  # no save after the first reallocated
    ptr = pool._tensor.data_ptr()
    unickpt.save(tmp_path / "again", state)
    assert pool._tensor.data_ptr() == ptr and pool.allocations == allocs[0]


def test_ping_pong_back_to_back_saves(engine, tmp_path):
    from unickpt.testing import Fault, inject

    t = torch.zeros(100_000)
    handles = []
    with inject(Fault("write", match="*/data/*", nth=None, action="slow", delay_s=0.4)):  # 0.4 s a data file
        for i in range(3):
            t.fill_(i)
            handles.append(unickpt.save(tmp_path / f"p{i}", {"t": t}, async_save=True))
        assert [h.stats.pool_index for h in handles] == [handles[0].stats.pool_index,
                                                         1 - handles[0].stats.pool_index, handles[0].stats.pool_index]
        assert handles[0].stats.pool_wait_s < 0.1 and handles[1].stats.pool_wait_s < 0.1  # the second did not wait
        assert handles[2].stats.pool_wait_s > 0.2  # both busy: the third waited, and says so
        for h in handles:
            h.wait()
    for i, h in enumerate(handles):
        out = torch.empty(100_000)
        unickpt.load(tmp_path / f"p{i}", {"t": out})
        assert torch.equal(out, torch.full((100_000,), float(i)))


@pytest.mark.parametrize("writer,direct", [("thread", False), ("thread", True), ("process", False)])
def test_state_bigger_than_pool_streams_through_it(engine, tmp_path, writer, direct):
    engine.configure(pool_bytes=2 << 20, piece_bytes=256 << 10, writer=writer, direct_io=direct, segment_bytes=5 << 20)
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(2_000_001, generator=g), "m": torch.randn(1200, 1000, generator=g)[:, ::2],
             "h": torch.randn(333, 777, generator=g).to(torch.float16), "i": torch.arange(10, dtype=torch.int8)}
    h = unickpt.save(tmp_path / "c", state, async_save=True)
    for v in state.values():  # the save returned: the snapshot is complete
        v.zero_()
    h.wait()
    s = h.stats
    total = 8_000_004 + 2_400_000 + 333 * 777 * 2 + 10
    assert s.streamed and s.pool_capacity == 2 << 20 and s.bytes_staged == total and s.bytes_written == total
    assert s.writer == writer
    g = torch.Generator().manual_seed(0)
    want = {"w": torch.randn(2_000_001, generator=g), "m": torch.randn(1200, 1000, generator=g)[:, ::2],
            "h": torch.randn(333, 777, generator=g).to(torch.float16), "i": torch.arange(10, dtype=torch.int8)}
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in want.items()}
    unickpt.load(tmp_path / "c", out)
    for k in want:
        assert torch.equal(_bits(out[k]), _bits(want[k])), k
    sizes = sorted(os.path.getsize(tmp_path / "c" / "data" / f) for f in os.listdir(tmp_path / "c" / "data"))
    assert sizes == [333 * 777 * 2 + 10 + 2_400_000, 8_000_004]  # cut at 5 MB, chunks packed, no padding


@pytest.mark.parametrize("clone_limit", [None, 0], ids=["buffers-cloned", "buffers-staged-first"])
def test_overlap_snapshot_blocks_optimizer_step_until_staged(engine, tmp_path, monkeypatch, clone_limit):
    import unickpt.saving.pipeline as pl
    import unickpt.saving.snapshot as sn

    if clone_limit is not None:  # tensors no optimizer owns are then staged before the call returns
        monkeypatch.setattr(sn, "OVERLAP_CLONE_BYTES", clone_limit)
    engine.configure(snapshot="overlap")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(8, 64)).square().mean().backward()
        optim.step()
        optim.zero_grad()

    step()
    original = pl.copy_bytes

    def slow_background(*a, **k):  # the stager thread takes its time
        if threading.current_thread().name == "unickpt-stager":
            time.sleep(0.1)
        return original(*a, **k)

    monkeypatch.setattr(pl, "copy_bytes", slow_background)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_exp_avg = optim.state[model[0].weight]["exp_avg"].clone()
    h = unickpt.save(tmp_path / "c", {"model": model, "optim": optim}, async_save=True)
    assert not h.snapshot_done()  # the optimizer's tensors are still being staged
    stall_at_return = h.stats.stall_s
    model.train()
    model(torch.randn(8, 64)).square().mean().backward()  # forward changes the BatchNorm buffers: staged already
    optim.step()  # the pre-hook waits for the snapshot
    assert h.snapshot_done()
    h.wait()
    assert h.stats.stall_s > stall_at_return + 0.1  # the wait in step() counts as stall
    fresh = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    unickpt.load(tmp_path / "c", {"model": fresh, "optim": fresh_optim})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(fresh_optim.state[fresh[0].weight]["exp_avg"], want_exp_avg)
    unickpt.save(tmp_path / "d", {"t": torch.ones(3)})  # a later save drops the finished hooks
    assert not optim._optimizer_step_pre_hooks


def test_overlap_snapshot_reports_planning_errors_on_the_handle(engine, tmp_path):
    engine.configure(snapshot="overlap")
    unickpt.save(tmp_path / "c", {"w": torch.ones(3)})
    h = unickpt.save(tmp_path / "c", {"w": torch.ones(3)}, async_save=True)  # returns before planning
    with pytest.raises(unickpt.CheckpointExistsError, match="already holds a committed checkpoint"):
        h.wait()
    engine.configure(snapshot="sync")
    with pytest.raises(unickpt.CheckpointExistsError):  # in sync mode the call itself raises
        unickpt.save(tmp_path / "c", {"w": torch.ones(3)}, async_save=True)
    engine.wait()  # nothing left to raise


def test_bad_options_are_rejected(engine):
    with pytest.raises(ValueError, match=r"unknown save option\(s\) \['pool_size'\]"):
        engine.configure(pool_size=1)
    with pytest.raises(ValueError, match="pool_bytes .* at least 2 \\* piece_bytes"):
        engine.configure(pool_bytes=1 << 20, piece_bytes=1 << 20)
    with pytest.raises(ValueError, match="flat_ranges"):
        engine.configure(flat_ranges="gather")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_staged_on_a_side_stream_into_pinned_memory(engine, tmp_path):
    x = torch.randn(3_000_000, device="cuda")
    y = torch.randn(500, 300, device="cuda").t()
    engine.configure(pool_bytes=4 << 20, piece_bytes=1 << 20)
    h = unickpt.save(tmp_path / "c", {"x": x, "y": y}, async_save=True)
    x.add_(1)  # after the return: must not reach the checkpoint
    h.wait()
    assert engine.saver.pipeline.pools[h.stats.pool_index].pinned and h.stats.streamed
    out = {"x": torch.zeros(3_000_000), "y": torch.zeros(300, 500)}
    unickpt.load(tmp_path / "c", out)
    assert torch.equal(out["x"], (x - 1).cpu()) and torch.equal(out["y"], y.cpu())


# ---------------------------------------------------------------------------------------------- #
# distributed
# ---------------------------------------------------------------------------------------------- #
def test_plan_cache_hit_and_invalidation_count_collectives(pool, tmp_path):
    results = pool(2).run(w.plan_cache_collectives, str(tmp_path))
    for r in results:
        # miss (signature exchange + plan gather), hit (signature exchange only), rank 1 changed its
        # layout: both ranks miss, back to the first layout: both hit
        assert [x["hit"] for x in r] == [False, True, False, True]
        assert [x["plan"] for x in r] == [3, 1, 3, 1]
        assert all(x["commit"] == 3 for x in r)  # results all_gather_object (2) + status broadcast (1)


def test_replicated_skewed_sizes_are_balanced(pool, tmp_path):
    results = pool(4).run(w.skewed_replicated, str(tmp_path))
    r0 = results[0]
    assert all(r["ok"] for r in results)
    assert r0["max_mean"] < 1.1 and max(r0["bytes_per_rank"]) / (sum(r0["bytes_per_rank"]) / 4) < 1.1
    assert [r["file_size"] for r in results] == r0["bytes_per_rank"]  # the files hold what the plan said
    assert sum(r0["bytes_per_rank"]) == r0["total"]  # every replica written once


def test_merged_and_flat_range_storage_load_identically(pool, tmp_path):
    store = pool(4).run(w.merge_vs_store, str(tmp_path), "store", None)
    merge = pool(4).run(w.merge_vs_store, str(tmp_path), "merge", None)
    small = pool(4).run(w.merge_vs_store, str(tmp_path / "small"), "merge", 2 << 20)
    for s, m, sm in zip(store, merge, small):
        assert s["full_ok"] and m["full_ok"] and sm["full_ok"] and s["shards_ok"] and m["shards_ok"] and sm["shards_ok"]
        assert s["full"] == m["full"] == sm["full"]
    assert store[0]["kinds"] == {k: ["flat"] for k in "abcd"}
    assert merge[0]["kinds"] == {k: ["box"] for k in "abcd"}
    assert sum(r["sends"] for r in merge) == sum(r["recvs"] for r in merge) > 0
    assert sum(r["sends"] for r in store) == 0


@pytest.mark.parametrize("writer,direct,merge", [("thread", False, True), ("thread", True, False),
                                                 ("process", True, True)])
def test_bigger_than_pool_on_two_ranks(pool, tmp_path, writer, direct, merge):
    results = pool(2).run(w.bigger_than_pool, str(tmp_path), writer, direct, merge)
    for r in results:
        assert r["ok"] and r["streamed"] and r["capacity"] == 2 << 20 and r["writer"] == writer
        assert r["files"] == ["0_0.bin", "0_1.bin", "1_0.bin", "1_1.bin"]


STAGES = [("stage", 0), ("stage", 1), ("checksum", 1), ("write", 0), ("write-direct", 1), ("upload", 1),
          ("merge", 1), ("commit", 0), ("writer-died", 0)]


@pytest.mark.parametrize("stage,fail_rank", STAGES, ids=[f"{s}-rank{r}" for s, r in STAGES])
def test_failure_in_any_stage_surfaces_and_keeps_last_checkpoint(pool, tmp_path, stage, fail_rank):
    results = pool(2).run(w.failing_stage, str(tmp_path), stage, fail_rank)
    name = {"stage": "snapshot stage", "checksum": "checksum stage", "write": "write stage",
            "write-direct": "write stage", "upload": "upload stage", "merge": "snapshot stage", "commit": "commit stage",
            "writer-died": "writer process exited"}[stage]
    # storage stages fail through unickpt.testing.faults (naming the operation and the path), the others by
    # a patched function (naming the stage and the rank)
    storage = {"write": f"(injected: write of {tmp_path}/run/step_2/data/{fail_rank}_",
               "write-direct": f"(injected: write of {tmp_path}/run/step_2/data/{fail_rank}_",
               "upload": f"(injected: write of {tmp_path}/remote/step_2/data/{fail_rank}_",
               "commit": f"(injected: rename of {tmp_path}/run/step_2/metadata.json)"}
    cause = "status -9" if stage == "writer-died" else storage.get(stage, f"injected {stage} failure on rank {fail_rank}")
    for r in results:
        assert r["error"] is not None and r["error"]["failures"] == [fail_rank], r["error"]
        assert name in r["error"]["text"] and cause in r["error"]["text"], r["error"]["text"][-3000:]
        assert not r["step2_committed"] and r["loaded_step"] == 1 and r["ok1"]  # the last checkpoint is intact
        assert r["ok3"]  # and the next save works
    assert results[0]["latest"] == "step_1"


def test_ranks_must_agree_on_plan_options(pool, tmp_path):
    results = pool(2).run(w.mismatched_options, str(tmp_path))
    for r in results:
        assert r.startswith("ValueError") and "ranks configured different save options" in r


def test_two_tier_upload_commits_both_copies(pool, tmp_path):
    results = pool(2).run(w.commit_and_load_remote, str(tmp_path))
    for r in results:
        # each rank's 2 MB part, and its index file (format v2: header, one record, two block checksums)
        assert r["ok"] == [True, True] and r["uploaded"] == r["written"] == 2_000_000 + 32 + 48 + 16
        assert r["files"] == ["0_0.bin", "1_0.bin"]
    assert sorted(os.listdir(tmp_path / "remote" / "ck" / "index")) == ["0.idx", "1.idx"]
    meta_local = json.load(open(tmp_path / "local" / "ck" / "metadata.json"))
    meta_remote = json.load(open(tmp_path / "remote" / "ck" / "metadata.json"))
    assert meta_local["tensors"] == meta_remote["tensors"]
