"""``unickpt.transformers``: Trainer's checkpoints through unickpt, against Trainer's own.

Real Trainer runs (a small random Llama, CPU): in this process for one process, under torchrun
(gloo DDP) for 2 and 3 processes. What must hold: Trainer's files and names (its own test suite's
``check_saved_checkpoints`` list), ``from_pretrained`` / ``safetensors`` reading the weights the engine
wrote, ``save_total_limit`` rotation, the losses of a resumed run equal to the uninterrupted run's (and
to Trainer's own run's), a resume on 3 processes from a 2-process checkpoint, and the zero-code switch.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "trainer_worker.py")
TRAINER_FILES = ["model.safetensors", "training_args.bin", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                 "config.json"]  # transformers' tests/trainer/trainer_test_utils.py check_saved_checkpoints


def _train_with_unickpt(trainer, **train_kwargs):
    """``trainer.train(**train_kwargs)`` with the plugin enabled for this trainer only."""
    import unickpt.transformers as ut

    ut.enable(trainer)
    try:
        return trainer.train(**train_kwargs)
    finally:
        ut.disable(trainer)


def _tiny_trainer(out: str, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 256

        def __getitem__(self, i: int) -> dict:
            x = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x}

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, tie_word_embeddings=kw.pop("tie", False))
    args = TrainingArguments(out, report_to=[], use_cpu=True, per_device_train_batch_size=4, seed=0,
                             disable_tqdm=True, **kw)
    return Trainer(LlamaForCausalLM(cfg), args, train_dataset=Tokens())


@pytest.mark.parametrize("tie", [False, True])
def test_one_process_checkpoints_hold_trainers_files_and_the_weights_as_safetensors(tmp_path, tie):
    import unickpt.transformers as ut
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    trainer = _tiny_trainer(str(tmp_path), save_steps=2, max_steps=6, save_total_limit=2, tie=tie)
    ut.enable(trainer)
    try:
        assert ut.is_enabled(trainer) and not ut.is_enabled()
        trainer.train()
    finally:
        ut.disable(trainer)
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-6"]
    for step in (4, 6):
        ckpt = tmp_path / f"checkpoint-{step}"
        assert all((ckpt / name).is_file() for name in TRAINER_FILES), sorted(os.listdir(ckpt))
        assert (ckpt / "metadata.json").is_file()
        assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == step
        assert set(torch.load(ckpt / "optimizer.pt", weights_only=True)) == {ut.OPTIMIZER_POINTER}
    final = tmp_path / "checkpoint-6"
    live = trainer.model.state_dict()
    stored = load_file(str(final / "model.safetensors"))
    expect = {k for k in live if not (tie and k == "lm_head.weight")}  # tied: one copy, as save_pretrained keeps
    assert set(stored) == expect and all(torch.equal(stored[k], live[k]) for k in expect)
    loaded = LlamaForCausalLM.from_pretrained(str(final))
    assert all(torch.equal(v, live[k]) for k, v in loaded.state_dict().items())


def test_a_checkpoint_folder_of_an_earlier_run_is_replaced_like_trainer_does(tmp_path):
    stale = tmp_path / "checkpoint-2"
    stale.mkdir()
    (stale / "leftover.txt").write_text("from an earlier run")
    trainer = _tiny_trainer(str(tmp_path), save_steps=2, max_steps=2)
    _train_with_unickpt(trainer)
    assert not (stale / "leftover.txt").exists() and (stale / "metadata.json").is_file()


def _torchrun(nproc: int, out, *args: str, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           WORKER, str(out), *args]
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    tag = next((args[i + 1] for i, a in enumerate(args) if a == "--tag"), "")
    with open(os.path.join(out, f"losses-{tag}{nproc}.json")) as f:
        return json.load(f)


def test_ddp_resume_equals_the_uninterrupted_run_and_reshards_to_three_processes(tmp_path):
    own = _torchrun(2, tmp_path / "own", "--max-steps", "8", "--save-steps", "4")
    ours = _torchrun(2, tmp_path / "ours", "--max-steps", "8", "--save-steps", "4", "--unickpt")
    assert ours["enabled"] and not own["enabled"]
    assert ours["losses"] == own["losses"]  # saving changes nothing of the run
    ckpt = tmp_path / "ours" / "checkpoint-4"
    names = sorted(os.listdir(ckpt))
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
            "rng_state_0.pth", "rng_state_1.pth", "metadata.json"} <= set(names), names
    for n in (2, 3):  # resume in a fresh output folder that holds the 2-process checkpoint
        run = tmp_path / f"resume{n}"
        run.mkdir()
        shutil.copytree(ckpt, run / "checkpoint-4")
        got = _torchrun(n, run, "--max-steps", "8", "--save-steps", "2", "--unickpt", "--resume", "last")
        assert sorted(got["losses"], key=int) == ["5", "6", "7", "8"]
        if n == 2:
            assert got["losses"] == {k: v for k, v in ours["losses"].items() if int(k) > 4}
        assert (run / "checkpoint-8" / f"model-0000{n}-of-0000{n}.safetensors").is_file()
    # a checkpoint Trainer wrote itself still resumes with unickpt on (Trainer's own loader)
    run = tmp_path / "from_own"
    run.mkdir()
    shutil.copytree(tmp_path / "own" / "checkpoint-4", run / "checkpoint-4")
    got = _torchrun(2, run, "--max-steps", "8", "--save-steps", "4", "--unickpt", "--resume", "last")
    assert got["losses"] == {k: v for k, v in own["losses"].items() if int(k) > 4}


def test_deepspeed_under_trainer_saves_through_unickpt_and_resumes_on_two_and_three_processes(tmp_path):
    """Trainer under DeepSpeed (ZeRO-2, CPU): with UNICKPT_TRANSFORMERS=1 and an unchanged script, Trainer's
    own save path runs and its DeepSpeed engine's checkpoint (checkpoint-N/global_stepN) is unickpt's; a resume
    on 2 processes continues the uninterrupted run bitwise, and one on 3 processes reshards the ZeRO
    partitions (DeepSpeed's own checkpoint needs an offline conversion for that)."""
    pytest.importorskip("deepspeed")
    root = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
    env = {"UNICKPT_TRANSFORMERS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  os.path.join(root, ".venv", "torch_extensions"))}
    ds = ("--max-steps", "4", "--save-steps", "2", "--deepspeed", "2")
    own = _torchrun(2, tmp_path / "own", *ds, env={**env, "UNICKPT_TRANSFORMERS": "0"})
    ours = _torchrun(2, tmp_path / "ours", *ds, env=env)
    assert not ours["enabled"]  # the script did not call enable()
    assert ours["losses"] == own["losses"]  # saving changes nothing of the run
    for step in (2, 4):
        tag = tmp_path / "ours" / f"checkpoint-{step}" / f"global_step{step}"
        meta = json.loads((tag / "metadata.json").read_text())
        assert meta["framework"] == "deepspeed" and meta["layout"]["world_size"] == 2
        assert (tag.parent / "latest").read_text().strip() == f"global_step{step}"
        assert (tag.parent / "model.safetensors").is_file() and (tag.parent / "trainer_state.json").is_file()
        native = tmp_path / "own" / f"checkpoint-{step}" / f"global_step{step}"
        assert not (native / "metadata.json").exists() and any(n.endswith("optim_states.pt") for n in os.listdir(native))
    for n in (2, 3):
        got = _torchrun(n, tmp_path / "ours", *ds, "--resume", str(tmp_path / "ours" / "checkpoint-2"), "--tag",
                        f"r{n}-", env=env)
        assert sorted(got["losses"], key=int) == ["3", "4"]
        if n == 2:
            assert got["losses"] == {k: v for k, v in ours["losses"].items() if int(k) > 2}


def _safetensors_weights(folder) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        out.update(load_file(os.path.join(folder, name)))
    return out


def test_fsdp2_under_trainer_gathers_the_weights_and_resumes_on_any_layout(tmp_path):
    """Trainer under FSDP2 (CPU: Accelerate's state switched to FSDP as on GPUs, see trainer_worker.py): the save
    gathers each DTensor weight whole into one process's safetensors file (what Trainer's FULL_STATE_DICT
    model.safetensors holds, bitwise); a resume under FSDP2 on 2 processes continues the run bitwise, on 3
    reshards it, and a DDP run resumes the FSDP2 checkpoint bitwise too; load_best_model_at_end loads the best
    checkpoint's weights into the shards."""
    fsdp = ("--max-steps", "4", "--save-steps", "2", "--fsdp")
    own = _torchrun(2, tmp_path / "own", *fsdp, "FULL_STATE_DICT")
    ours = _torchrun(2, tmp_path / "ours", *fsdp, "SHARDED_STATE_DICT", "--unickpt")
    assert ours["enabled"] and ours["losses"] == own["losses"]
    for step in (2, 4):
        ckpt = tmp_path / "ours" / f"checkpoint-{step}"
        names = sorted(os.listdir(ckpt))
        assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                "metadata.json", "optimizer.pt", "scheduler.pt", "trainer_state.json", "config.json"} <= set(names)
        assert not [n for n in names if n.startswith(("pytorch_model_fsdp", "optimizer_0"))], names
        theirs = _safetensors_weights(tmp_path / "own" / f"checkpoint-{step}")  # Trainer's gathered model.safetensors
        mine = _safetensors_weights(ckpt)
        assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    after = {k: v for k, v in ours["losses"].items() if int(k) > 2}
    resume = ("--resume", str(tmp_path / "ours" / "checkpoint-2"))
    assert _torchrun(2, tmp_path / "ours", *fsdp, "SHARDED_STATE_DICT", "--unickpt", *resume, "--tag", "f2-")[
        "losses"] == after
    assert sorted(_torchrun(3, tmp_path / "ours", *fsdp, "SHARDED_STATE_DICT", "--unickpt", *resume, "--tag", "f3-")[
        "losses"], key=int) == ["3", "4"]
    assert _torchrun(2, tmp_path / "ours", "--max-steps", "4", "--save-steps", "2", "--unickpt", *resume, "--tag",
                     "ddp-")["losses"] == after  # DDP from an FSDP2 checkpoint
    best = _torchrun(2, tmp_path / "best", "--max-steps", "6", "--save-steps", "2", "--fsdp", "SHARDED_STATE_DICT",
                     "--unickpt", "--load-best", "--save-total-limit", "2")["best"]
    assert best["equal"] is True and best["checkpoint"] in ("checkpoint-2", "checkpoint-4")


def test_zero_code_switch_routes_an_unmodified_script(tmp_path):
    got = _torchrun(1, tmp_path, "--max-steps", "2", "--save-steps", "2", env={"UNICKPT_TRANSFORMERS": "1"})
    assert not got["enabled"]  # the script did not call enable()
    assert (tmp_path / "checkpoint-2" / "metadata.json").is_file()
    assert (tmp_path / "checkpoint-2" / "model.safetensors").is_file()


def test_save_only_model_checkpoints_hold_no_optimizer_state_and_resume_as_trainer_does(tmp_path, caplog):
    import unickpt.transformers as ut

    trainer = _tiny_trainer(str(tmp_path), save_steps=2, max_steps=2, save_only_model=True)
    ut.enable(trainer)
    try:
        trainer.train()
        ckpt = tmp_path / "checkpoint-2"
        names = sorted(os.listdir(ckpt))
        assert "optimizer.pt" not in names and "scheduler.pt" not in names and "model.safetensors" in names
        meta = json.loads((ckpt / "metadata.json").read_text())
        assert meta["extra"]["transformers"]["optimizer"] is False
        assert all(not k.startswith("optimizer") for k in meta["tensors"])
        again = _tiny_trainer(str(tmp_path / "again"), save_steps=2, max_steps=4, save_only_model=True)
        ut.enable(again)
        with caplog.at_level("WARNING", logger="unickpt.transformers"):
            again.train(resume_from_checkpoint=str(ckpt))
        assert "save_only_model=True: no optimizer or scheduler state" in caplog.text
        assert again.state.global_step == 4
    finally:
        ut.disable(trainer)


def test_resume_loads_the_optimizer_alone_when_the_weights_files_were_replaced(tmp_path):
    """Trainer's own test_resume_training_with_shard_checkpoint re-shards a checkpoint's weights: the
    resume reads the weights through Trainer and only the optimizer state through unickpt."""
    import unickpt.transformers as ut
    from transformers import LlamaForCausalLM

    full = _tiny_trainer(str(tmp_path / "full"), save_steps=2, max_steps=4)
    ut.enable(full)
    try:
        full.train()
        ckpt = tmp_path / "full" / "checkpoint-2"
        weights = LlamaForCausalLM.from_pretrained(str(ckpt))
        os.remove(ckpt / "model.safetensors")
        weights.save_pretrained(str(ckpt), max_shard_size="20KB")
        assert not (ckpt / "model.safetensors").exists() and (ckpt / "model.safetensors.index.json").is_file()
        resumed = _tiny_trainer(str(tmp_path / "resumed"), save_steps=2, max_steps=4)
        ut.enable(resumed)
        resumed.train(resume_from_checkpoint=str(ckpt))
    finally:
        ut.disable(full)
    assert all(torch.equal(a, b) for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values()))


def test_rotation_keeps_the_newest_checkpoint_when_an_older_save_commits_late(tmp_path, monkeypatch):
    """save_total_limit sorts folders by mtime: a late commit of an older save must not make it look
    newer than the folder saved after it (which rotation would then remove)."""
    import time

    from unickpt.lifecycle import directory

    commit = directory.CheckpointDir.commit

    def slow_commit(self, *args, **kwargs):  # slow storage: each commit lands 1.2 s after the writes
        time.sleep(1.2)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(directory.CheckpointDir, "commit", slow_commit)
    trainer = _tiny_trainer(str(tmp_path), save_steps=1, max_steps=3, save_total_limit=1)
    _train_with_unickpt(trainer)
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")) == ["checkpoint-3"]
    assert (tmp_path / "checkpoint-3" / "metadata.json").is_file()


def test_a_resume_passes_over_an_unfinished_save_and_names_it_when_asked_for(tmp_path, caplog):
    import unickpt.transformers as ut

    trainer = _tiny_trainer(str(tmp_path), save_steps=2, max_steps=2)
    _train_with_unickpt(trainer)
    crashed = tmp_path / "checkpoint-4"  # what a run killed while saving step 4 leaves: files, no commit
    shutil.copytree(tmp_path / "checkpoint-2", crashed)
    os.remove(crashed / "metadata.json")
    again = _tiny_trainer(str(tmp_path), save_steps=2, max_steps=3)
    ut.enable(again)
    try:
        with caplog.at_level("WARNING", logger="unickpt.transformers"):
            again.train(resume_from_checkpoint=True)
        assert f"{crashed} is an unfinished save" in caplog.text and again.state.global_step == 3
        explicit = _tiny_trainer(str(tmp_path / "x"), max_steps=5)
        ut.enable(explicit)
        with pytest.raises(ValueError, match=r"checkpoint-4' is an unfinished unickpt save"):
            explicit.train(resume_from_checkpoint=str(crashed))
    finally:
        ut.disable(again)


def test_a_folder_trainer_saved_over_is_resumed_from_trainers_files(tmp_path):
    """Trainer's own save into a folder of a plugin save overwrites the files but leaves metadata.json:
    the optimizer state is then Trainer's optimizer.pt, not the stale unickpt one."""
    import unickpt.transformers as ut
    from unickpt.transformers._patch import is_unickpt_checkpoint

    first = _tiny_trainer(str(tmp_path), save_steps=2, max_steps=2, learning_rate=1e-2)
    _train_with_unickpt(first)
    ckpt = tmp_path / "checkpoint-2"
    assert is_unickpt_checkpoint(str(ckpt))
    _tiny_trainer(str(tmp_path), save_steps=2, max_steps=2, learning_rate=1e-3).train()  # Trainer's own save
    assert (ckpt / "metadata.json").is_file() and not is_unickpt_checkpoint(str(ckpt))
    own = torch.load(ckpt / "optimizer.pt", weights_only=True)
    resumed = _tiny_trainer(str(tmp_path / "r"), save_steps=2, max_steps=2, learning_rate=1e-3)
    ut.enable(resumed)
    try:
        resumed.create_optimizer_and_scheduler(num_training_steps=2)
        resumed._load_optimizer_and_scheduler(str(ckpt))
    finally:
        ut.disable(resumed)
    got = resumed.optimizer.state_dict()
    assert all(torch.equal(got["state"][i]["exp_avg"], own["state"][i]["exp_avg"]) for i in own["state"])
