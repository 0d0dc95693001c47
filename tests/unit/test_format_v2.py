"""Format v2 without a process group: even splits (torch.chunk's semantics), their detection, the
per-writer index files, split save plans that cost O(tensors), the metadata's validation, and the
committed version-1 fixture (written by the code before format v2) loading bitwise."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import unickpt
from unickpt.errors import FormatVersionError, IntegrityError
from unickpt.format.index import HEADER, RECORD, IndexReader, IndexRecord, encode_index
from unickpt.format.metadata import CheckpointMetadata
from unickpt.geometry import Box, EvenSplit, FlatRange, SplitIndex, check_exact_cover
from unickpt.plan.save_plan import LocalPlan, make_global_plan, make_save_plan
from unickpt.storage import open_storage
from unickpt.tools.reader import CheckpointReader

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "format_v1_ws2")


@pytest.mark.parametrize("n", [1, 5, 7, 16, 17, 100])
@pytest.mark.parametrize("parts", [2, 3, 4, 8, 16, 33])
def test_even_split_is_torch_chunk(n, parts):
    chunks = torch.arange(n).chunk(parts)
    split = EvenSplit(0, parts)
    got = [split.bounds((n, 3), k) for k in range(parts)]
    want = [(int(c[0]), int(c[-1]) + 1) for c in chunks] + [(n, n)] * (parts - len(chunks))
    assert got == want
    assert split.nonempty((n, 3)) == len(chunks)
    check_exact_cover("t", (n, 3), [b for k in range(parts) if (b := split.part((n, 3), k)) is not None])
    for lo in range(n):  # the parts a row range overlaps, by arithmetic
        for hi in (lo + 1, min(n, lo + 3), n):
            assert list(split.parts_between((n, 3), lo, hi)) == [k for k, (a, b) in enumerate(got) if a < hi and lo < b]
    index = SplitIndex((n, 3), split)
    box = Box((n // 3, 1), (max(1, n // 2), 2))
    assert [k for k, _, _ in index.overlapping(box)] == list(split.parts_between((n, 3), box.offsets[0],
                                                                                 box.offsets[0] + box.lengths[0]))


def test_detect_finds_the_ranks_part_of_a_split_of_the_group_only():
    shape = (10, 4)
    for r in range(4):
        assert EvenSplit.detect(shape, EvenSplit(0, 4).part(shape, r), r, 4) == EvenSplit(0, 4)
        assert EvenSplit.detect(shape, EvenSplit(1, 4).part(shape, r), r, 4) == EvenSplit(1, 4)
    assert EvenSplit.detect((3, 4), None, 3, 4) is None  # trailing rank: its part is empty, it declares nothing
    assert EvenSplit.detect(shape, Box((0, 0), (10, 4)), 0, 4) is None  # replicated
    assert EvenSplit.detect(shape, Box((0, 0), (3, 4)), 1, 4) is None  # another rank's part
    assert EvenSplit.detect(shape, FlatRange(0, 10), 0, 4) is None
    assert EvenSplit.detect(shape, Box((0, 0), (10, 4)), 0, 1) is None  # one rank: nothing to gain
    assert EvenSplit.detect((), Box((), ()), 0, 2) is None and EvenSplit.detect((0, 4), None, 1, 2) is None


def test_index_file_records_read_by_range_and_whole(tmp_path):
    records = {0: IndexRecord(0, 0, 100, "xxh3_64:00000000000000ff"),
               2: IndexRecord(1, 4096, 3 << 20, "xxh3_64:0123456789abcdef",
                              tuple(f"xxh3_64:{i:016x}" for i in range(3)), 1 << 20),
               4: IndexRecord(0, 100, 7, "xxh3_64:ffffffffffffffff")}
    data = encode_index(5, 6, records)
    assert len(data) == HEADER.size + 6 * RECORD.size + 3 * 8
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "5.idx").write_bytes(data)
    storage = open_storage(str(tmp_path))
    assert IndexReader(storage, str(tmp_path)).records(5, [4, 2, 0]) == records
    storage = open_storage(str(tmp_path))
    assert IndexReader(storage, str(tmp_path)).records(5, [4, 2]) == {2: records[2], 4: records[4]}
    # ranged: the header, the records of slots 2..4, their block checksums; nothing else
    assert storage.bytes_read == HEADER.size + 3 * RECORD.size + 3 * 8
    assert IndexReader(storage, str(tmp_path), whole_files=True).records(5, [1, 3]) == {
        1: IndexRecord(0, 0, 0, "xxh3_64:0000000000000000"), 3: IndexRecord(0, 0, 0, "xxh3_64:0000000000000000")}
    with pytest.raises(IntegrityError, match="has 6 records, metadata.json names slot 6"):
        IndexReader(storage, str(tmp_path)).records(5, [6])
    # a header whose record count is not metadata.json's index.slots (a flipped count byte)
    assert IndexReader(storage, str(tmp_path), slots=6).records(5, [4]) == {4: records[4]}
    with pytest.raises(IntegrityError, match=r"index/5.idx: its header says 6 records, metadata.json's index.slots 7"):
        IndexReader(storage, str(tmp_path), slots=7).records(5, [4])
    with pytest.raises(IntegrityError, match="not a unickpt index file of rank 4"):
        shutil.copy(tmp_path / "index" / "5.idx", tmp_path / "index" / "4.idx")
        IndexReader(storage, str(tmp_path)).records(4, [0])
    (tmp_path / "index" / "5.idx").write_bytes(data[:-5])
    with pytest.raises(IntegrityError, match="truncated index file"):
        IndexReader(storage, str(tmp_path)).records(5, [2])
    with pytest.raises(IntegrityError, match="index file 'index/7.idx' is missing"):
        IndexReader(storage, str(tmp_path)).records(7, [0])


def _fsdp_plans(world: int, shapes: dict) -> list[LocalPlan]:
    shared = {f: ("float32", s, EvenSplit(0, world)) for f, s in shapes.items()}
    shared["step"] = ("float32", (), Box((), ()))  # replicated 0-d, like Adam's step
    return [LocalPlan(rank=r, tensors=shared) for r in range(world)]


@pytest.mark.parametrize("world", [2, 8, 64, 512])
def test_split_save_plan_lists_no_part_and_gives_every_rank_its_own(world):
    shapes = {"w": (1000, 3), "k": (5, 4), "b": (world * 3 + 1,)}
    plan = make_save_plan(_fsdp_plans(world, shapes))
    assert list(plan.splits) == ["b", "k", "w"] and [s for _, s in plan.splits.values()] == [0, 1, 2]
    gp = make_global_plan(_fsdp_plans(world, shapes))
    assert [(c.fqn, c.spec) for c in gp.chunks] == [("step", Box((), ()))]  # only the explicit chunk
    for r in sorted({0, 1, world // 2, world - 1}):
        mine = [(c.fqn, c.spec, c.slot, c.nbytes) for c in plan.writes[r]]
        want = [(f, EvenSplit(0, world).part(s, r), slot, EvenSplit(0, world).part(s, r).numel * 4)
                for f, (s, slot) in zip(sorted(shapes), [(shapes[f], i) for i, f in enumerate(sorted(shapes))])
                if EvenSplit(0, world).part(s, r) is not None]
        assert [m for m in mine if m[0] != "step"] == want
        offsets = [c.offset for c in plan.writes[r]]  # packed back to back
        assert offsets == [sum(c.nbytes for c in plan.writes[r][:i]) for i in range(len(offsets))]
    # bytes per rank by arithmetic equal the parts' sizes, and the one explicit chunk
    want = [sum(EvenSplit(0, world).part(s, r).numel * 4 for s in shapes.values()
                if EvenSplit(0, world).part(s, r) is not None) for r in range(world)]
    writer = next(r for r in range(world) if plan.explicit[r])
    want[writer] += 4
    assert plan.bytes_per_rank == want and plan.explicit[writer] == [("step", Box((), ()), 4)]
    if world <= 8:
        assert [sum(c.nbytes for c in plan.writes[r]) for r in range(world)] == want


def test_a_split_only_some_ranks_declare_is_planned_as_boxes():
    # rank 0's shard of a one-row tensor is the whole tensor (part 0 of 2), rank 1 holds it too: replicas
    plans = [LocalPlan(rank=0, tensors={"x": ("float32", (1, 4), EvenSplit(0, 2))}),
             LocalPlan(rank=1, tensors={"x": ("float32", (1, 4), Box((0, 0), (1, 4)))})]
    gp = make_global_plan(plans)
    assert not gp.splits and [(c.spec, c.writer) for c in gp.chunks] == [(Box((0, 0), (1, 4)), 0)]
    assert gp.replicas == [("x", Box((0, 0), (1, 4)), (0, 1))]
    with pytest.raises(ValueError, match="cover 4 of 8 elements"):  # half of the tensor: no one holds part 1
        make_global_plan([LocalPlan(rank=0, tensors={"x": ("float32", (2, 4), EvenSplit(0, 2))}),
                          LocalPlan(rank=1, tensors={"x": ("float32", (2, 4), None)})])


def _v2_doc() -> dict:
    return {"format": "unickpt", "format_version": 2, "tensors": {
        "w": {"dtype": "float32", "shape": [10, 4], "split": {"dim": 0, "parts": 4, "slot": 0}}},
        "aliases": {}, "state_tree": {}, "per_rank": {},
        "index": {"writers": 4, "slots": 1, "block_bytes": 1 << 20, "max_blocks": 32}}


def test_v2_metadata_round_trips_and_rejects_what_does_not_fit():
    meta = CheckpointMetadata.from_json(json.dumps(_v2_doc()))
    assert meta.format_version == 2 and meta.tensors["w"].split == EvenSplit(0, 4) and meta.tensors["w"].slot == 0
    assert meta.tensors["w"].specs() == [EvenSplit(0, 4).part((10, 4), k) for k in range(4)]
    assert meta.tensors["w"].nbytes == 160
    assert json.loads(meta.to_json())["tensors"] == _v2_doc()["tensors"]
    with pytest.raises(IntegrityError, match="read the metadata with read_metadata"):
        meta.tensors["w"].chunks  # noqa: B018 - parsed without storage: no index to list parts from
    for key, value in [("dim", 2), ("parts", 5), ("parts", 1), ("slot", 1)]:
        doc = _v2_doc()
        doc["tensors"]["w"]["split"][key] = value
        with pytest.raises(IntegrityError, match="malformed metadata .* does not fit"):
            CheckpointMetadata.from_json(json.dumps(doc))
    doc = _v2_doc()
    doc["format_version"] = 3
    with pytest.raises(FormatVersionError, match="format_version 3 is not supported .* reads versions 1, 2"):
        CheckpointMetadata.from_json(json.dumps(doc))


def _fixture_tensors() -> dict[str, torch.Tensor]:
    """What tests/fixtures/format_v1_ws2 holds (see its README)."""
    return {"model.rows": torch.arange(24, dtype=torch.float32).reshape(6, 4),
            "model.cols": torch.arange(12, dtype=torch.float64).reshape(3, 4) / 7,
            "model.flat": (torch.arange(21, dtype=torch.float32).reshape(3, 7) / 3).to(torch.bfloat16),
            "model.bias": torch.arange(5, dtype=torch.int32),
            "step": torch.tensor(3.0)}


def test_the_committed_v1_fixture_loads_bitwise(tmp_path):
    meta = json.loads(open(os.path.join(FIXTURE, "metadata.json")).read())
    assert meta["format_version"] == 1 and not os.path.exists(os.path.join(FIXTURE, "index"))
    want = _fixture_tensors()
    reader = CheckpointReader(FIXTURE)
    for fqn, t in want.items():
        got = reader.read(fqn)
        assert got.dtype == t.dtype and torch.equal(got.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), fqn
    state = {"model": {k.split(".")[1]: torch.zeros_like(v) for k, v in want.items() if k.startswith("model.")},
             "step": torch.tensor(0.0), "note": None}
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    unickpt.load(str(tmp_path / "ckpt"), state)
    for fqn, t in want.items():
        a, b = fqn.split(".") if "." in fqn else (fqn, None)
        got = state[a][b] if b else state[a]
        assert torch.equal(got.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), fqn
    assert state["note"] == "written by unickpt before format v2"
