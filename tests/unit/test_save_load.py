"""Save/load semantics in one process (a world of one): dtypes, views, aliases, async snapshot,
commit rules, Checkpointer retention, and every error case."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import unickpt
from unickpt import Checkpointer

FLOAT_DTYPES = [d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
                            torch.float8_e5m2, getattr(torch, "float8_e4m3fnuz", None),
                            getattr(torch, "float8_e5m2fnuz", None), getattr(torch, "float8_e8m0fnu", None))
                if d is not None]
OTHER_DTYPES = [torch.complex64, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + OTHER_DTYPES, ids=str)
def test_every_dtype_round_trips_bitwise(tmp_path, dtype):
    state = {"x": _rand((3, 5), dtype), "scalar": _rand((), dtype, 1), "empty": torch.empty(0, 4, dtype=dtype)}
    unickpt.save(tmp_path / "c", state)
    out = {"x": torch.zeros(3, 5, dtype=dtype), "scalar": torch.zeros((), dtype=dtype), "empty": torch.empty(0, 4, dtype=dtype)}
    unickpt.load(tmp_path / "c", out)
    for k in state:
        assert out[k].dtype == dtype and out[k].shape == state[k].shape
        assert torch.equal(_bits(out[k]), _bits(state[k])), k


def test_non_contiguous_view_writes_only_its_bytes(tmp_path):
    base = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    view = base[2:5, ::3]  # 3 x 4, non-contiguous
    unickpt.save(tmp_path / "c", {"v": view})
    assert os.path.getsize(tmp_path / "c" / "data" / "0_0.bin") == 3 * 4 * 4
    out = {"v": torch.zeros(3, 4)}
    unickpt.load(tmp_path / "c", out)
    assert torch.equal(out["v"], view)
    # loading into a non-contiguous target fills just that view
    target = torch.zeros(10, 10)
    unickpt.load(tmp_path / "c", {"v": target[2:5, ::3]})
    assert torch.equal(target[2:5, ::3], view) and target.sum() == view.sum()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_tied_parameters_stored_once_and_retied(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    unickpt.save(tmp_path / "c", {"model": model})
    meta = json.load(open(tmp_path / "c" / "metadata.json"))
    assert meta["aliases"] == {"model.head.weight": "model.embed.weight"}
    assert "model.head.weight" not in meta["tensors"]
    assert os.path.getsize(tmp_path / "c" / "data" / "0_0.bin") == 11 * 4 * 4
    fresh = Tied()
    unickpt.load(tmp_path / "c", {"model": fresh})
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    # an untied target gets the same values in both tensors
    untied = {"model.embed.weight": torch.zeros(11, 4), "model.head.weight": torch.zeros(11, 4)}
    unickpt.load(tmp_path / "c", {"model": {"embed": {"weight": untied["model.embed.weight"]},
                                            "head": {"weight": untied["model.head.weight"]}}})
    assert torch.equal(untied["model.head.weight"], model.embed.weight.detach())


def test_async_equals_sync_and_mutation_does_not_leak(tmp_path):
    torch.manual_seed(0)
    state = {"w": torch.randn(256, 256), "b": torch.randn(7).to(torch.bfloat16), "n": 3}
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    unickpt.save(tmp_path / "sync", state)
    handle = unickpt.save(tmp_path / "async", state, async_save=True)
    state["w"].add_(1.0)  # like the optimizer step right after the save returns
    state["b"].zero_()
    handle.wait()
    assert handle.done() and handle.stats.committed
    data = lambda p: open(tmp_path / p / "data" / "0_0.bin", "rb").read()
    assert data("sync") == data("async")
    m_sync, m_async = (json.load(open(tmp_path / p / "metadata.json")) for p in ("sync", "async"))
    assert m_sync["tensors"] == m_async["tensors"]
    out = {"w": torch.zeros(256, 256), "b": torch.zeros(7, dtype=torch.bfloat16), "n": 0}
    unickpt.load(tmp_path / "async", out)
    assert torch.equal(out["w"], expected["w"]) and torch.equal(out["b"], expected["b"]) and out["n"] == 3


def test_strict_errors_name_key_and_both_values(tmp_path):
    unickpt.save(tmp_path / "c", {"w": torch.zeros(2, 3), "k": 1})
    with pytest.raises(unickpt.StateMismatchError, match=r"'w': checkpoint has dtype float32 shape \[2, 3\], .* dtype float64 shape \[2, 3\]"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(2, 3, dtype=torch.float64), "k": 0})
    with pytest.raises(unickpt.StateMismatchError, match=r"'w': checkpoint has dtype float32 shape \[2, 3\], .* dtype float32 shape \[3, 2\]"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(3, 2), "k": 0})
    with pytest.raises(unickpt.StateMismatchError, match=r"missing from the checkpoint: 'extra'"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(2, 3), "k": 0, "extra": torch.zeros(1)})
    with pytest.raises(unickpt.StateMismatchError, match=r"in the checkpoint but not in the state: 'k'"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(2, 3)})
    with pytest.raises(unickpt.StateMismatchError, match=r"'k' \(checkpoint: object, state: tensor\)"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(2, 3), "k": torch.zeros(1)})
    # non-strict loads the common keys and leaves the rest alone
    out = {"w": torch.ones(2, 3), "extra": torch.ones(1)}
    unickpt.load(tmp_path / "c", out, strict=False)
    assert out["w"].sum() == 0 and out["extra"].item() == 1


def test_uncommitted_directory_is_never_loaded(tmp_path):
    unickpt.save(tmp_path / "c", {"w": torch.ones(4)})
    os.remove(tmp_path / "c" / "metadata.json")
    with pytest.raises(unickpt.CheckpointNotFoundError, match="metadata.json is missing"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(4)})


def test_committed_checkpoint_is_never_overwritten(tmp_path):
    unickpt.save(tmp_path / "c", {"w": torch.ones(4)})
    before = open(tmp_path / "c" / "metadata.json").read()
    with pytest.raises(unickpt.CheckpointExistsError, match="already holds a committed checkpoint"):
        unickpt.save(tmp_path / "c", {"w": torch.zeros(4)})
    assert open(tmp_path / "c" / "metadata.json").read() == before


def test_save_never_deletes_what_it_did_not_write(tmp_path):
    os.makedirs(tmp_path / "project" / "src")
    (tmp_path / "project" / "src" / "main.py").write_text("important")
    with pytest.raises(unickpt.CheckpointExistsError, match="not a unickpt checkpoint directory"):
        unickpt.save(tmp_path / "project", {"w": torch.ones(2)})
    assert (tmp_path / "project" / "src" / "main.py").read_text() == "important"
    (tmp_path / "afile").write_text("user data")
    with pytest.raises(unickpt.CheckpointExistsError):
        unickpt.save(tmp_path / "afile", {"w": torch.ones(2)})
    assert (tmp_path / "afile").read_text() == "user data"
    # a crashed save's leftovers are replaced
    os.makedirs(tmp_path / "crashed" / "data")
    (tmp_path / "crashed" / "data" / "0_0.bin").write_bytes(b"partial")
    unickpt.save(tmp_path / "crashed", {"w": torch.ones(2)})
    assert os.path.getsize(tmp_path / "crashed" / "data" / "0_0.bin") == 8


def test_second_save_to_a_path_in_flight_is_refused(tmp_path):
    big = {"x": torch.ones(4 << 20)}
    first = unickpt.save(tmp_path / "c", big, async_save=True)
    with pytest.raises(unickpt.CheckpointExistsError, match="still in flight|already holds a committed"):
        unickpt.save(tmp_path / "c", {"x": torch.zeros(4 << 20)}, async_save=True).wait()
    first.wait()
    out = {"x": torch.zeros(4 << 20)}
    unickpt.load(tmp_path / "c", out)
    assert bool((out["x"] == 1).all())


def test_retention_spares_saves_in_flight_and_latest_is_newest(tmp_path):
    ckpt = Checkpointer(tmp_path / "run")
    big = {"x": torch.ones(2 << 20)}
    ckpt.save(10, big)
    ckpt.save(5, big)  # lower step, saved after: must not be deleted as a crash leftover
    ckpt.wait()
    assert [s for s, ok in unickpt.list_checkpoints(str(tmp_path / "run")) if ok] == [5, 10]
    assert (tmp_path / "run" / "latest").read_text() == "step_10"


def test_conj_and_neg_views_are_not_aliases(tmp_path):
    c = torch.randn(3, dtype=torch.complex64)
    unickpt.save(tmp_path / "c", {"a": c, "b": c.conj()})
    out = {"a": torch.zeros(3, dtype=torch.complex64), "b": torch.zeros(3, dtype=torch.complex64)}
    unickpt.load(tmp_path / "c", out)
    assert torch.equal(out["a"], c) and torch.equal(out["b"], c.conj().resolve_conj())


def test_failed_load_leaves_state_untouched(tmp_path):
    unickpt.save(tmp_path / "c", {"a": torch.ones(3), "b": torch.ones(3), "cfg": Config(1)}, allow_pickle=True)
    state = {"a": torch.zeros(3), "b": torch.zeros(4), "cfg": None}
    with pytest.raises(unickpt.StateMismatchError, match="'b'"):
        unickpt.load(tmp_path / "c", state)
    state["b"] = torch.zeros(3)
    with pytest.raises(unickpt.UnsafeObjectError):
        unickpt.load(tmp_path / "c", state)
    assert state["a"].sum() == 0 and state["b"].sum() == 0 and state["cfg"] is None


def test_unloadable_targets_are_named(tmp_path):
    unickpt.save(tmp_path / "c", {"w": torch.ones(3, 2), "t": (torch.ones(1), 5)})
    with pytest.raises(unickpt.StateMismatchError, match="'w': .*meta device"):
        unickpt.load(tmp_path / "c", {"w": torch.empty(3, 2, device="meta"), "t": (torch.zeros(1), 5)})
    with pytest.raises(unickpt.StateMismatchError, match="'w': .*expanded view"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(1, 2).expand(3, 2), "t": (torch.zeros(1), 5)})
    with pytest.raises(unickpt.StateMismatchError, match=r"'t.1': checkpoint has 5, the state has 0 inside a tuple"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(3, 2), "t": (torch.zeros(1), 0)})
    with pytest.raises(unickpt.SaveFailedError, match="layout torch.sparse_coo is not supported"):
        unickpt.save(tmp_path / "s", {"w": torch.eye(3).to_sparse()})
    # a save of a meta tensor: refused by name (its staging copied from address 0: the process died)
    with pytest.raises(unickpt.SaveFailedError, match=r"'w': a tensor on the meta device has no data to save"):
        unickpt.save(tmp_path / "m", {"w": torch.empty(3, 2, device="meta"), "ok": torch.ones(2)})
    assert not (tmp_path / "m" / "metadata.json").exists()


def test_damaged_checkpoint_files_raise_integrity_errors(tmp_path):
    unickpt.save(tmp_path / "c", {"w": torch.ones(4)})
    meta_path = tmp_path / "c" / "metadata.json"
    good = meta_path.read_text()
    meta = json.loads(good)
    meta["tensors"]["w"]["chunks"][0]["file"] = "../../../etc/passwd"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(unickpt.IntegrityError, match="outside the checkpoint directory"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(4)})
    for field, value, message in (("byte_offset", -8, "non-negative offset"), ("byte_length", 8, "expected 16"),
                                  ("byte_offset", 1 << 40, "truncated")):
        meta = json.loads(good)
        meta["tensors"]["w"]["chunks"][0][field] = value
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(unickpt.IntegrityError, match=message):
            unickpt.load(tmp_path / "c", {"w": torch.zeros(4)})
    meta = json.loads(good)
    meta["tensors"]["w"]["dtype"] = "float99"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(unickpt.IntegrityError, match="unknown torch dtype 'float99'"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(4)})
    meta_path.write_text("{not json")
    with pytest.raises(unickpt.IntegrityError, match="not valid JSON"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(4)})
    del meta["tensors"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(unickpt.IntegrityError, match="malformed metadata"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(4)})
    meta_path.write_text(good)
    os.remove(tmp_path / "c" / "data" / "0_0.bin")
    with pytest.raises(unickpt.IntegrityError, match="is missing"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(4)})


def test_unknown_format_version_is_rejected(tmp_path):
    unickpt.save(tmp_path / "c", {"w": torch.ones(4)})
    meta_path = tmp_path / "c" / "metadata.json"
    meta = json.load(open(meta_path))
    meta["format_version"] = 99
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(unickpt.FormatVersionError, match="format_version 99 is not supported .* reads versions 1, 2"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(4)})


def test_corrupt_and_truncated_data_are_detected(tmp_path):
    unickpt.save(tmp_path / "c", {"w": torch.arange(64, dtype=torch.float32)})
    data = tmp_path / "c" / "data" / "0_0.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(unickpt.IntegrityError, match="checksum"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(64)})
    data.write_bytes(bytes(raw[:100]))
    with pytest.raises(unickpt.IntegrityError, match="truncated"):
        unickpt.load(tmp_path / "c", {"w": torch.zeros(64)})


class Config:
    def __init__(self, lr):
        self.lr = lr


def test_arbitrary_objects_need_allow_pickle(tmp_path):
    with pytest.raises(unickpt.UnsafeObjectError, match=r"'cfg': a value of class .*Config .*allow_pickle=True"):
        unickpt.save(tmp_path / "c", {"cfg": Config(0.1)})
    assert not (tmp_path / "c" / "metadata.json").exists()
    unickpt.save(tmp_path / "c", {"cfg": Config(0.1)}, allow_pickle=True)
    out = {"cfg": None}
    with pytest.raises(unickpt.UnsafeObjectError, match=r"'cfg'.*Config.*allow_pickle=True"):
        unickpt.load(tmp_path / "c", out)
    unickpt.load(tmp_path / "c", out, allow_pickle=True)
    assert out["cfg"].lr == 0.1


def test_per_rank_and_rng_state_restored(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    state = {"rng": unickpt.RNGState(), "cursor": unickpt.PerRank({"pos": 17})}
    unickpt.save(tmp_path / "c", state)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    out = {"rng": unickpt.RNGState(), "cursor": unickpt.PerRank(None)}
    unickpt.load(tmp_path / "c", out)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]
    assert out["cursor"].value == {"pos": 17}


def test_checkpointer_latest_retention_and_crash_leftovers(tmp_path):
    root = tmp_path / "run"
    ckpt = Checkpointer(root, keep_last=2)
    w = torch.zeros(8)
    assert ckpt.load({"w": w}) is None and ckpt.latest_step() is None
    for step in range(1, 5):
        w.fill_(step)
        ckpt.save(step * 10, {"w": w, "step": step})
        if step == 2:
            ckpt.wait()
            os.makedirs(root / "step_25" / "data")  # a crashed save's leftovers
    ckpt.wait()
    assert sorted(os.listdir(root)) == ["latest", "step_30", "step_40"]
    assert (root / "latest").read_text() == "step_40"
    out = {"w": torch.zeros(8), "step": 0}
    assert ckpt.load(out) == 40 and out["w"][0] == 4 and out["step"] == 4
    assert ckpt.load(out, step=30) == 30 and out["w"][0] == 3
    # an incomplete newer directory is ignored by latest_step and load
    os.makedirs(root / "step_50" / "data")
    assert ckpt.latest_step() == 40 and ckpt.load(out) == 40
    listing = unickpt.list_checkpoints(str(root))
    assert listing == [(30, True), (40, True), (50, False)]
    ckpt.close()


def test_failed_write_commits_nothing_and_keeps_previous(tmp_path):
    import errno

    from unickpt.testing import Fault, inject

    root = tmp_path / "run"
    ckpt = Checkpointer(root, keep_last=1)
    ckpt.save(1, {"w": torch.ones(4)}).wait()
    with inject(Fault("write", nth=None, errno=errno.ENOSPC)) as (fault,):
        handle = ckpt.save(2, {"w": torch.full((4,), 2.0)})
        with pytest.raises(unickpt.SaveFailedError, match=r"(?s)rank\(s\) \[0\].*No space left on device"):
            handle.wait()
    assert fault.fired >= 1
    assert not (root / "step_2" / "metadata.json").exists()
    assert (root / "latest").read_text() == "step_1" and ckpt.latest_step() == 1
    out = {"w": torch.zeros(4)}
    assert ckpt.load(out) == 1 and out["w"].sum() == 4


def test_plain_containers_replaced_whole_and_nested_statefuls(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step(), sched.step()
    state = {"train": {"sched": sched, "epoch": 3, "hist": [1.5, 2.5]}, "cfg": {"lr": 0.5, 1: (2, 3)}, "model": model}
    unickpt.save(tmp_path / "c", state)
    model2 = nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    out = {"train": {"sched": sched2, "epoch": 0, "hist": None}, "cfg": None, "model": model2}
    unickpt.load(tmp_path / "c", out)
    assert out["train"]["sched"] is sched2 and sched2.last_epoch == 1 and sched2.get_last_lr() == [0.25]
    assert out["train"]["epoch"] == 3 and out["train"]["hist"] == [1.5, 2.5]
    assert out["cfg"] == {"lr": 0.5, 1: (2, 3)}
    assert torch.equal(model2.weight, model.weight)


def test_partial_reads_verify_only_the_blocks_they_touch(tmp_path):
    from unickpt.format.integrity import CHECKSUM_BLOCK_BYTES as B

    n = 3 * B // 4  # float32 elements filling exactly 3 checksum blocks
    full = torch.arange(n, dtype=torch.float32)
    unickpt.save(tmp_path / "c", {"x": full})
    meta = json.load(open(tmp_path / "c" / "metadata.json"))
    assert len(meta["tensors"]["x"]["chunks"][0]["block_checksums"]) == 3
    data = tmp_path / "c" / "data" / "0_0.bin"
    raw = bytearray(data.read_bytes())
    raw[2 * B + 100] ^= 0x01  # corrupt block 2
    data.write_bytes(bytes(raw))

    head = torch.zeros(1000)
    stats = unickpt.load(tmp_path / "c", {"x": unickpt.Shard(head, (n,), offsets=(0,))})
    assert torch.equal(head, full[:1000]) and stats.bytes_read == B and stats.blocks_verified == 1
    tail = torch.zeros(1000)
    with pytest.raises(unickpt.IntegrityError, match=rf"bytes \[{2 * B}, {3 * B}\) of chunk .* checksum"):
        unickpt.load(tmp_path / "c", {"x": unickpt.Shard(tail, (n,), offsets=(n - 1000,))})
    assert tail.sum() == 0  # nothing was copied from the corrupt block
    stats = unickpt.load(tmp_path / "c", {"x": unickpt.Shard(tail, (n,), offsets=(n - 1000,))}, verify=False)
    assert stats.bytes_read == 4000 and stats.blocks_verified == 0


def _adam_run(tmp_path, save_at: int | None, steps: int = 3):
    """A small model trained ``steps`` Adam steps (with a StepLR), saved before step ``save_at``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, 2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        if i == save_at:
            unickpt.save(tmp_path / f"s{i}", {"model": model, "optim": optim, "sched": sched})
            assert not optim.state, f"the save created optimizer state: {dict(optim.state)}"
            assert all(p.grad is None for p in model.parameters()), "the save left gradients behind"
        model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
        optim.step()
        sched.step()
        optim.zero_grad()
    return model, optim, sched


def test_save_of_an_optimizer_that_never_stepped_leaves_it_as_it_is(tmp_path):
    # torch's get_state_dict initialises an empty optimizer with a zero-grad, lr=0 step() (Adam's step
    # 0 -> 1): a run that saved before its first step must train exactly like one that never saved
    saved_model, saved_optim, _ = _adam_run(tmp_path, save_at=0)
    plain_model, plain_optim, _ = _adam_run(tmp_path, save_at=None)
    for (k, a), b in zip(saved_model.state_dict().items(), plain_model.state_dict().values()):
        assert torch.equal(a, b), k
    assert [float(s["step"]) for s in saved_optim.state.values()] == [3.0] * 4
    meta = json.loads((tmp_path / "s0" / "metadata.json").read_text())
    assert not [k for k in meta["tensors"] if k.startswith("optim.")], "an empty optimizer saved moments"


def test_early_checkpoint_restores_an_empty_optimizer_state(tmp_path):
    # saved before the first step, loaded into the trained optimizer and into a fresh one: both come
    # back with no state (as optimizer.load_state_dict of the saved state dict gives), weights bitwise
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim})
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    assert optim.state
    unickpt.load(tmp_path / "c", {"model": model, "optim": optim})
    assert dict(optim.state) == {}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    fresh = nn.Linear(4, 3)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.1)
    unickpt.load(tmp_path / "c", {"model": fresh, "optim": fresh_optim})
    assert dict(fresh_optim.state) == {} and all(p.grad is None for p in fresh.parameters())
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights.items())
    # a checkpoint with moments still refuses a target whose state has other keys (no silent skip)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    unickpt.save(tmp_path / "d", {"model": model, "optim": optim})
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(unickpt.StateMismatchError, match="exp_avg"):
        unickpt.load(tmp_path / "d", {"model": fresh, "optim": sgd})


def test_only_an_unstepped_optimizer_of_the_same_groups_replaces_a_target_state(tmp_path):
    # the saved empty optimizer state replaces the target's only for an optimizer state dict whose
    # param groups match: another optimizer class, other groups or any other empty container raise
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    unickpt.save(tmp_path / "sgd", {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)})
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(unickpt.StateMismatchError, match=r"missing from the checkpoint: .*optim\.state"):
        unickpt.load(tmp_path / "sgd", {"model": model, "optim": adam})
    assert adam.state and all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    class EMA:  # a stateful object whose saved shadow dict was still empty
        def __init__(self, shadow):
            self.shadow = shadow

        def state_dict(self):
            return {"shadow": self.shadow}

        def load_state_dict(self, sd):
            self.shadow = sd["shadow"]

    unickpt.save(tmp_path / "ema", {"ema": EMA({}), "plain": {"b": {}}})
    with pytest.raises(unickpt.StateMismatchError, match=r"'ema\.shadow\.w'"):
        unickpt.load(tmp_path / "ema", {"ema": EMA({"w": torch.ones(2)}), "plain": {"b": {}}})
    with pytest.raises(unickpt.StateMismatchError, match=r"'plain\.b\.x'"):
        unickpt.load(tmp_path / "ema", {"ema": EMA({}), "plain": {"b": {"x": torch.ones(2)}}})


def test_a_finished_save_keeps_nothing_of_the_state_alive(tmp_path):
    # the save thread held the last request (and its snapshot: the caller's modules, optimizers and
    # tensors) while waiting for the next save: a model deleted after its last save stayed in memory
    import gc
    import weakref

    model = torch.nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    unickpt.save(tmp_path / "sync", {"model": model, "optim": optim})
    for mode in ("sync", "overlap"):
        ck = unickpt.Checkpointer(tmp_path / mode, async_save=True, save_options=unickpt.SaveOptions(snapshot=mode))
        ck.save(1, {"model": model, "optim": optim})
        ck.wait()
    refs = [weakref.ref(x) for x in (model, optim, model.weight, optim.state[model.weight]["exp_avg"])]
    del model, optim
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4


@pytest.mark.parametrize("cls,amsgrad", [(torch.optim.AdamW, False), (torch.optim.Adam, True)])
def test_loading_into_a_fresh_adam_equals_torchs_zero_step_path(tmp_path, cls, amsgrad, monkeypatch):
    # a load creates an empty Adam's moments directly (flat.create_adam_state) instead of torch's
    # zero-gradient lr=0 step (most of a restart's load call): the loaded state is the same, bitwise
    from unickpt.state import flat

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        model[1].bias.requires_grad_(False)  # a frozen parameter: no state, as after real steps
        return model, cls(model.parameters(), lr=0.01, amsgrad=amsgrad, weight_decay=0.1)

    model, optim = build()
    for _ in range(3):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim})
    loaded = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(flat, "create_adam_state", lambda o: False)
        m2, o2 = build()
        with torch.no_grad():
            for p in m2.parameters():
                p.fill_(7.0)
        unickpt.load(tmp_path / "c", {"model": m2, "optim": o2})
        loaded.append((m2, o2))
    (mf, of), (mt, ot) = loaded
    want = optim.state_dict()
    for got in (of.state_dict(), ot.state_dict()):
        assert got["param_groups"] == want["param_groups"]
        assert sorted(got["state"]) == sorted(want["state"]) == [0, 1, 2]
        for k, st in want["state"].items():
            assert sorted(got["state"][k]) == sorted(st)
            for name, t in st.items():
                g = got["state"][k][name]
                assert g.dtype == t.dtype and g.device == t.device and g.shape == t.shape and torch.equal(g, t), (k, name)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(model.parameters(), mf.parameters(), mt.parameters()))


def test_create_adam_state_leaves_other_optimizers_to_torch():
    from unickpt.state.flat import create_adam_state

    lin = torch.nn.Linear(2, 2)
    assert not create_adam_state(torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9))
    assert not create_adam_state(torch.optim.Adam(lin.parameters(), foreach=False, differentiable=True))
    lin(torch.randn(1, 2)).sum().backward()
    with_grads = torch.optim.AdamW(lin.parameters())
    assert not create_adam_state(with_grads) and not with_grads.state  # torch's path leaves it empty too
    lin.zero_grad(set_to_none=True)
    fresh = torch.optim.AdamW(lin.parameters(), amsgrad=True)
    assert create_adam_state(fresh) and not create_adam_state(fresh)  # once: then it has state
    st = fresh.state[lin.weight]
    assert sorted(st) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    assert st["step"].dtype == torch.float32 and st["step"].dim() == 0 and float(st["step"]) == 0.0
    assert not st["exp_avg"].any() and st["exp_avg"].shape == lin.weight.shape


class _WithUnused(torch.nn.Module):
    """A layer that gets no gradient (an unused head, an expert that got no tokens)."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 3)
        self.unused = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("make_optim", [lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                        lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2)),
                                        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)],
                         ids=["adamw", "adamw-tensor-lr", "sgd-momentum"])
def test_parameters_without_optimizer_state_load_into_a_fresh_optimizer(tmp_path, make_optim):
    torch.manual_seed(0)
    model = _WithUnused()
    optim = make_optim(model.parameters())
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()
    assert len(optim.state) == 2  # the unused layer's parameters have no state
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim})

    fresh = _WithUnused()
    fresh_optim = make_optim(fresh.parameters())
    unickpt.load(tmp_path / "c", {"model": fresh, "optim": fresh_optim})
    want, got = optim.state_dict(), fresh_optim.state_dict()
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1]  # as optimizer.load_state_dict gives
    for i, entries in want["state"].items():
        assert got["state"][i].keys() == entries.keys()
        assert all(torch.equal(got["state"][i][k], v) for k, v in entries.items())
    # and training goes on as it would have: one more step on both, bitwise equal
    x = torch.randn(5, 4)
    for m, o in ((model, optim), (fresh, fresh_optim)):
        m(x).pow(2).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))

    # an optimizer that already had state for them: the checkpoint lacks it, and strict says so
    trained = _WithUnused()
    trained_optim = make_optim(trained.parameters())
    (trained.used(torch.randn(2, 4)).sum() + trained.unused(torch.randn(2, 4)).sum()).backward()
    trained_optim.step()
    with pytest.raises(unickpt.StateMismatchError, match="optim.state.unused.weight"):
        unickpt.load(tmp_path / "c", {"model": trained, "optim": trained_optim})


def test_a_second_load_and_mismatched_param_groups(tmp_path):
    torch.manual_seed(0)
    model = _WithUnused()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optim.step()
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim})
    # loading twice into the same optimizer (it has state for the used layer only): as load_state_dict
    fresh = _WithUnused()
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    for _ in range(2):
        unickpt.load(tmp_path / "c", {"model": fresh, "optim": fresh_optim})
        assert sorted(fresh_optim.state_dict()["state"]) == [0, 1]
        assert all(torch.equal(fresh_optim.state_dict()["state"][i]["exp_avg"], optim.state_dict()["state"][i]["exp_avg"])
                   for i in (0, 1))

    # an optimizer over other parameters, or other groups: refused, naming both groupings (torch: ValueError)
    other = _WithUnused()
    groups = [{"params": other.used.parameters()}, {"params": other.unused.parameters(), "lr": 0.5}]
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(unickpt.StateMismatchError,
                       match=r"'optim': the checkpoint's optimizer has 1 param group\(s\) \[group 0: unused.bias, "
                             r"unused.weight, used.bias, used.weight \(4\)\], the state's has 2 \[group 0: used.bias, "
                             r"used.weight \(2\); group 1: unused.bias, unused.weight \(2\)\]"):
        unickpt.load(tmp_path / "c", {"model": other, "optim": torch.optim.AdamW(groups, lr=1e-2)})
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # refused before any byte landed
    subset = torch.optim.AdamW(other.used.parameters(), lr=1e-2)
    with pytest.raises(unickpt.StateMismatchError, match="param group"):
        unickpt.load(tmp_path / "c", {"model": other, "optim": subset})
