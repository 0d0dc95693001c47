"""Format v2 on real gloo process groups: a save where each rank holds its torch.chunk part of every
tensor (FSDP2's layout) writes split tensors and per-writer index files; loads into the same and
other worlds and layouts, with and without redistribution, are bitwise; the tools read it; damaged
index files fail every rank with IntegrityError."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import format_v2_workers as w
from unickpt.format.index import HEADER, RECORD
from unickpt.tools.cli import main
from unickpt.tools.reader import CheckpointReader
from unickpt.tools.verify import verify_checkpoint

WORLD = 4


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v2") / "ckpt")
    pool(WORLD).run(w.save, path)
    return path


def test_a_split_layout_is_saved_as_rules_and_index_files(saved):
    meta = json.load(open(os.path.join(saved, "metadata.json")))
    assert meta["format_version"] == 2
    assert meta["index"] == {"writers": WORLD, "slots": 4, "block_bytes": 1 << 20, "max_blocks": 32}
    splits = {f: t["split"] for f, t in meta["tensors"].items() if "split" in t}
    assert splits == {"big": {"dim": 0, "parts": 4, "slot": 0}, "c": {"dim": 1, "parts": 4, "slot": 1},
                      "k": {"dim": 0, "parts": 4, "slot": 2}, "w": {"dim": 0, "parts": 4, "slot": 3}}
    assert {f for f, t in meta["tensors"].items() if "chunks" in t} == {"flat", "rep", "step"}
    assert sorted(os.listdir(os.path.join(saved, "index"))) == [f"{r}.idx" for r in range(WORLD)]
    for r in range(WORLD):  # a fixed table of 4 records, then 8 bytes per block checksum (big: 3 blocks)
        size = os.path.getsize(os.path.join(saved, "index", f"{r}.idx"))
        assert size == HEADER.size + 4 * RECORD.size + 8 * 3
    reader = CheckpointReader(saved)
    # torch.chunk semantics: 9 columns in 4 parts of 3 (the last empty), 3 rows in parts of 1
    assert [len(reader.tensor_meta(f).chunks) for f in ("w", "c", "k", "big")] == [4, 3, 3, 4]
    for fqn, want in w.full().items():
        got = reader.read(fqn)
        assert got.dtype == want.dtype and torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
    assert verify_checkpoint(saved)[0] == []


def test_inspect_shows_split_tensors_without_reading_index_files(saved, capsys):
    main(["inspect", saved])
    out = capsys.readouterr().out
    assert "unickpt v2" in out and "4 (split dim 0 / 4)" in out and "3 (split dim 1 / 4)" in out
    main(["inspect", saved, "--chunks"])
    out = capsys.readouterr().out
    assert "big  Box(offsets=(525, 0), lengths=(525, 1000))  data/1_0.bin@0+2100000" in out


@pytest.mark.parametrize("world", [4, 3, 2, 1])
@pytest.mark.parametrize("layout", ["split", "uneven"])
@pytest.mark.parametrize("redistribute", [False, True])
def test_loads_are_bitwise_into_any_world_and_layout(pool, saved, world, layout, redistribute):
    results = pool(world).run(w.load, saved, layout, redistribute)
    for rank, res in enumerate(results):
        bad = [k for k, ok in res["ok"].items() if not ok]
        assert not bad, f"{world} ranks, {layout}, redistribute={redistribute}: rank {rank} got wrong {bad}"
    if redistribute and world > 1:  # every stored byte needed is read once, job-wide
        total = sum(t.numel() * t.element_size() for t in w.full().values())
        assert sum(r["bytes_read"] for r in results) == total
        assert all(r["index_bytes_read"] > 0 for r in results)  # each rank read its parts' records only
        assert sum(r["index_bytes_read"] for r in results) < WORLD * world * (HEADER.size + 4 * RECORD.size + 24)


def test_a_damaged_index_fails_every_rank_and_verify_names_it(pool, saved, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(saved, bad)
    idx = os.path.join(bad, "index", "2.idx")
    data = bytearray(open(idx, "rb").read())
    data[-3] ^= 0xFF  # a block checksum of big's part 2
    open(idx, "wb").write(bytes(data))
    errors = pool(WORLD).run(w.load_error, bad)
    assert all(e.startswith("IntegrityError:") for e in errors), errors
    assert any("have checksum" in e and "data/2_0.bin" in e for e in errors), errors
    problems, _ = verify_checkpoint(bad)
    assert [(p.file, p.key) for p in problems] == [("data/2_0.bin", "big")]
    os.remove(idx)
    errors = pool(WORLD).run(w.load_error, bad)
    assert all(e.startswith("IntegrityError:") and "index file 'index/2.idx' is missing" in e for e in errors), errors
    assert [p.key for p in verify_checkpoint(bad)[0]] == ["big", "c", "k", "w"]
