"""unickpt.fsdp: FSDP1 (flat parameters, both use_orig_params modes, SHARDED / FULL state dicts) and
FSDP2 saved on 4 ranks, loaded on 1-4 ranks and across flavours, bitwise; on real gloo groups."""
from __future__ import annotations

import json
import os

import pytest
import torch

import fsdp_workers as w
from unickpt.tools.reader import CheckpointReader

pytestmark = pytest.mark.timeout(900)
OTHER = {"fsdp1": "fsdp2", "fsdp1_orig": "fsdp1", "fsdp2": "fsdp1_orig"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def assert_same(want: dict, got: dict, label: str) -> None:
    """Every tensor bitwise equal (dtype and shape too), the param groups equal, the same keys."""
    assert set(want) == set(got), f"{label}: keys differ: {sorted(set(want) ^ set(got))}"
    bad = []
    for k, x in want.items():
        y = got[k]
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
                bad.append(k)
        elif k == "param_groups":  # the order of a group's params follows the flavour's parameter order
            if [{**g, "params": sorted(g["params"])} for g in x] != [{**g, "params": sorted(g["params"])} for g in y]:
                bad.append(k)
        elif x != y:
            bad.append(k)
    assert not bad, f"{label}: values differ for {bad}"


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    """Each flavour trained 2 steps and saved on 4 ranks: ``{flavour: (path, rank 0's result)}``."""
    root = tmp_path_factory.mktemp("fsdp")
    out = {}
    for flavour in w.FLAVOURS:
        path = str(root / flavour)
        out[flavour] = (path, pool(4).run(w.save_run, path, flavour)[0])
    return out


def test_saved_fsdp1_flat_ranges_on_disk(saved):
    """FSDP1 parameters and moments are stored as the ranks' flat ranges; the tied weight once."""
    meta = json.load(open(os.path.join(saved["fsdp1"][0], "metadata.json")))
    chunks = meta["tensors"]["model.l1.weight"]["chunks"]
    assert chunks and all("flat_start" in c for c in chunks)
    assert sum(c["flat_length"] for c in chunks) == 7 * 6
    assert meta["aliases"] == {"model.head.weight": "model.emb.weight"}
    assert "optim.state.frozen.weight.exp_avg" not in meta["tensors"]  # frozen: no optimizer state
    assert meta["tensors"]["optim.state.tiny.weight.exp_avg"]["shape"] == [1, 1]


@pytest.mark.parametrize("flavour", w.FLAVOURS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_save_on_4_load_on_n(pool, saved, flavour, n):
    """Loaded into the same flavour and into another one, bitwise equal to the saved state."""
    path, ref = saved[flavour]
    results = pool(n).run(w.load_run, path, [flavour, OTHER[flavour]])[0]
    for res in results:
        assert res["step"] == 2
        assert_same(ref["saved"], res["loaded"], f"{flavour} on 4 -> {res['flavour']} on {n}")


@pytest.mark.parametrize("flavour", w.FLAVOURS)
def test_step_after_load_matches_uninterrupted(pool, saved, flavour):
    path, ref = saved[flavour]
    res = pool(4).run(w.load_run, path, flavour, step_after=True)[0][0]
    assert_same(ref["after_step"], res["after_step"], f"{flavour}: one step after loading")
    with pytest.raises(AssertionError):  # the comparison can fail: the step did change the state
        assert_same(ref["saved"], res["after_step"], "changed")


def test_fsdp1_to_fsdp2_to_fsdp1(pool, saved, tmp_path):
    path, ref = saved["fsdp1"]
    hop1, hop2 = str(tmp_path / "as_fsdp2"), str(tmp_path / "back_fsdp1")
    pool(3).run(w.load_then_save, path, hop1, "fsdp2")
    pool(2).run(w.load_then_save, hop1, hop2, "fsdp1_orig")
    res = pool(4).run(w.load_run, hop2, "fsdp1", step_after=True)[0][0]
    assert_same(ref["saved"], res["loaded"], "FSDP1(4) -> FSDP2(3) -> FSDP1 orig(2) -> FSDP1(4)")
    assert_same(ref["after_step"], res["after_step"], "step after the round trip")


def test_fsdp1_merged_flat_ranges(pool, tmp_path):
    """flat_ranges='merge': the ranks' slices are merged into row boxes point to point, no gather."""
    path = str(tmp_path / "merged")
    ref = pool(4).run(w.save_run, path, "fsdp1", merge=True)[0]
    assert ref["merged"] == "merge"
    meta = json.load(open(os.path.join(path, "metadata.json")))
    assert all("offsets" in c for c in meta["tensors"]["model.l1.weight"]["chunks"])
    res = pool(3).run(w.load_run, path, ["fsdp1_orig", "fsdp2"])[0]
    for r in res:
        assert_same(ref["saved"], r["loaded"], f"merged FSDP1 on 4 -> {r['flavour']} on 3")


def test_fsdp1_flat_save_issues_no_all_gather(pool, tmp_path):
    res = pool(4).run(w.flat_shards_no_gather, str(tmp_path / "nogather"))
    for rank, r in enumerate(res):
        assert r["in_save"] == 0 and r["gathers"] == 0 and r["after_full"] > 0, (rank, r)
        assert r["shape"] == [7, 6] and r["tied_same_tensor"]
    assert {r["spec"] for r in res} != {res[0]["spec"]}  # each rank holds another flat range


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_fsdp1_state_dict_modes(pool, tmp_path, mode):
    """FSDP1 through its SHARDED / FULL state dict; loads into flat FSDP1 and FSDP2 on 2 ranks."""
    path = str(tmp_path / mode)
    ref = pool(4).run(w.save_run, path, "fsdp1", mode=mode)[0]
    emb = CheckpointReader(path).tensor_meta("model.emb.weight")  # format v2: split parts from the index files
    chunks = [list(c.spec.lengths) for c in emb.chunks]
    if mode == "sharded":  # ShardedTensor row blocks of 11 rows on 4 ranks: torch.chunk's parts, one split line
        assert sorted(c[0] for c in chunks) == [2, 3, 3, 3] and emb.split is not None and emb.split.parts == 4
    else:  # whole tensors, written once
        assert chunks == [[11, 6]] or sum(c[0] for c in chunks) == 11
    for r in pool(2).run(w.load_run, path, ["fsdp1", "fsdp2"])[0]:
        assert_same(ref["saved"], r["loaded"], f"FSDP1 {mode} on 4 -> {r['flavour']} on 2")
    r = pool(2).run(w.load_run, path, "fsdp1", mode=mode)[0][0]
    assert_same(ref["saved"], r["loaded"], f"FSDP1 {mode} on 4 -> FSDP1 {mode} on 2")


def test_modes_need_fsdp1():
    import unickpt.fsdp

    model = torch.nn.Linear(2, 2)
    assert unickpt.fsdp.model_state(model) is model
    with pytest.raises(ValueError, match=r"mode='flat' is for FSDP1 \(FullyShardedDataParallel\) models"):
        unickpt.fsdp.model_state(model, mode="flat")
    with pytest.raises(ValueError, match=r"mode must be one of \['auto', 'flat', 'sharded', 'full'\], got 'nope'"):
        unickpt.fsdp.state(model, mode="nope")


# --------------------------------------------------------------------------------------------- #
# torch.distributed.checkpoint: StorageWriter / StorageReader, DCP directories
# --------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("how", ["writer", "async"])
def test_dcp_writer_reader_round_trip(pool, tmp_path, how):
    """dcp.save / dcp.async_save through unickpt.fsdp.StorageWriter on 4 ranks (FSDP2), then
    dcp.load through StorageReader on 2. (Not into FSDP1: its SHARDED_STATE_DICT drops, on ranks that
    hold no element, the 1x1 layer's ShardedTensors, and DCP's load planner then fails on that rank.)"""
    path = str(tmp_path / how)
    ref = pool(4).run(w.dcp_save, path, "fsdp2", how)[0]["saved"]
    meta = json.load(open(os.path.join(path, "metadata.json")))  # an ordinary unickpt checkpoint
    assert meta["framework"] == "torch.distributed.checkpoint"
    # the non-tensor items are plain JSON values, grouped as unickpt.save groups them (no pickle)
    assert not any(k.startswith("__dcp_bytes__.") for k in meta["tensors"])
    assert meta["state_tree"]["extra"] == {"epoch": 3, "note": "dcp"}
    assert [g["lr"] for g in meta["state_tree"]["optim.param_groups"]] == [1e-2]
    res = pool(2).run(w.dcp_load, path, "fsdp2", "reader")[0]
    assert_same(ref, res["loaded"], f"dcp {how} on 4 -> dcp.load via StorageReader on 2")
    assert res["extra"] == {"epoch": 3, "note": "dcp"}
    # unickpt.load (no pickle) of the module and optimizer themselves, into FSDP1 flat state on 2
    res = pool(2).run(w.dcp_load, path, "fsdp1_orig", "unickpt_nopickle")[0]
    assert "error" not in res, res.get("error")
    assert_same(ref, res["loaded"], f"dcp {how} on 4 -> unickpt.load FSDP1 on 2")
    assert res["extra"] == {"epoch": 3, "note": "dcp"}
    if how == "writer":  # a load never casts: fp32 stored, bf16 target
        errors = {r["error"] for r in pool(2).run(w.dcp_load, path, "fsdp2", "reader_bf16")}
        assert errors == {f"TypeError: 'model.emb.weight': the checkpoint {path!r} stores torch.float32, the state to "
                          "load into has torch.bfloat16; unickpt never casts on load (convert after loading)"}, errors


def test_dcp_reader_reads_a_unickpt_checkpoint(pool, saved):
    """A checkpoint written by unickpt.save (FSDP1 flat ranges) read by dcp.load into FSDP2."""
    path, ref = saved["fsdp1"]
    res = pool(3).run(w.dcp_load, path, "fsdp2", "reader", native=True)[0]
    assert_same(ref["saved"], res["loaded"], "unickpt FSDP1 on 4 -> dcp.load FSDP2 on 3")
    assert res["extra"] == 2  # the plain value "step", offered to DCP as bytes


def test_unickpt_load_of_a_dcp_directory(pool, tmp_path):
    """A checkpoint written by dcp.save's own FileSystemWriter (FSDP2 on 4) loads with
    unickpt.load(..., allow_pickle=True) into FSDP1 flat state on 3; without it, a clear error."""
    path = str(tmp_path / "dcp_native")
    ref = pool(4).run(w.dcp_save, path, "fsdp2", "dcp")[0]["saved"]
    assert os.path.exists(os.path.join(path, ".metadata")) and not os.path.exists(os.path.join(path, "metadata.json"))
    refused = pool(3).run(w.dcp_load, path, "fsdp1_orig", "unickpt_nopickle")
    assert all(r["error"].startswith(f"UnsafeObjectError: {path!r} is a torch.distributed.checkpoint directory: its "
                                     ".metadata and its non-tensor entries are pickles") and "allow_pickle=True" in r["error"]
               for r in refused), refused
    # StorageReader on it: a clear error (DCP reports a failed read_metadata inside its own AssertionError)
    want = (f"{path!r} was written by DCP's own FileSystemWriter (.metadata, no metadata.json); unickpt.fsdp.StorageReader "
            "reads unickpt checkpoints: load it with dcp.load's default reader, or with unickpt.load(path, state, "
            "allow_pickle=True)")
    errors = [r["error"] for r in pool(3).run(w.dcp_load, path, "fsdp2", "reader_error")]
    assert all(e.startswith("AssertionError: metadata is None; global metadata read failed: " + want) for e in errors), errors
    res = pool(3).run(w.dcp_load, path, "fsdp1_orig", "unickpt")[0]
    assert "error" not in res, res.get("error")
    assert_same(ref, res["loaded"], "DCP FileSystemWriter on 4 -> unickpt.load FSDP1 on 3")
    assert res["extra"] == {"epoch": 3, "note": "dcp"}


def test_dcp_writer_one_rank_fails(pool, tmp_path):
    path = str(tmp_path / "failed")
    res = pool(2).run(w.dcp_writer_rank_failure, path)
    for r in res:
        assert not r["committed"]
        assert r["error"].startswith(f"ValueError: StorageWriter: nothing saved to {path!r}; rank 1 failed: "
                                     "AttributeError: Can't pickle local object 'dcp_writer_rank_failure.<locals>.<lambda>'"), r


def test_unickpt_load_of_dcp_save_with_empty_optimizer_state(pool, tmp_path):
    """An optimizer without state (SGD, no momentum): DCP drops the empty "state" dict; unickpt.load
    of the DCP directory and of a StorageWriter checkpoint must still load the param groups."""
    for r in pool(2).run(w.dcp_empty_optim_state, str(tmp_path))[0]:
        assert "error" not in r, r
        assert r["step"] == 3 and r["loaded"]["param_groups"][0]["lr"] == 0.5
        assert_same(r["ref"], r["loaded"], f"SGD without state via {r['how']}")


@pytest.mark.parametrize("flavour", ["hsdp1", "hsdp2", "fsdp2_tp"])
def test_hsdp_and_2d_mesh(pool, tmp_path, flavour):
    """HSDP (FSDP1 HYBRID_SHARD, FSDP2 on a 2x2 mesh) and FSDP2 + tensor parallel on a 2x2 mesh,
    saved on 4 ranks (replicas written once), loaded into the same layout and into FSDP1 / FSDP2 on 2."""
    path = str(tmp_path / flavour)
    ref = pool(4).run(w.save_run, path, flavour)[0]
    meta = json.load(open(os.path.join(path, "metadata.json")))
    stored = sum(c["byte_length"] for t in meta["tensors"].values() for c in t["chunks"])
    want = sum(torch.Size(t["shape"]).numel() * getattr(torch, t["dtype"]).itemsize for t in meta["tensors"].values())
    assert stored == want  # every element exactly once, however many replicas held it
    res = pool(4).run(w.load_run, path, flavour, step_after=True)[0][0]
    assert_same(ref["saved"], res["loaded"], f"{flavour} on 4 -> {flavour} on 4")
    assert_same(ref["after_step"], res["after_step"], f"{flavour}: one step after loading")
    for r in pool(2).run(w.load_run, path, ["fsdp1", "fsdp2"])[0]:
        assert_same(ref["saved"], r["loaded"], f"{flavour} on 4 -> {r['flavour']} on 2")


def test_writer_stage_while_a_save_is_in_flight(tmp_path):
    """Two dcp.async_save calls through one StorageWriter: the second stage() happens before the first
    save has written (DCP runs saves one after another in its thread). The first staged copy must keep
    the values it had (StateDictStager reuses its cached host buffers, which would overwrite it)."""
    import unickpt.fsdp

    writer = unickpt.fsdp.StorageWriter(str(tmp_path / "never_written"))
    t = torch.arange(6, dtype=torch.float32)
    first = writer.stage({"x": t, "n": 3})
    t.add_(100)  # training goes on
    second = writer.stage({"x": t, "n": 3})
    assert torch.equal(first["x"], torch.arange(6, dtype=torch.float32)) and first["n"] == 3
    assert torch.equal(second["x"], torch.arange(6, dtype=torch.float32) + 100)
    writer.close()


@pytest.mark.parametrize("flavour", ["fsdp2", "fsdp1", "fsdp1_orig"])
@pytest.mark.parametrize("how", ["direct", "fsdp"])
def test_save_leaves_an_unstepped_optimizer_as_it_is(pool, tmp_path, flavour, how):
    # the model and optimizer put in the state as they are ("direct": FSDP1 too) or through
    # unickpt.fsdp.state: the save creates no optimizer state and no gradients; the early checkpoint
    # loaded after a step empties the optimizer again and restores the weights bitwise
    import optim_workers

    out = pool(2).run(optim_workers.save_unstepped, str(tmp_path / "c"), flavour, how)
    for r, o in enumerate(out):
        assert o["after_save"] == {"n_state": 0, "steps": []}, (r, o)
        assert all(o["grads"]), (r, o)
        assert o["trained"]["n_state"] > 0 and set(o["trained"]["steps"]) == {1.0}, (r, o)
        assert o["after_load"] == {"n_state": 0, "steps": []}, (r, o)
    assert out[0]["weights_equal"] is True


@pytest.mark.parametrize("flavour", ["fsdp1", "fsdp1_orig"])
def test_fsdp1_model_and_optimizer_directly_in_the_state(pool, tmp_path, flavour):
    # {"model": fsdp1_model, "optim": optim} as for FSDP2: torch's sharded state dicts hold
    # ShardedTensors, saved as their local boxes; loaded into a fresh pair bitwise
    import optim_workers

    out = pool(2).run(optim_workers.save_direct_load_direct, str(tmp_path / "c"), flavour)
    assert out[0] == {"equal": True, "n_keys": 33}
