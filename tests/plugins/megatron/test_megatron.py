"""unickpt.megatron: megatron-core dist_checkpointing with backend "unickpt" on CPU + gloo.

One pool of 4 ranks serves every case (megatron's parallel_state is re-initialized per layout).
A GPT is saved with TP=2 (x DP=2) and loaded with TP=1, TP=4, TP=2 x DP=2, PP=2 and TP=2 x PP=2;
every parameter is compared bitwise as a full tensor gathered from the ranks' local shards.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import unickpt

pytest.importorskip("megatron.core")
import megatron_workers as W  # noqa: E402
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def mpool():
    from unickpt.testing import DistPool

    p = DistPool(4, timeout_s=300)
    yield p
    p.close()


def _equal(want: dict, got: dict) -> list[str]:
    """Keys whose full tensors differ (bitwise), plus keys present on one side only."""
    bad = sorted(set(want) ^ set(got))
    bad += [k for k in sorted(set(want) & set(got)) if not torch.equal(want[k].view(torch.int32), got[k].view(torch.int32))]
    return bad


@pytest.fixture(scope="module")
def saved_tp2(mpool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mcore") / "iter_1")
    assert mpool.run(W.setup, 2)[0] == {"tp": 2, "pp": 1, "dp": 2}
    full = mpool.run(W.full_tensors)[0]
    files = mpool.run(W.save, path)[0]
    return path, full, files


def test_layout_on_disk(saved_tp2):
    path, full, files = saved_tp2
    assert files["files"] == ["common.pt", "metadata.json", "unickpt"]
    # main replicas only (megatron's rule): DP rank 0 of each TP rank writes
    assert files["data"] == ["0_0.bin", "1_0.bin"]
    with open(os.path.join(path, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "unickpt"
    meta = unickpt.CheckpointMetadata.from_json(open(os.path.join(path, "unickpt", "metadata.json")).read())
    assert meta.framework == "megatron"
    # stacked layers are stored per layer; the SwiGLU fc1 as two slabs (w and v halves)
    assert "decoder.layers.mlp.linear_fc1.weight[1]#0/2" in meta.tensors
    assert meta.tensors["decoder.layers.mlp.linear_fc1.weight[1]#1/2"].shape == (128, 32)
    keys = meta.extra["megatron"]["keys"]
    assert keys["decoder.layers.mlp.linear_fc1.weight"] == {"shape": [2, 256, 32], "dtype": "float32", "prepend": 1,
                                                           "split": [0, 2]}
    assert set(keys) == set(full)
    out = subprocess.run([sys.executable, "-m", "unickpt", "verify", os.path.join(path, "unickpt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("tp,pp", [(1, 1), (4, 1), (2, 1), (1, 2), (2, 2)])
def test_reshard_load_bitwise(mpool, saved_tp2, tp, pp):
    path, full, _ = saved_tp2
    mpool.run(W.setup, tp, pp, 5)
    assert _equal(full, mpool.run(W.full_tensors)[0])  # the fresh model differs from the checkpoint
    same_layout = (tp, pp) == (2, 1)
    res = mpool.run(W.load, path, None if same_layout else "skip")
    assert _equal(full, mpool.run(W.full_tensors)[0]) == []
    assert all(r["iteration"] == 42 for r in res)
    if same_layout:  # per-(PP, TP)-rank objects come back to the ranks that saved them
        for rank, r in enumerate(res):
            tp_rank = rank % 2
            assert r["rng_state"]["tp"] == tp_rank and r["rng_state"]["tuple"] == (1, "two", 3.0)
            assert torch.equal(r["rng_state"]["torch"], torch.arange(4) + 10 * tp_rank)
    else:  # object_policy="skip": objects of another layout are left out
        assert all(r["rng_state"] == "absent" for r in res)


def test_sharded_object_layout_change_is_an_error(mpool, saved_tp2):
    path, _, _ = saved_tp2
    mpool.run(W.setup, 1)
    errs = mpool.run(W.load_expect_error, path)
    assert {e[0] for e in errs} == {"MegatronStateMismatchError"}
    assert "ShardedObject 'rng_state/shard_0.0_1.1' is not in the checkpoint" in errs[0][1]
    assert "['rng_state/shard_0.0_1.2', 'rng_state/shard_0.1_1.2']" in errs[0][1]
    assert errs[0][1] == errs[3][1]


def test_async_save_equals_sync(mpool, tmp_path):
    mpool.run(W.setup, 2, 1, 3)
    full = mpool.run(W.full_tensors)[0]
    mpool.run(W.save, str(tmp_path / "async"), True)
    after = mpool.run(W.full_tensors)[0]  # fill(99) ran while the save was in flight
    assert _equal(full, after) == sorted(full)
    mpool.run(W.load, str(tmp_path / "async"))
    assert _equal(full, mpool.run(W.full_tensors)[0]) == []
    mpool.run(W.setup, 2, 1, 3)
    mpool.run(W.save, str(tmp_path / "sync"))
    a = unickpt.CheckpointMetadata.from_json(open(tmp_path / "async" / "unickpt" / "metadata.json").read())
    s = unickpt.CheckpointMetadata.from_json(open(tmp_path / "sync" / "unickpt" / "metadata.json").read())
    assert {k: [c.checksum for c in t.chunks] for k, t in a.tensors.items()} == \
           {k: [c.checksum for c in t.chunks] for k, t in s.tensors.items()}
    # saving again into a checkpoint directory overwrites it (megatron's semantics; a unickpt
    # checkpoint is never overwritten otherwise), except while a save into it is in flight;
    # load_plain_tensors (whole stacked tensors, no prepended axes) reads the per-layer fqns
    res = mpool.run(W.overwrite_and_plain, str(tmp_path / "sync"))[0]
    assert res["error"][0] == "SaveFailedError"
    assert (f"a save into {str(tmp_path / 'sync')!r} started by this process is still in flight (its AsyncRequest "
            "is not finalized); finalize it before saving there again") in res["error"][1]
    assert res["loaded"] is True and res["plain"] is True


def test_fully_parallel_wrappers_and_balanced_replicas(mpool, tmp_path):
    mpool.run(W.setup, 2, 1, 4)
    full = mpool.run(W.full_tensors)[0]
    files = mpool.run(W.save, str(tmp_path / "fp"), False, True)[0]
    assert files["data"] == ["0_0.bin", "1_0.bin", "2_0.bin", "3_0.bin"]  # main replicas spread over DP
    files = mpool.run(W.save, str(tmp_path / "bal"), False, False, True)[0]
    assert files["data"] == ["0_0.bin", "1_0.bin", "2_0.bin", "3_0.bin"]  # unickpt's planner balances replicas
    for name in ("fp", "bal"):
        mpool.run(W.setup, 4, 1, 6)
        mpool.run(W.load, str(tmp_path / name), "skip", True)
        assert _equal(full, mpool.run(W.full_tensors)[0]) == []


def test_flattened_range_shards(mpool, tmp_path):
    path = str(tmp_path / "flat")
    assert mpool.run(W.flat_save, path) == ["ok"] * 4
    meta = unickpt.CheckpointMetadata.from_json(open(os.path.join(path, "unickpt", "metadata.json")).read())
    chunks = meta.tensors["optimizer.state.exp_avg.w"].chunks
    assert sorted((c.spec.start, c.spec.length) for c in chunks) == [(0, 12), (12, 12), (24, 12), (36, 12)]
    assert mpool.run(W.flat_load, path, 0, 2, 2) == [True] * 4  # same layout
    assert mpool.run(W.flat_load, path, 0, 1, 4) == [True] * 4  # DP 2 -> 4
    assert mpool.run(W.flat_load, path, 1, 2, 2) == [True] * 4  # column boxes: not contiguous, read whole
    assert mpool.run(W.flat_load, path, 1, 4, 1) == [True] * 4  # plain column boxes


def test_noncontiguous_flattened_save_fails_everywhere(mpool, tmp_path):
    errs = mpool.run(W.flat_save_noncontiguous, str(tmp_path / "bad"))
    assert {e[0] for e in errs} == {"SaveFailedError"}
    assert "failed on rank(s) [0, 1, 2, 3]; nothing was committed" in errs[0][1]
    assert ("ShardedTensor 'w': flattened_range [0, 12) of the local box offsets [0, 0] lengths [8, 3] is not one "
            "contiguous range of the global tensor [8, 6]") in errs[0][1]
    assert not os.path.exists(tmp_path / "bad" / "unickpt" / "metadata.json")


def test_missing_key_fails_everywhere(mpool, tmp_path):
    path = str(tmp_path / "flat2")
    mpool.run(W.flat_save, path)
    errs = mpool.run(W.load_missing_key, path)
    assert {e[0] for e in errs} == {"MegatronStateMismatchError"}
    assert "rank 3: ShardedTensor 'no.such.key' is not in the checkpoint" in errs[0][1]
    # a different global shape is an error, unless the ShardedTensor allows it (megatron's padded
    # vocabularies, whose padding changes with TP): then zeros plus the stored overlap, as torch_dist does
    res = mpool.run(W.padded_load, path)
    assert [r[1] for r in res] == [True] * 4
    assert {r[0][0] for r in res} == {"MegatronStateMismatchError"}
    assert ("rank 3: ShardedTensor 'optimizer.state.exp_avg.w': checkpoint has shape [8, 6] dtype float32 prepended "
            "axes 0, the state has shape [12, 6] dtype float32 prepended axes 0") in res[0][0][1]


UNEVEN = [  # (src, dest): per rank, the lengths of its shards of one 1-D key, in global order
    ([[3]] * 4, None),
    ([[]] * 3 + [[3, 3]], None),  # one rank holds two equal halves: stored as 2 equal slabs
    ([[4], [7, 8], [1], [3, 3]], None),  # unequal shards: "'a#0/2': the ranks' shards cover 11 of 13 elements"
    ([[4], [7, 8], [1], [3, 3]], [[2, 4], [], [5, 9], [1, 1, 1, 1, 1, 1]]),
    ([[2]] * 2 + [[10]] * 2, [[10]] * 2 + [[2]] * 2),
    ([[3]] * 4, [[2, 4]] * 2 + [[]] * 2),
]


@pytest.mark.parametrize("src,dest", UNEVEN)
def test_uneven_multiple_shards_per_rank(mpool, tmp_path, src, dest):
    """megatron-core's test_uneven_1d_sharding_multiple_shards on 4 ranks: several shards of one key on
    one rank, of unequal sizes, save and load bitwise, also into another split."""
    dest = dest or src
    assert mpool.run(W.uneven_save_load, str(tmp_path / "u"), src, dest) == [[True] * len(d) for d in dest]
    meta = unickpt.CheckpointMetadata.from_json(open(tmp_path / "u" / "unickpt" / "metadata.json").read())
    key = meta.extra["megatron"]["keys"]["a"]
    if src == [[4], [7, 8], [1], [3, 3]]:  # cut after each shard but the last of a rank holding several
        assert key["split"] == [0, 3] and key["cuts"] == [11, 23]
        assert {k: t.shape for k, t in meta.tensors.items()} == {"a#0/3": (11,), "a#1/3": (12,), "a#2/3": (3,)}
    elif src == [[]] * 3 + [[3, 3]]:
        assert key["split"] == [0, 2] and key.get("cuts") is None
        assert {k: t.shape for k, t in meta.tensors.items()} == {"a#0/2": (3,), "a#1/2": (3,)}


def test_slab_rule():
    """Equal slabs only where every rank holding several pieces has each in a slab of its own; else cuts
    after each piece but the last of every such rank."""
    from unickpt.megatron.sharded_state import KeyInfo, _slabs

    assert _slabs(256, [[(0, 64), (128, 64)], [(64, 64), (192, 64)]]) == (2, None)  # SwiGLU at TP 2
    assert _slabs(26, [[(4, 7), (11, 8)], [(20, 3), (23, 3)]]) == (3, (11, 23))  # unequal sizes
    assert _slabs(12, [[(0, 4), (4, 8)]]) == (2, (4,))  # two pieces, one across the middle
    assert _slabs(12, [[(0, 3), (6, 3)], [(3, 1), (4, 1), (9, 3)]]) == (4, (3, 4, 5))  # 2 and 3 pieces
    d = {"shape": [5, 26], "dtype": "float32", "prepend": 1, "split": [0, 3], "cuts": [11, 23]}
    assert KeyInfo.from_json(d).bounds() == (0, 11, 23, 26) and KeyInfo.from_json(d).to_json() == d
    with pytest.raises(ValueError, match=r"^slab cuts \[23, 11\] do not fit split \(0, 3\) of shape \[5, 26\]$"):
        KeyInfo.from_json({**d, "cuts": [23, 11]})


def test_load_with_more_prepended_axes_than_saved(mpool, tmp_path):
    """A key saved without prepended axes loads into requests with one (megatron-core's
    test_partition_change_save_load: the same global tensor, read row by row), bitwise, also a request
    split along its remaining axis."""
    assert mpool.run(W.more_prepended_load, str(tmp_path / "p")) == [[True, True]] * 4


def test_load_errors_are_checkpointing_exceptions(mpool, tmp_path):
    """megatron's callers catch CheckpointingException around dist_checkpointing.load: a shape mismatch and
    a key missing from the checkpoint raise, on every rank, an error that is both that and unickpt's
    StateMismatchError (a ValueError), naming the key and both shapes."""
    path = str(tmp_path / "err")
    res = mpool.run(W.load_errors, path)
    where = repr(os.path.join(path, "unickpt"))
    shape = ("ShardedTensor 'keyA': checkpoint has shape [2, 16] dtype float32 prepended axes 0, the state has "
             "shape [2, 12] dtype float32 prepended axes 0")
    assert res[0][0] == (True, True, True, "MegatronStateMismatchError",
                         f"{where}: the checkpoint does not match the requested sharded state: "
                         + "; ".join(f"rank {r}: {shape}" for r in range(4)))
    assert res[0][1] == (True, True, True, "MegatronStateMismatchError",
                         f"{where}: the checkpoint does not match the requested sharded state: "
                         + "; ".join(f"rank {r}: ShardedTensor 'different_key' is not in the checkpoint" for r in range(4)))
    assert all(r == res[0] for r in res)


def test_no_info_records_with_the_root_logger_at_info(mpool, tmp_path):
    """megatron-core's conftest sets the root logger to INFO and its tests assert that a save and a load
    log nothing (caplog.text == ''): unickpt's routine records (one per committed save and per load, on
    group rank 0 only) are at DEBUG, so no rank sees a record at INFO or above."""
    assert mpool.run(W.logs_at_info, str(tmp_path / "logs")) == [[]] * 4


def test_global_flat_range():
    from unickpt.megatron import global_flat_range

    assert global_flat_range((8, 6), (4, 0), (4, 6), 3, 20) == (27, 17)  # row box: contiguous
    assert global_flat_range((8, 6), (0, 3), (8, 3), 0, 3) == (3, 3)  # one row of a column box
    assert global_flat_range((8, 6), (0, 3), (8, 3), 2, 4) is None  # spans two rows of a column box
    assert global_flat_range((2, 4, 6), (1, 0, 0), (1, 4, 6), 0, 24) == (24, 24)


def test_launch_rewrites_only_the_unickpt_format():
    from unickpt.megatron.launch import rewrite_argv

    assert rewrite_argv(["--tp", "2", "--ckpt-format", "unickpt", "--save", "x"]) == \
           (["--tp", "2", "--ckpt-format", "torch_dist", "--save", "x"], True)
    assert rewrite_argv(["--ckpt-format=unickpt"]) == (["--ckpt-format=torch_dist"], True)
    assert rewrite_argv(["--ckpt-format", "torch"]) == (["--ckpt-format", "torch"], False)
    # argparse semantics: the last --ckpt-format wins; nothing after "--" is an option
    assert rewrite_argv(["--ckpt-format", "unickpt", "--ckpt-format=torch_dist"]) == \
           (["--ckpt-format", "torch_dist", "--ckpt-format=torch_dist"], False)
    assert rewrite_argv(["--ckpt-format=torch", "--ckpt-format", "unickpt"]) == \
           (["--ckpt-format=torch", "--ckpt-format", "torch_dist"], True)
    assert rewrite_argv(["--", "--ckpt-format", "unickpt"]) == (["--", "--ckpt-format", "unickpt"], False)
    assert rewrite_argv(["--ckpt-format"]) == (["--ckpt-format"], False)


def test_launcher_and_flag_on_unmodified_script(tmp_path):
    """torchrun -m unickpt.megatron.launch SCRIPT --ckpt-format unickpt, PP=2, async save then load.
    PP=2 also checks that unickpt's process groups can be created after megatron's parallel_state
    (whose ranks belong to different numbers of groups)."""
    script = os.path.join(HERE, "megatron_mlm_script.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # without the launcher the script's argparse rejects the format, as Megatron-LM's does
    bare = subprocess.run([sys.executable, script, "--ckpt-format", "unickpt", "--save", str(tmp_path / "x")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert bare.returncode == 2 and "invalid choice: 'unickpt'" in bare.stderr
    out = tmp_path / "result.json"
    from unickpt.testing.dist import _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "unickpt.megatron.launch", script, "--pipeline-model-parallel-size", "2", "--ckpt-format", "unickpt",
           "--async-save", "--save", str(tmp_path / "ckpt"), "--result", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group: a timeout kills the ranks too
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == {"ckpt_format_seen": "torch_dist", "sharded_backend": "unickpt", "async": True,
                      "bitwise_equal": True, "iteration": 7}
    assert (tmp_path / "ckpt" / "iter_0000007" / "unickpt" / "metadata.json").exists()


def test_registry_and_install_uninstall():
    from megatron.core.dist_checkpointing import serialization as ser
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    import unickpt.megatron as um
    from unickpt.megatron import launch

    assert isinstance(get_default_strategy(StrategyAction.SAVE_SHARDED, "unickpt", 1), um.UnickptSaveShardedStrategy)
    assert isinstance(get_default_strategy(StrategyAction.LOAD_SHARDED, "unickpt", 1), um.UnickptLoadShardedStrategy)
    assert isinstance(ser.get_default_save_sharded_strategy("torch_dist"), TorchDistSaveShardedStrategy)
    launch.install()
    try:
        strategy = ser.get_default_save_sharded_strategy("torch_dist")
        assert isinstance(strategy, um.UnickptSaveShardedStrategy) and strategy.backend == "unickpt"
        from megatron.core import dist_checkpointing

        assert dist_checkpointing.serialization.get_default_save_sharded_strategy is ser.get_default_save_sharded_strategy
    finally:
        launch.uninstall()
    assert isinstance(ser.get_default_save_sharded_strategy("torch_dist"), TorchDistSaveShardedStrategy)


class Opaque:
    """A class with no tagged-JSON form (stored only as a pickle)."""


def test_pickle_only_object_is_refused_by_name():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from unickpt.megatron.sharded_state import prepare_save

    prep = prepare_save({"o": ShardedObject("dataloader", Opaque(), (2,), (1,), replica_id=0)})
    assert len(prep.errors) == 1
    assert prep.errors[0].startswith("ShardedObject 'dataloader/shard_1_2': UnsafeObjectError")
    assert prepare_save({"o": ShardedObject("dataloader", Opaque(), (2,), (1,))}, allow_pickle=True).errors == []


def test_object_policy_is_validated():
    from unickpt.megatron import UnickptLoadShardedStrategy

    with pytest.raises(ValueError, match=r"object_policy must be one of \('error', 'skip'\), got 'drop'"):
        UnickptLoadShardedStrategy(object_policy="drop")
