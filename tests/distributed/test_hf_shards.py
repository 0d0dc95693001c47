"""``SaveOptions.safetensors``: a group's tensors written as Hugging Face safetensors files by the
engine (one per writer, balanced, each tensor whole), read back bit for bit by ``safetensors``,
``transformers``' sharded loader and ``unickpt.load``; the plan's headers and refusals."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import hf_shards_workers as w
import unickpt
from unickpt import SaveOptions
from unickpt.format.hf_shards import HEADER_ALIGN, header, index_json, shard_name
from unickpt.geometry import Box
from unickpt.plan.save_plan import LocalPlan, make_save_plan
from unickpt.storage.local import DIRECT_ALIGN


def _replicated_plans(world: int, sizes: dict[str, tuple[int, ...]], prefix: str = "m.") -> list[LocalPlan]:
    table = {prefix + k: ("float32", s, Box((0,) * len(s), s)) for k, s in sizes.items()}
    table["opt.x"] = ("float32", (4096, 512), Box((0, 0), (4096, 512)))
    return [LocalPlan(rank=r, tensors=table) for r in range(world)]


def test_header_is_aligned_and_is_what_safetensors_reads(tmp_path):
    assert HEADER_ALIGN == DIRECT_ALIGN
    a, b = torch.randn(3, 5), torch.arange(7, dtype=torch.int16)
    head = header([("a", "float32", (3, 5), 60), ("b", "int16", (7,), 14)])
    assert len(head) % HEADER_ALIGN == 0 and struct.unpack("<Q", head[:8])[0] == len(head) - 8
    p = tmp_path / "x.safetensors"
    p.write_bytes(head + a.numpy().tobytes() + b.numpy().tobytes())
    got = load_file(str(p))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    with safe_open(str(p), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(ValueError, match=r"'z': dtype complex128 has no safetensors name"):
        header([("z", "complex128", (1,), 16)])
    assert shard_name(0, 1) == "model.safetensors" and shard_name(1, 3) == "model-00002-of-00003.safetensors"
    assert json.loads(index_json({"b": "f2", "a": "f1"}, 9)) == {"metadata": {"total_size": 9},
                                                                 "weight_map": {"a": "f1", "b": "f2"}}


def test_plan_keeps_group_tensors_whole_and_balanced_one_file_per_writer():
    sizes = {f"l{i}": (1024 + 256 * i, 512) for i in range(8)}  # 2-6 MiB each: split without the option
    plain = make_save_plan(_replicated_plans(4, sizes))
    assert any(len([c for c in plain.writes[r] if c.fqn == "m.l7"]) for r in range(4))
    assert sum(len([c for c in plain.writes[r] if c.fqn == "m.l7"]) for r in range(4)) > 1  # split by default
    plan = make_save_plan(_replicated_plans(4, sizes), safetensors="m.")
    seen = {}
    for r in range(4):
        segs = plan.segments[r]
        assert segs[0][0] == f"model-{r + 1:05d}-of-00004.safetensors"
        head = plan.head(r, 0)
        n = struct.unpack("<Q", head[:8])[0]
        doc = json.loads(head[8:8 + n])
        group = [c for c in plan.writes[r] if c.segment == 0]
        assert [c.fqn for c in group] == ["m." + k for k in doc if k != "__metadata__"]
        pos = len(head)
        for c in group:  # back to back after the header, each whole
            assert c.offset == pos and c.spec == Box((0, 0), sizes[c.fqn[2:]]) and c.fqn not in seen
            assert doc[c.fqn[2:]]["data_offsets"] == [pos - len(head), pos - len(head) + c.nbytes]
            seen[c.fqn] = r
            pos += c.nbytes
        assert segs[0][1] == pos  # the file ends at the last tensor
        assert all(c.segment > 0 for c in plan.writes[r] if not c.fqn.startswith("m."))
    assert sorted(seen) == sorted("m." + k for k in sizes)
    idx = json.loads(plan.hf_index)
    assert idx["weight_map"] == {k[2:]: f"model-{r + 1:05d}-of-00004.safetensors" for k, r in seen.items()}
    assert idx["metadata"]["total_size"] == sum(4 * a * b for a, b in sizes.values())
    group_bytes = [sum(c.nbytes for c in plan.writes[r] if c.segment == 0) for r in range(4)]
    assert max(group_bytes) <= 1.35 * sum(group_bytes) / 4  # whole tensors, least loaded first


def test_one_process_writes_model_safetensors_that_every_reader_reads(tmp_path):
    g = torch.Generator().manual_seed(3)
    weights = {"a.weight": torch.randn(300, 700, generator=g), "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
               "empty": torch.empty(0, 3), "ids": torch.arange(10), "tied": None}
    weights["tied"] = weights["a.weight"]  # tied weights: one copy in the file, as save_pretrained keeps
    # "aux" sorts before the prefix: the metadata must follow the file order (group first), not fqn order
    state = {"aux": {"v": torch.randn(64, generator=g)}, "model": weights,
             "optim": {"m": torch.randn(1000, 300, generator=g)}, "step": 3}
    for direct in (True, False):
        path = tmp_path / f"d{direct}"
        unickpt.save(path, state, options=SaveOptions(safetensors="model.", direct_io=direct))
        assert sorted(os.listdir(path)) == [".unickpt-writer", "data", "metadata.json", "model.safetensors"]
        got = load_file(str(path / "model.safetensors"))
        assert sorted(got) == ["a.weight", "b.bias", "empty", "ids"]
        for k in got:
            assert got[k].dtype == weights[k].dtype and torch.equal(got[k], weights[k]), k
        target = {"aux": {"v": torch.zeros(64)}, "model": {k: torch.zeros_like(v) for k, v in weights.items()},
                  "optim": {"m": torch.zeros(1000, 300)}, "step": 0}
        target["model"]["tied"] = target["model"]["a.weight"]
        unickpt.load(path, target)
        assert all(torch.equal(target["model"][k], v) for k, v in weights.items())
        assert torch.equal(target["optim"]["m"], state["optim"]["m"]) and target["step"] == 3
        assert torch.equal(target["aux"]["v"], state["aux"]["v"])
        assert os.path.getsize(path / "model.safetensors") == len(header(
            [("a.weight", "float32", (300, 700), 840000), ("b.bias", "bfloat16", (5,), 10), ("ids", "int64", (10,), 80),
             ("empty", "float32", (0, 3), 0)])) + 840090


def test_a_dtype_safetensors_lacks_fails_the_save_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"'model.c': dtype complex128 has no safetensors name"):
        unickpt.save(tmp_path / "c", {"model": {"c": torch.zeros(2, dtype=torch.complex128)}},
                     options=SaveOptions(safetensors="model."))
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("async_save,snapshot", [(False, "sync"), (True, "overlap")])
def test_data_parallel_save_writes_one_file_per_rank_and_the_index(pool, tmp_path, async_save, snapshot):
    results = pool(2).run(w.save_replicated, str(tmp_path), async_save, snapshot)
    files = results[0]["files"]
    assert [f for f in files if f.startswith("model")] == ["model-00001-of-00002.safetensors",
                                                            "model-00002-of-00002.safetensors",
                                                            "model.safetensors.index.json"]
    state = w._state()
    index = results[0]["index"]
    assert sorted(index["weight_map"]) == sorted(state["model"])
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state["model"].values())
    for name in set(index["weight_map"].values()):
        got = load_file(str(tmp_path / "ckpt" / name))
        assert got and all(index["weight_map"][k] == name and torch.equal(v, state["model"][k]) for k, v in got.items())
    assert all(r["loaded_equal"] for r in results)
    total = sum(v.numel() * v.element_size() for part in ("model", "optim") for v in state[part].values())
    assert sum(results[0]["bytes_per_rank"]) == total  # each replica written once
    assert max(results[0]["bytes_per_rank"]) < 0.65 * total


@pytest.mark.parametrize("world,async_save,snapshot", [(2, False, "sync"), (2, True, "overlap"), (4, True, "sync")])
def test_sharded_group_tensors_are_gathered_whole_into_one_file_each(pool, tmp_path, world, async_save, snapshot):
    """DTensor shards (Shard(0), Shard(1), uneven rows, a 2-d mesh on 4 ranks) under the prefix: each tensor is
    received whole by one writer, point to point, and written into its safetensors file; safetensors reads the
    full tensors bitwise and unickpt.load gives every rank its shard back."""
    out = pool(world).run(w.save_sharded, str(tmp_path), async_save, snapshot)
    assert all(o["loaded_equal"] for o in out)
    files = out[0]["files"]
    shards = [f for f in files if f.endswith(".safetensors")]
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert len(shards) >= 2  # the gathered tensors are spread over writers
    got: dict = {}
    for name in shards:
        part = load_file(str(tmp_path / "ckpt" / name))
        assert not set(part) & set(got)  # each tensor in one file
        got.update(part)
    g = torch.Generator().manual_seed(5)
    full = {"rows": torch.randn(8 * world, 33, generator=g), "cols": torch.randn(17, 4 * world, generator=g),
            "uneven": torch.randn(2 * world + 1, 5, generator=g).to(torch.bfloat16),
            "replicated": torch.randn(70, 9, generator=g), "grid": torch.randn(12, 8, generator=g)}
    assert sorted(got) == sorted(full)
    for k, v in full.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert sorted(out[0]["index"]["weight_map"]) == sorted(full)
    assert sum(o["p2p_recvs"] for o in out) > 0 and sum(o["p2p_sends"] for o in out) == sum(o["p2p_recvs"] for o in out)


def test_a_tie_across_the_prefix_and_a_prefix_without_a_dot_are_refused(tmp_path):
    t = torch.randn(4, 4)
    for state in ({"a": {"x": t}, "model": {"y": t}}, {"model": {"y": t}, "a": {"x": t}}):
        with pytest.raises(ValueError, match=r"is the same tensor as .* outside 'model\.'"):
            unickpt.save(tmp_path / "tie", state, options=SaveOptions(safetensors="model."))
    with pytest.raises(ValueError, match=r"safetensors must be an fqn prefix ending with '\.'.*got 'model'"):
        SaveOptions(safetensors="model").validated()


def test_link_safetensors_puts_the_committed_files_into_a_folder_and_drops_stale_names(tmp_path):
    from unickpt.lifecycle.directory import CheckpointDir

    dest = tmp_path / "folder"
    dest.mkdir()
    for stale in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        (dest / stale).write_bytes(b"an earlier save on two processes")
    (dest / "model_1.safetensors").write_bytes(b"the user's")  # not a name of the option: kept
    w = {"a": torch.randn(64, 3), "b": torch.arange(5)}
    ckpt = tmp_path / "step_0"
    unfinished = CheckpointDir.open(str(tmp_path / "never"))
    with pytest.raises(FileNotFoundError, match="not a committed checkpoint"):
        unfinished.link_safetensors(str(dest))
    unickpt.save(ckpt, {"model": w, "o": torch.ones(3)}, options=SaveOptions(safetensors="model."))
    assert CheckpointDir.open(str(ckpt)).link_safetensors(str(dest)) == ["model.safetensors"]
    assert sorted(os.listdir(dest)) == ["model.safetensors", "model_1.safetensors"]
    assert os.path.samefile(dest / "model.safetensors", ckpt / "model.safetensors")  # a link, no copy
    got = load_file(str(dest / "model.safetensors"))
    assert sorted(got) == ["a", "b"] and all(torch.equal(got[k], w[k]) for k in w)
    import shutil

    shutil.rmtree(ckpt)  # the checkpoint goes (retention): the folder's names still read the weights
    assert torch.equal(load_file(str(dest / "model.safetensors"))["a"], w["a"])


def test_link_safetensors_replaces_nothing_when_a_link_fails(tmp_path, monkeypatch):
    """All new links are made before any name is replaced: a failing link (EMLINK, another device) leaves
    the folder's names as they were and no temporary behind."""
    import errno

    from unickpt.lifecycle.directory import CheckpointDir

    dest = tmp_path / "folder"
    dest.mkdir()
    for step, value in ((0, 1.0), (1, 2.0)):
        weights = {"a": torch.full((8, 4), value), "b": torch.full((3,), value)}
        unickpt.save(tmp_path / f"s{step}", {"model": weights}, options=SaveOptions(safetensors="model."))
    CheckpointDir.open(str(tmp_path / "s0")).link_safetensors(str(dest))
    before = sorted(os.listdir(dest))
    calls = []
    real_link = os.link

    def failing_link(src, dst, *args, **kwargs):
        calls.append(dst)
        if len(calls) == 1:
            raise OSError(errno.EMLINK, "Too many links")
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", failing_link)
    with pytest.raises(OSError, match="Too many links"):
        CheckpointDir.open(str(tmp_path / "s1")).link_safetensors(str(dest))
    assert sorted(os.listdir(dest)) == before  # no temporary left, nothing replaced
    assert torch.equal(load_file(str(dest / "model.safetensors"))["a"], torch.full((8, 4), 1.0))
