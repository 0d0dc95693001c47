"""Failure paths of a load and the tools (issue #29): a refused load changes nothing (an optimizer without
state stays without state, the model's bytes stay as they were), and errors say what is wrong and what to
do: a checkpoint root, a foreign file, per-rank state at another world size, a dead peer, a closed pipe."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import unickpt

import load_error_workers as w


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _net(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def _stepped(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 8)).sum().backward()
    optim.step()
    optim.zero_grad()


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=0.1),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_a_refused_load_leaves_a_fresh_optimizer_without_state(tmp_path, make):
    """AdamW's state is created by unickpt (create_adam_state), SGD's by torch's zero step: either way a
    load refused for a layer of another size leaves the optimizer as it was: no state, the same state
    object, the LR scheduler's flag untouched, the parameters bitwise the same."""
    model = _net(16)
    optim = make(model.parameters())
    _stepped(model, optim)
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim, "sched": torch.optim.lr_scheduler.StepLR(optim, 5)})
    target = _net(6)
    fresh = make(target.parameters())
    sched = torch.optim.lr_scheduler.StepLR(fresh, 5)
    state_obj, groups = fresh.state, fresh.state_dict()["param_groups"]
    called = getattr(fresh, "_opt_called", None)
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    with pytest.raises(unickpt.StateMismatchError,
                       match=r"'model.0.weight': checkpoint has dtype float32 shape \[16, 8\], the state to load "
                             r"into has dtype float32 shape \[6, 8\]"):
        unickpt.load(tmp_path / "c", {"model": target, "optim": fresh, "sched": sched})
    assert fresh.state is state_obj and len(fresh.state) == 0
    assert fresh.state_dict() == {"state": {}, "param_groups": groups}
    assert getattr(fresh, "_opt_called", None) == called
    for n, p in target.named_parameters():
        assert torch.equal(_bits(p), _bits(before[n])), n
    # the same optimizer then loads a matching checkpoint as usual
    other = make(target.parameters())
    _stepped(target, other)
    unickpt.save(tmp_path / "d", {"model": target, "optim": other})
    unickpt.load(tmp_path / "d", {"model": target, "optim": fresh})
    assert len(fresh.state) == len(list(target.parameters()))


def test_a_refused_load_leaves_an_optimizer_with_state_bitwise_as_it_was(tmp_path):
    model = _net(16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _stepped(model, optim)
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim})
    target = _net(6)
    stepped = torch.optim.AdamW(target.parameters(), lr=0.1)
    _stepped(target, stepped)
    before = {(id(p), k): v.clone() for p, st in stepped.state.items() for k, v in st.items()}
    with pytest.raises(unickpt.StateMismatchError, match="'model.0.weight'"):
        unickpt.load(tmp_path / "c", {"model": target, "optim": stepped})
    after = {(id(p), k): v for p, st in stepped.state.items() for k, v in st.items()}
    assert after.keys() == before.keys()
    assert all(torch.equal(_bits(after[k]), _bits(before[k])) for k in before)


def test_a_refused_fsdp2_load_leaves_a_fresh_adamw_without_state(tmp_path, pool):
    results = pool(2).run(w.fsdp2_refused_load, str(tmp_path / "c"))
    for r in results:
        assert r["error"] is not None and "'model.0.weight': checkpoint has dtype float32 shape [16, 8], the state " \
            "to load into has dtype float32 shape [6, 8]" in r["error"], r["error"]
        assert r["optim_state_len"] == 0 and r["same_state_object"] and r["params_equal"], r


# -- errors that name what the path is ------------------------------------------------------------------
def _root_with_steps(tmp_path) -> str:
    ckpt = unickpt.Checkpointer(tmp_path / "run")
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((3,), float(step))})
    ckpt.wait()
    os.makedirs(tmp_path / "run" / "step_3")  # a save that never finished: not the newest committed
    return str(tmp_path / "run")


def test_load_verify_and_export_of_a_checkpoint_root_name_its_newest_step(tmp_path):
    from unickpt.tools.diff import diff_checkpoints
    from unickpt.tools.export import export_checkpoint
    from unickpt.tools.verify import verify_checkpoint

    root = _root_with_steps(tmp_path)
    want = (f"'{root}' is a checkpoint root, not a checkpoint: its newest committed step is 2 ('{root}/step_2'); "
            f"pass a step_<N> directory (`unickpt ls {root}` lists them), or load the newest with "
            f"unickpt.Checkpointer('{root}').load(state)")
    for call in (lambda: unickpt.load(root, {"w": torch.zeros(3)}), lambda: verify_checkpoint(root),
                 lambda: export_checkpoint(root, str(tmp_path / "out")),
                 lambda: diff_checkpoints(root, os.path.join(root, "step_2"))):
        with pytest.raises(unickpt.CheckpointNotFoundError) as e:
            call()
        assert str(e.value) == want
    os.makedirs(tmp_path / "empty" / "step_1")
    with pytest.raises(unickpt.CheckpointNotFoundError, match=r"is a checkpoint root, not a checkpoint, and none of "
                       r"its 1 step_<N> directories is committed"):
        unickpt.load(tmp_path / "empty", {"w": torch.zeros(3)})
    # an unfinished save keeps its own message
    with pytest.raises(unickpt.CheckpointNotFoundError, match=r"metadata.json is missing \(the save never finished"):
        unickpt.load(os.path.join(root, "step_3"), {"w": torch.zeros(3)})


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "model.pt")
    want = (f"'{tmp_path}/model.pt' is a file, not a unickpt checkpoint directory (a checkpoint is a directory "
            "holding metadata.json; `unickpt import` converts other checkpoint files)")
    for mapping in (None, "auto"):
        with pytest.raises(unickpt.CheckpointNotFoundError) as e:
            unickpt.load(tmp_path / "model.pt", {"w": torch.zeros(3)}, mapping=mapping)
        assert str(e.value) == want


def _lightning_ddp_ckpt(path) -> nn.Module:
    """A Lightning full-dict ``.ckpt`` (what a DDP / single-device run writes through UnickptCheckpointIO):
    the optimizer state keyed by parameter index."""
    pytest.importorskip("lightning")
    from unickpt.lightning import UnickptCheckpointIO

    model = _net(16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _stepped(model, optim)
    io = UnickptCheckpointIO()
    io.save_checkpoint({"global_step": 1, "epoch": 0, "state_dict": model.state_dict(),
                        "optimizer_states": [optim.state_dict()]}, path)
    io.wait()
    return model


LIGHTNING_REFUSAL = ("a Lightning full-dict checkpoint (route 'io': DDP / single device) keys its optimizer state by "
                     "parameter index, which names no parameter; it loads only into Lightning. Use a sharded strategy "
                     "(ModelParallelStrategy, FSDPStrategy sharded) to move runs between frameworks")


def test_a_lightning_ddp_ckpt_is_refused_by_a_cross_framework_load(tmp_path):
    path = tmp_path / "step=1.ckpt"
    _lightning_ddp_ckpt(path)
    target = _net(16)
    optim = torch.optim.AdamW(target.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    with pytest.raises(unickpt.StateMismatchError) as e:
        unickpt.load(path, {"model": target, "optim": optim}, mapping="auto")
    assert str(e.value) == f"'{path}': {LIGHTNING_REFUSAL}"
    assert len(optim.state) == 0
    assert all(torch.equal(_bits(p), _bits(before[n])) for n, p in target.named_parameters())


def test_a_lightning_ddp_ckpt_is_refused_by_accelerate_load_state(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import unickpt.accelerate

    path = tmp_path / "step=1.ckpt"
    _lightning_ddp_ckpt(path)
    acc = Accelerator(cpu=True)
    unickpt.accelerate.enable(acc)
    try:
        model = _net(16)
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, optim = acc.prepare(model, optim)
        with pytest.raises(unickpt.StateMismatchError) as e:
            acc.load_state(str(path))
        assert str(e.value) == f"'{path}': {LIGHTNING_REFUSAL}"
        assert len(optim.optimizer.state) == 0
    finally:
        unickpt.accelerate.wait()
        unickpt.accelerate.disable(acc)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_per_rank_state_at_another_world_size_says_how_to_give_its_rule(tmp_path, pool):
    path = str(tmp_path / "c")
    pool(2).run(w.save_per_rank, path)
    rule = ("to say how to redistribute it: fn(saved_states, rank, world_size) gets every saved rank's state "
            "(index = saved rank) and returns this rank's, e.g. fn = lambda states, rank, world_size: "
            "states[rank % len(states)]")
    with pytest.raises(unickpt.PerRankReshardError) as e:
        unickpt.load(path, {"rng": unickpt.RNGState(), "pos": unickpt.PerRank(None, reshard=lambda s, r, n: s[1])})
    assert str(e.value) == ("'rng': per-rank state was saved by 2 ranks and is being loaded by 1; give "
                            f"RNGState(reshard=fn) {rule}")
    with pytest.raises(unickpt.PerRankReshardError) as e:
        unickpt.load(path, {"rng": unickpt.RNGState(reshard=lambda s, r, n: s[0]), "pos": unickpt.PerRank(None)})
    assert str(e.value) == ("'pos': per-rank state was saved by 2 ranks and is being loaded by 1; give "
                            f"PerRank(obj, reshard=fn) {rule}")
    # what the messages say works; a plain PerRank's value is read back from .value
    pos = unickpt.PerRank(None, reshard=lambda states, rank, world_size: states[1])
    unickpt.load(path, {"rng": unickpt.RNGState(reshard=lambda states, rank, world_size: states[0]), "pos": pos})
    assert pos.value == {"rank": 1}


# -- the command line -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tensors", [2, 400], ids=["short", "long"])
def test_cli_output_into_a_closed_pipe_stops_quietly(tmp_path, tensors):
    """``unickpt inspect ... | head``: the reader leaves before the output is written (its end of the pipe
    is closed first); no error on stderr, exit code 141 (what a shell reports for a SIGPIPE death)."""
    import subprocess
    import sys

    unickpt.save(tmp_path / "c", {f"layer{i}.weight": torch.zeros(2) for i in range(tensors)})
    for command in (["inspect", str(tmp_path / "c")], ["ls", str(tmp_path)]):
        proc = subprocess.Popen([sys.executable, "-m", "unickpt", *command], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141 and err == "", (command, proc.returncode, err)


def test_import_of_a_trainer_checkpoint_names_the_training_state_it_leaves_behind(tmp_path, caplog):
    """A Hugging Face Trainer ``checkpoint-N`` folder: the weights are imported (bitwise), and the Trainer's
    optimizer, scheduler and RNG files are named, in a warning and in the result, never dropped silently."""
    import json
    import logging
    import subprocess
    import sys

    from unickpt.tools.export import export_checkpoint
    from unickpt.tools.importers import import_checkpoint

    model = _net(16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _stepped(model, optim)
    unickpt.save(tmp_path / "u", {"model": model})
    folder = tmp_path / "checkpoint-5"
    export_checkpoint(str(tmp_path / "u"), str(folder), keys="model")
    torch.save(optim.state_dict(), folder / "optimizer.pt")
    torch.save({"last_epoch": 5}, folder / "scheduler.pt")
    torch.save({"cpu_rng_state": torch.get_rng_state()}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    left = ["optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"]
    with caplog.at_level(logging.WARNING, logger="unickpt"):
        res = import_checkpoint(str(folder), str(tmp_path / "step_5"), prefix="model")
    assert res.not_imported == left
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"unickpt import: {folder} is a Hugging Face Trainer checkpoint; imported its model weights only, not "
        f"{', '.join(left)} (the Trainer's training state: its optimizer state is keyed by parameter index, not by "
        "name; resume training from the folder itself, Trainer.train(resume_from_checkpoint=...))"]
    target = _net(16)
    unickpt.load(tmp_path / "step_5", {"model": target})
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(target.parameters(), model.parameters()))
    # the command: the warning on stderr, the list in --json
    run = subprocess.run([sys.executable, "-m", "unickpt", "import", str(folder), str(tmp_path / "cli"), "--json"],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["not_imported"] == left
    assert "imported its model weights only, not optimizer.pt, rng_state.pth, scheduler.pt" in run.stderr
    # a plain model folder: nothing left behind, no warning
    caplog.clear()
    for name in left:
        os.remove(folder / name)
    assert import_checkpoint(str(folder), str(tmp_path / "plain")).not_imported == []
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


# -- a dead peer ----------------------------------------------------------------------------------------------
GLOO_LOST = r"\((RuntimeError|DistBackendError): .*(Connection reset by peer|Connection closed by peer)"


@pytest.mark.parametrize("op", ["save", "load"])
def test_a_dead_peer_is_named_not_the_survivor(tmp_path, op):
    """Rank 1 dies (``os._exit``) during an async save's drain, or before a load's first collective; rank 0's
    error names rank 1 as the rank that failed, saying rank 0 lost contact with it."""
    import re

    import dist_workers
    from unickpt.testing import DistPool

    path, report = str(tmp_path / "c"), tmp_path / "report.txt"
    worker = dist_workers.die_during_save if op == "save" else w.die_in_load
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] died"):
        with DistPool(2, timeout_s=120) as pool:
            pool.run(worker, path, str(report))
    text = report.read_text()
    head, body = text.split("\n", 1)
    if op == "save":
        assert head == f"SaveFailedError: save to {path!r} failed on rank(s) [1]; nothing was committed", text
        when = "before the commit (or the process group was destroyed first)"
    else:
        assert head == f"LoadFailedError: load of {path!r} failed on rank(s) [1]", text
        when = "while the ranks compared their needs"
    assert body.startswith(f"--- rank 1 ---\nrank 0 lost contact with rank 1 {when}: it died, stopped answering, "
                           "or left the process group before the operation finished ("), text
    assert re.search(GLOO_LOST, body), text
    assert "--- rank 0 ---" not in text
    if op == "save":
        assert not os.path.exists(os.path.join(path, "metadata.json"))


def test_a_load_refused_for_a_truncated_file_leaves_the_target_unchanged(tmp_path):
    """The tail of the only data file is cut: the load fails before any byte lands, also those of the
    tensors stored before the cut (the model's), which were read and copied first before."""
    model = torch.nn.Linear(64, 64)
    path = tmp_path / "c"
    unickpt.save(path, {"m": model, "x": torch.randn(300_000)})
    data = path / "data" / "0_0.bin"
    size = data.stat().st_size
    os.truncate(data, size - 100)
    target = torch.nn.Linear(64, 64)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    x = torch.zeros(300_000)
    with pytest.raises(unickpt.IntegrityError) as err:
        unickpt.load(path, {"m": target, "x": x})
    assert f"truncated checkpoint file: {data}: the file holds {size - 100} bytes, the checkpoint needs {size} " \
           "(the file is truncated)" in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert not x.any()
