"""unickpt.fsdp.StorageWriter / StorageReader under DCP's contract (as FileSystemWriter / Reader):
overwriting, several ShardedTensor shards per rank, the process group and modes of dcp.save /
dcp.load, FSDP1 optimizer state across world sizes. Real gloo process groups (DistPool)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import dcp_workers as d
from test_fsdp import assert_same

pytestmark = pytest.mark.timeout(600)


def test_overwrite_replaces_at_commit_and_keeps_other_files(pool, tmp_path):
    """Like FileSystemWriter: a second save to the path replaces the first (no CheckpointExistsError),
    a file of the user's in the directory stays, a failed save leaves the committed checkpoint
    loadable, overwrite=False refuses, and the replaced save's files are removed."""
    path = str(tmp_path / "ckpt")
    res = pool(2).run(d.overwrite_run, path)
    for r in res:
        assert r["first"] == r["want1"] and r["second"] == r["want2"], r
        assert r["after_failure"] == r["want2"] and r["after_refused"] == r["want2"]
        assert r["failed"] is not None and "rank 1 failed: AttributeError: Can't pickle local object" in r["failed"]
        assert r["refused"] == (f"CheckpointException: unickpt.errors.CheckpointExistsError: {path!r} already holds "
                                "a committed checkpoint and the writer has overwrite=False") or \
            r["refused"].endswith(f"CheckpointExistsError: {path!r} already holds a committed checkpoint and the "
                                  "writer has overwrite=False"), r["refused"]
        assert r["notes"] == "not a checkpoint file"
        assert len(r["gens_after_two"]) == 1  # the first save's generation was removed at the second commit
    assert res[0]["files"] == [".unickpt-dcp", "metadata.json", "notes.txt"]
    meta = json.load(open(os.path.join(path, "metadata.json")))
    gen = meta["extra"]["dcp"]["generation"]
    assert gen == ".unickpt-dcp/" + res[0]["gens_after_two"][0]
    assert all(c["file"].startswith(gen + "/data/") for t in meta["tensors"].values() for c in t.get("chunks", []))
    if meta["format_version"] == 2:  # split tensors' data and index files are in the generation too
        assert meta["index"]["prefix"] == gen
    assert os.listdir(os.path.join(path, ".unickpt-dcp")) == res[0]["gens_after_two"]  # the failed save's are gone


def test_unickpt_load_and_verify_of_an_overwritten_checkpoint(pool, tmp_path):
    """The replaced checkpoint is an ordinary unickpt checkpoint: unickpt.load and verify read it."""
    import unickpt
    from unickpt.tools.verify import verify_checkpoint

    path = str(tmp_path / "ckpt")
    pool(2).run(d.overwrite_run, path)
    state = {"w": torch.zeros(6, 3), "rep": torch.zeros(5), "step": -1}
    unickpt.load(path, state)  # a world of one here: the 6x3 tensor as saved (rank 0's rows, DCP dedup)
    assert state["step"] == 2 and torch.equal(state["rep"], torch.arange(5.0) * 2)
    problems, checked = verify_checkpoint(path)
    assert problems == [] and checked > 0


def test_overwrite_a_dcp_directory(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    res = pool(2).run(d.overwrite_dcp_dir_run, path)
    assert res[0]["w"] == [7.0] * 4 and res[1]["w"] == [7.0] * 4
    assert {".metadata", "metadata.json", ".unickpt-dcp"} <= set(res[0]["files"])


@pytest.mark.parametrize("save_kind,load_kind", [("interleaved", "rows"), ("rows", "interleaved"),
                                                 ("uneven3", "interleaved"), ("interleaved", "uneven3")])
def test_sharded_tensor_with_several_local_shards(pool, tmp_path, save_kind, load_kind):
    """A ShardedTensor with several shards on one rank saves, and loads bitwise into another sharding
    and into a plain tensor."""
    path = str(tmp_path / f"{save_kind}-{load_kind}")
    res = pool(2).run(d.multi_shard_run, path, save_kind, load_kind)
    for r in res:
        assert r["bad_shards"] == [] and r["as_tensor_equal"] and r["plain_equal"], r
    assert max(r["local_shards_saved"] for r in res) == {"interleaved": 2, "rows": 1, "uneven3": 3}[save_kind]
    meta = json.load(open(os.path.join(path, "metadata.json")))
    if save_kind != "rows":
        assert meta["extra"]["dcp"]["chunked"] == {"st": [12, 5]}
        assert "st" not in meta["tensors"] and any(k.startswith("__dcp_chunk__.") for k in meta["tensors"])


def test_no_dist_does_not_wait_for_the_other_ranks(pool, tmp_path):
    """no_dist=True with a world process group: each rank saves and loads alone (it used to wait for
    the others in a collective until the timeout)."""
    res = pool(2).run(d.no_dist_run, str(tmp_path))
    assert [(r["equal"], r["step"]) for r in res] == [(True, 0), (True, 1)]


def test_use_collectives_false(pool, tmp_path):
    """use_collectives=False: every rank its own checkpoint under the path, read back by dcp.load."""
    res = pool(2).run(d.no_collectives_run, str(tmp_path / "ckpt"))
    assert all(r["equal"] for r in res), res
    assert res[0]["files"] == [".unickpt-rank-0", ".unickpt-rank-1"]


def test_process_group_given_to_dcp_only(pool, tmp_path):
    """A group of ranks 0 and 1 of 3 passed to dcp.save / dcp.load only: rank 2 takes no part."""
    res = pool(3).run(d.subgroup_run, str(tmp_path / "ckpt"))
    assert res[2] == {"skipped": True}
    assert res[0]["w"] == res[1]["w"] == [100.0, 101.0, 102.0, 103.0]
    assert res[0]["step"] == res[1]["step"] == 5


def test_this_process(pool, tmp_path):
    """process_group=THIS_PROCESS: rank 0 saves and loads alone (it crashed in the plain-value gather)."""
    res = pool(2).run(d.this_process_run, str(tmp_path / "ckpt"))
    assert res[0] == {"w": [0.0, 1.0, 2.0, 3.0, 4.0], "step": 7, "cfg": {"lr": 0.5, "name": "x"}}


def test_fsdp1_optimizer_saved_on_2_loaded_on_3(pool, tmp_path):
    """FSDP1 model + AdamW from get_state_dict, dcp.save through StorageWriter on 2 ranks, dcp.load
    through StorageReader on 3, bitwise. (It failed with "Missing key in checkpoint state_dict:
    optim.param_groups": DCP's planner falls back to torch 2.3 keys when the checkpoint has keys a
    rank's state lacks. DCP's own FileSystemReader fails the same way, checked here too.)"""
    path = str(tmp_path / "unickpt")
    ref = pool(2).run(d.fsdp1_save, path, False)[0]["saved"]
    res = pool(3).run(d.fsdp1_load, path, False)
    assert [r["error"] for r in res] == [None, None, None]
    assert_same(ref, res[0]["loaded"], "FSDP1 dcp.save on 2 -> dcp.load on 3 via unickpt")
    native = str(tmp_path / "native")
    pool(2).run(d.fsdp1_save, native, True)
    errors = {r["error"] for r in pool(3).run(d.fsdp1_load, native, True)}
    assert errors == {"CheckpointException: RuntimeError: Missing key in checkpoint state_dict: optim.param_groups."}


def test_async_save_group_given_to_async_save_only(pool, tmp_path):
    res = pool(2).run(d.async_group_run, str(tmp_path / "ckpt"))
    for r in res:
        assert r == {"created_on_caller": True, "w": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "step": 2}, r


def test_a_dcp_save_over_a_checkpoint_written_into_the_path_removes_its_files(tmp_path):
    """A path holding a checkpoint unickpt.save wrote into the path itself (no generation): a DCP save
    there commits its generation, then removes the old checkpoint's data files (read once, parsed as far
    as needed); a file of the user's stays."""
    import torch.distributed.checkpoint as dcp

    import unickpt
    import unickpt.fsdp

    path = tmp_path / "ckpt"
    unickpt.save(str(path), {"w": torch.arange(4.0), "old": torch.ones(3)})
    old_files = sorted(os.listdir(path / "data"))
    (path / "notes.txt").write_text("mine")
    dcp.save({"w": torch.arange(4.0) * 2}, storage_writer=unickpt.fsdp.StorageWriter(str(path)), no_dist=True)
    assert not any((path / "data" / f).exists() for f in old_files)
    assert sorted(os.listdir(path)) == [".unickpt-dcp", "metadata.json", "notes.txt"]
    t = {"w": torch.zeros(4)}
    dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(str(path)), no_dist=True)
    assert torch.equal(t["w"], torch.arange(4.0) * 2)
