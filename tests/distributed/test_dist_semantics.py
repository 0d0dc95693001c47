"""Multi-process behaviour on real gloo groups: FSDP2 and DDP models with optimizers resharded,
per-rank state, collective failure reporting, the Checkpointer with async saves."""
from __future__ import annotations

import json
import os

import pytest
import torch

import dist_workers as w
import unickpt


@pytest.fixture(scope="module")
def fsdp2_ckpt(pool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp2") / "ckpt")
    results = pool(4).run(w.fsdp2_save, path)
    return path, results[0]["full"]


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_fsdp2_model_and_optimizer_reshard_bitwise(pool, fsdp2_ckpt, m):
    path, full = fsdp2_ckpt
    results = pool(m).run(w.fsdp2_load, path)
    got = results[0]["full"]
    assert got.keys() == full.keys() and len(full) == 6 + 6 * 2 + 6  # params, exp_avg(_sq), step per param
    for k in full:
        assert got[k].dtype == full[k].dtype and torch.equal(got[k], full[k]), k
    for r in results:
        assert r["step"] == 3 and r["last_epoch"] == 1 and r["lr"] == pytest.approx(1e-2 / 2)
        assert r["loss"] == results[0]["loss"]  # all ranks agree after a step on the loaded state
        # torch's write-back was skipped (the shards were written in place), and forcing it changes nothing
        assert r["skipped_write_back"] and r["forced_calls"] == 1 and r["loss_written_back"] == r["loss"]
        assert r["stale_graph_fails"] == [True, True]  # a graph over the parameters from before the load


def test_ddp_save_loads_into_plain_model(pool, tmp_path):
    path = str(tmp_path / "ddp")
    pool(2).run(w.ddp_save, path)
    meta = json.load(open(os.path.join(path, "metadata.json")))
    assert "model.0.weight" in meta["tensors"]  # DDP's "module." prefix is gone
    sizes = pool(1).run(w.data_file_sizes, path)[0]
    assert sorted(sizes) == ["0_0.bin", "1_0.bin"]  # replicated bytes spread over both ranks
    total = sum(t.numel() * 4 for t in w._mlp().state_dict().values()) * 2  # params + momentum
    assert sum(sizes.values()) == total and max(sizes.values()) < 0.75 * total
    [loaded] = pool(1).run(w.plain_load, path)
    assert set(loaded) == set(w._mlp().state_dict())


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_one_rank_failing_fails_the_save_everywhere(pool, tmp_path, fail_rank):
    path = str(tmp_path / "c")
    results = pool(2).run(w.failing_write, path, fail_rank)
    for r in results:
        assert r.startswith(f"[{fail_rank}]|"), r
        assert f"rank(s) [{fail_rank}]" in r and "Input/output error (injected: write of " in r
    assert not os.path.exists(os.path.join(path, "metadata.json"))


def test_ranks_disagreeing_on_dtype_is_an_error(pool, tmp_path):
    results = pool(2).run(w.disagreeing_dtypes, str(tmp_path / "c"))
    for r in results:
        assert "'w': rank 0 has dtype float32 shape [4], rank 1 has dtype float16 shape [4]" in r


def test_per_rank_state_same_and_other_world_size(pool, tmp_path):
    path = str(tmp_path / "c")
    draws = pool(2).run(w.per_rank_save, path)
    same = pool(2).run(w.per_rank_load, path, False)
    assert [r["draw"] for r in same] == draws and [r["cursor"] for r in same] == [{"pos": 0}, {"pos": 10}]
    errs = pool(3).run(w.per_rank_load, path, False)
    assert all("saved by 2 ranks and is being loaded by 3" in r["error"] for r in errs)
    resharded = pool(3).run(w.per_rank_load, path, True)
    assert [r["draw"] for r in resharded] == [draws[0], draws[1], draws[0]]
    assert [r["cursor"] for r in resharded] == [{"pos": 10 + r, "from": 2} for r in range(3)]


def test_checkpointer_async_retention_on_two_ranks(pool, tmp_path):
    root = str(tmp_path / "run")
    results = pool(2).run(w.checkpointer_run, root)
    for rank, r in enumerate(results):
        assert r["step"] == 4 and r["value"] == 40 + rank
        assert r["listing"] == ["latest", "step_3", "step_4"]
        assert r["hits"] == [False, True, True, True, True]  # same layout: planned once
    assert open(os.path.join(root, "latest")).read() == "step_4"


def test_plan_cache_misses_when_any_rank_changes_layout(pool, tmp_path):
    results = pool(2).run(w.plan_cache_layout_changes, str(tmp_path))
    for rank, r in enumerate(results):
        # the first layout may already be cached from earlier tests in this pool: only the order matters
        assert r["hits"][1] is False and r["hits"][2] is True
        assert r["loaded"][1] == {"w": [float(rank)] * 4, "x": [0.0, 1.0, 2.0]}
        assert r["loaded"][0] == r["loaded"][2] == {"w": [float(rank)] * 4}


def test_rank_dying_mid_save_fails_the_survivors_cleanly(tmp_path):
    from unickpt.testing import DistPool

    path, report = str(tmp_path / "c"), tmp_path / "report.txt"
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] died"):
        with DistPool(2, timeout_s=120) as pool:
            pool.run(w.die_during_save, path, str(report))
    text = report.read_text()  # the pool lets survivors finish before it kills them
    assert text.startswith("SaveFailedError:") and "rank 0 lost contact with rank 1" in text, text
    assert not os.path.exists(os.path.join(path, "metadata.json"))


def test_flatten_equals_torch_state_dicts_on_fsdp2(pool):
    """The caller-side fast path (one ``get_state_dict`` per model with one optimizer, DTensor boxes
    cached by spec, local shards without ``to_local()``) yields torch's fqns, storages and boxes."""
    results = pool(2).run(w.flatten_matches_torch_state_dicts)
    assert results[0] == results[1]
    one = results[0]["one"]
    assert len(one) == 6 + 6 * 3  # 6 params; AdamW's step, exp_avg, exp_avg_sq per param
    assert "optim.state.0.weight.exp_avg" in one and "model.3.bias" in one
    two = results[0]["two"]
    assert len([f for f in two if f.startswith("oa.")]) == 2 * 3 and len([f for f in two if f.startswith("ob.")]) == 4
    for r in results:  # the state-dict cache of saves: a hit equals torch's call; unsharded parameters miss
        assert r["cache"] == {"hits": 1, "after": {"hits": 1, "misses": 2, "uncacheable": 0},
                              "unsharded_seen": True, "result_sharded": True}, r["cache"]


def test_dtensor_boxes_follow_a_rank_change_in_process(tmp_path):
    """Regression (found by breaking the box cache): equal DTensor specs on a re-created group where
    this process holds the other rank must not reuse the first group's box."""
    from unickpt.testing import DistPool
    from unickpt.testing.dist import _free_port

    with DistPool(2, timeout_s=120) as pool:
        results = pool.run(w.save_load_after_rank_change, str(tmp_path), _free_port())
    assert results == [[True, True], [True, True]]


@pytest.mark.parametrize("how", ["world", "group"])
def test_destroy_process_group_right_after_an_async_save_keeps_it(tmp_path, how):
    # save(async) -> destroy_process_group() (a name imported before unickpt) -> os._exit(0): the
    # teardown waits for the save in flight
    import subprocess
    import sys

    path = str(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          os.path.join(here, "teardown_script.py"), path, how],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert os.path.exists(os.path.join(path, "metadata.json")), "the checkpoint was lost at teardown"
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.zeros(16 << 20), "mine": unickpt.Shard(torch.zeros(4 << 20), (4 << 20,), offsets=(0,)),
             "step": 0}
    unickpt.load(path, state)
    assert torch.equal(state["w"], torch.randn(16 << 20, generator=g))
    assert torch.equal(state["mine"].tensor, torch.cat([torch.zeros(2 << 20), torch.ones(2 << 20)]))
    assert state["step"] == 5


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_tensors_that_differ_across_ranks_are_refused(pool, tmp_path, world):
    # a plain tensor is saved once (as replicated); different copies must not be lost silently
    import replica_workers as rw

    tag = f"x{world}"
    out = pool(world).run(rw.save_replicas, str(tmp_path), tag + "e", "experts", None)
    for r in out:  # every rank raises the same error, naming the key and which ranks hold what
        assert r["error"] == "ReplicaMismatchError" and not r["committed"], r
        assert f"'experts.0.w{tag}e'" in r["message"] and f"shared{tag}e" not in r["message"], r["message"]
        for rank in range(world):
            assert f"ranks [{rank}] hold digest" in r["message"], r["message"]
    assert len({r["message"] for r in out}) == 1
    out = pool(world).run(rw.save_replicas, str(tmp_path), tag + "b", "bias", None)
    assert all(f"'bias{tag}b' (ranks {list(range(world - 1))} hold digest" in r["message"] for r in out), out[0]
    # equal copies: saved; the check costs 2 more plan collectives on the first save of a layout
    out = pool(world).run(rw.save_replicas, str(tmp_path), tag + "n", "none", None)
    assert [(r["error"], r["plan"], r["hit"]) for r in out] == [(None, 5, False)] * world
    out = pool(world).run(rw.save_replicas, str(tmp_path), tag + "o", "experts", "off")
    assert all(r["error"] is None for r in out)


def test_replica_check_first_save_of_a_layout_or_always(pool, tmp_path):
    # "first" (default): the sampled windows of a 4 MiB tensor include its last bytes, so a change of
    # its last element is seen; a layout planned before is not checked again; "always" checks every
    # save, every byte
    import replica_workers as rw

    out = pool(2).run(rw.save_replicas, str(tmp_path), "t1", "tail", None)
    assert all(r["error"] == "ReplicaMismatchError" and "'sharedt1'" in r["message"] for r in out)
    first = pool(2).run(rw.save_twice_then_differ, str(tmp_path), "f", "first")
    assert [(s["error"], s["hit"]) for s in first[0]] == [(None, False), (None, True), (None, True)]
    always = pool(2).run(rw.save_twice_then_differ, str(tmp_path), "a", "always")
    for per_rank in always:
        assert [s["error"] for s in per_rank] == [None, None, "ReplicaMismatchError"]
        assert per_rank[1]["plan"] == 3 and per_rank[1]["hit"] is True  # signature exchange + the check


def test_replica_mismatch_is_raised_again_and_its_path_can_be_saved_once_fixed(pool, tmp_path):
    # the failed layout is not remembered as checked (a retry of the same mismatch raises again), and
    # the failed save's leftovers in the path are this process's own: the fixed state saves there
    import replica_workers as rw

    out = pool(2).run(rw.mismatch_then_retry, str(tmp_path), "retry")
    assert out == [["ReplicaMismatchError", "ReplicaMismatchError", None, [7.0] * 4]] * 2


def test_ranks_naming_different_targets_are_refused_on_every_rank(pool, tmp_path):
    # each rank saving under its own path or step used to commit rank 0's directory without the other
    # ranks' files, after which keep_last deleted the good checkpoint
    results = pool(2).run(w.disagreeing_targets, str(tmp_path))
    for rank, r in enumerate(results):
        kind, text = r["paths"]
        assert kind == "ValueError" and "ranks saved to different targets" in text, r["paths"]
        assert f"rank 0: '{tmp_path}/run_rank0' step None, rank 1: '{tmp_path}/run_rank1' step None" in text
        kind, text = r["steps"]
        assert kind == "ValueError" and f"rank 0: '{tmp_path}/run/step_100' step 100" in text, r["steps"]
        assert r["listing"] == ["latest", "step_0"]  # nothing written, the committed step kept
        assert r["loaded"] == 1 and r["ok"]
    assert results[0]["written"] == ["run"]  # no run_rank<r> directory was made


def test_bad_options_on_one_rank_raise_everywhere_without_a_hang(pool, tmp_path):
    results = pool(2).run(w.options_bad_on_one_rank, str(tmp_path), 1)
    bad, good = results[1], results[0]
    assert bad["saved"] == ("ValueError", "snapshot must be one of ['sync', 'overlap'], got 'bogus'")
    assert good["saved"] == ("ValueError", "rank 1: snapshot must be one of ['sync', 'overlap'], got 'bogus'")
    assert bad["typed"][0] == good["typed"][0] == "TypeError"
    assert "save(options=...) takes a unickpt.SaveOptions, got dict" in good["typed"][1]
    assert bad["loaded"] == ("ValueError", "read_threads must be at least 1, got 0")
    assert good["loaded"] == ("ValueError", "rank 1: read_threads must be at least 1, got 0")
    assert bad["mapped"] == ("TypeError", "mapping must be None, 'auto' or a unickpt.Mapping, got 'bogus'")
    assert good["mapped"] == ("TypeError", "rank 1: mapping must be None, 'auto' or a unickpt.Mapping, got 'bogus'")
    for r in results:
        assert r["differ"][0] == "ValueError" and "rank 0: True, rank 1: False" in r["differ"][1], r["differ"]
        assert r["ok"] and r["committed"] == {"a": False, "b": False, "c": True}
