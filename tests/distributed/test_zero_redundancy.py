"""Zero-redundancy loading: each stored byte is read from storage once across the job (bytes counted
by the storage layer), the rest travels over the process group; bounded read buffers; failures."""
from __future__ import annotations

import os

import pytest

import load_workers as lw
from unickpt.tools.reader import CheckpointReader

TENSOR_BYTES = 2 * lw.N * 64 * 4 + 1000 * 8


@pytest.fixture(scope="module")
def ckpt(pool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zr") / "ckpt")
    pool(4).run(lw.save_rows, path)
    assert pool(1).run(lw.data_bytes, path) == [TENSOR_BYTES]
    return path


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("verify", [False, True])
def test_replicated_load_reads_each_byte_once(pool, ckpt, m, verify):
    results = pool(m).run(lw.load, ckpt, "replicated", verify)
    assert all(r["ok"] and r["redistributed"] for r in results)
    assert sum(r["bytes_read"] for r in results) == TENSOR_BYTES  # not m x
    assert sum(r["reads"] for r in results) == 9  # one coalesced request per stored chunk (4 + 4 + 1)
    assert sum(r["bytes_sent"] for r in results) == sum(r["bytes_received"] for r in results)
    assert all(r["bytes_received"] == TENSOR_BYTES - r["bytes_read"] for r in results)
    shares = [r["bytes_read"] for r in results]
    assert max(shares) <= 1.6 * TENSOR_BYTES / m  # readers balanced (chunks are 192-768 KiB)


@pytest.mark.parametrize("m", [2, 3, 4])
def test_column_resharding_reads_only_needed_bytes(pool, ckpt, m):
    results = pool(m).run(lw.load, ckpt, "cols", False)
    assert all(r["ok"] for r in results)
    # every needed byte of a and b is needed by exactly one rank (at m=3 column 63 by none), v by all
    needed = 2 * lw.N * (64 // m * m) * 4 + 1000 * 8
    assert sum(r["bytes_read"] for r in results) == needed
    assert sum(r["bytes_received"] for r in results) == (m - 1) * 1000 * 8  # only v travels


def test_verified_partial_reads_are_block_aligned_and_still_once(pool, ckpt):
    results = pool(2).run(lw.load, ckpt, "cols", True)
    assert all(r["ok"] for r in results)
    # chunks are < 1 MiB: verification needs them whole, but each is still read by one rank only
    assert sum(r["bytes_read"] for r in results) == TENSOR_BYTES
    assert sum(r["blocks_verified"] for r in results) == 4 * 2 + 1


def test_empty_shards_and_ranks_that_need_nothing(pool, ckpt):
    results = pool(3).run(lw.load, ckpt, "empty_rank", False)
    assert all(r["ok"] for r in results)
    assert sum(r["bytes_read"] for r in results) == TENSOR_BYTES and sum(r["reads"] for r in results) == 9
    assert results[2]["bytes_read"] <= 1000 * 8  # the empty rank reads at most the shared vector
    results = pool(2).run(lw.load_nothing_on_rank1, ckpt)
    assert all(r["ok"] for r in results)
    assert results[1]["bytes_read"] == 0 and results[1]["bytes_received"] == 0
    assert results[0]["bytes_read"] == 1000 * 8


def test_read_plan_is_cached_for_repeated_loads(pool, ckpt):
    first = pool(2).run(lw.load, ckpt, "cols", False)
    again = pool(2).run(lw.load, ckpt, "cols", False)
    assert all(r["plan_cache_hit"] for r in again)
    assert [r["bytes_read"] for r in again] == [r["bytes_read"] for r in first]


def test_whole_chunk_targets_are_read_in_place(pool, ckpt):
    """Replicated targets take whole chunks: bytes land straight in the caller's tensors (no buffer)."""
    results = pool(2).run(lw.load, ckpt, "replicated", True)
    assert all(r["ok"] and r["peak_buffer_bytes"] == 0 for r in results)


def test_read_buffer_is_bounded(pool, ckpt):
    # chunks are 192 KiB (a, b at 4 ranks) and 8000 B (v): a 400 KiB budget forces several rounds
    results = pool(2).run(_load_with_budget, ckpt, 400 * 1024)
    for r in results:
        assert r["ok"] and r["rounds"] >= 3 and 0 < r["peak_buffer_bytes"] <= 400 * 1024


def _load_with_budget(path: str, budget: int) -> dict:
    return lw.load(path, "cols", False, read_buffer_bytes=budget)  # column targets need buffers (not direct reads)


def test_local_single_host_default_reads_directly(pool, ckpt):
    """Default policy on one host with local storage: each rank reads its own needs (the page cache
    dedups device reads); nothing travels over the group."""
    results = pool(2).run(lw.load, ckpt, "replicated", False, None)
    assert all(r["ok"] and not r["redistributed"] for r in results)
    assert [r["bytes_read"] for r in results] == [TENSOR_BYTES, TENSOR_BYTES]
    assert all(r["bytes_received"] == r["bytes_sent"] == 0 for r in results)


def test_one_reader_failing_fails_every_rank_the_same_way(pool, tmp_path):
    path = str(tmp_path / "c")
    pool(4).run(lw.save_rows, path)
    chunk = CheckpointReader(path).tensor_meta("a").chunks[2]  # format v2: rank 2's part, from its index
    with open(os.path.join(path, chunk.file), "r+b") as f:
        f.seek(chunk.byte_offset + 10)
        byte = f.read(1)
        f.seek(chunk.byte_offset + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    for redistribute in (True, False):
        results = pool(2).run(lw.load_expecting_error, path, redistribute)
        for r in results:
            assert r.startswith("IntegrityError:") and "checksum" in r, r
