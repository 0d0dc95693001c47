"""unickpt.accelerate: Accelerator.save_state / load_state through unickpt (CPU, gloo, real processes).

Five script runs are shared by the tests (three, then two at a time):
  A  tests/plugins/accelerate/accelerate_train.py, 2 processes, UNICKPT_ACCELERATE=1, the script unmodified (no unickpt
     import): 3 epochs, save_state after each (automatic naming, total_limit=2), scheduler, shuffled
     dataloader, dropout, a registered object;
  E  tests/plugins/accelerate/accelerate_fsdp.py, 2 processes, FSDP2 SHARDED_STATE_DICT as Accelerate prepares it;
  F  the same with FSDP1 (flat parameters, use_orig_params=True);
  B  tests/plugins/accelerate/accelerate_train.py resume from A's checkpoint_1, 2 processes, then finish training;
  D  tests/plugins/accelerate/accelerate_single.py, 1 process: A's, E's and F's checkpoints, overwrite, pickling, total_limit, hooks.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(600)  # the first test also waits for the shared runs (busy 2-core machine)

NATIVE_FILES = ("model.safetensors", "pytorch_model.bin", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                "random_states_1.pkl", "custom_checkpoint_0.pkl", "pytorch_model_fsdp_0", "optimizer_0")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICKPT_ACCELERATE")}
    env.update(OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def _start(nproc: int | None, script: str, *args: str, env: dict) -> subprocess.Popen:
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [os.path.join(HERE, script), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(runs: dict[str, subprocess.Popen]) -> None:
    """Wait for every run; on a failure or a timeout, kill the runs (their whole process groups)."""
    try:
        for name, proc in runs.items():
            out, _ = proc.communicate(timeout=480)
            assert proc.returncode == 0, f"run {name} failed (exit {proc.returncode}):\n{out[-6000:]}"
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _reports(prefix: str, n: int) -> list[dict]:
    out = []
    for r in range(n):
        with open(f"{prefix}.{r}.json") as f:
            out.append(json.load(f))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate")
    project, fsdp_dir, fsdp1_dir, work = tmp / "project", tmp / "fsdp", tmp / "fsdp1", tmp / "work"
    work.mkdir()
    first = {
        "A": _start(2, "accelerate_train.py", str(tmp / "A"), str(project), "train",
                    env=_env(UNICKPT_ACCELERATE="1")),
        "E": _start(2, "accelerate_fsdp.py", str(tmp / "E"), str(fsdp_dir), "2", env=_env()),
        "F": _start(2, "accelerate_fsdp.py", str(tmp / "F"), str(fsdp1_dir), "1", env=_env()),
        "G": _start(2, "accelerate_fsdp.py", str(tmp / "G"), str(tmp / "fsdp2_full"), "2", "full", env=_env()),
        "H": _start(2, "accelerate_fsdp.py", str(tmp / "H"), str(tmp / "fsdp1_full"), "1", "full", env=_env()),
    }
    _finish(first)
    ckpt1 = str(project / "checkpoints" / "checkpoint_1")
    second = {
        "B": _start(2, "accelerate_train.py", str(tmp / "B"), str(project), "resume", ckpt1,
                    env=_env(UNICKPT_ACCELERATE="1")),
        "D": _start(None, "accelerate_single.py", str(tmp / "D"), ckpt1, str(fsdp_dir), str(fsdp1_dir), str(work),
                    env=_env()),
    }
    _finish(second)
    return {"tmp": tmp, "project": project, "fsdp": fsdp_dir, "fsdp1": fsdp1_dir, "A": _reports(str(tmp / "A"), 2),
            "B": _reports(str(tmp / "B"), 2), "E": _reports(str(tmp / "E"), 2), "F": _reports(str(tmp / "F"), 2),
            "G": _reports(str(tmp / "G"), 2), "H": _reports(str(tmp / "H"), 2),
            "D": _reports(str(tmp / "D"), 1)[0]}


def _metadata(path) -> dict:
    with open(os.path.join(path, "unickpt", "step_0", "metadata.json")) as f:
        return json.load(f)


def test_env_var_routes_unmodified_script_through_unickpt_with_rotation(runs):
    checkpoints = runs["project"] / "checkpoints"
    # total_limit=2 after 3 saves: checkpoint_0 was rotated out after checkpoint_2 committed
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_1", "checkpoint_2"]
    for rank in (0, 1):
        assert runs["A"][rank]["files"] == ["checkpoint_1", "checkpoint_2"]
    for name in ("checkpoint_1", "checkpoint_2"):
        folder = checkpoints / name
        # nothing written by Accelerate itself; the first model's weights as Hugging Face safetensors files, one
        # per process (hard links to the unickpt save's own), read by safetensors as the weights saved
        weights = runs["A"][0]["weights"][name]
        shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        assert weights["names"] == sorted(os.listdir(folder)) == shards + ["model.safetensors.index.json", "unickpt"]
        assert weights["index_files"] == shards and weights["index_keys"] is True
        assert weights["digest"] == runs["A"][0]["saves"][name.split("_")[1]]["model"]
        assert sorted(os.listdir(folder / "unickpt")) == ["latest", "step_0"]
        meta = _metadata(folder)
        assert meta["layout"]["world_size"] == 2
        assert meta["per_rank"]["fqns"] == ["rng"]
        assert sorted({k.split(".")[0] for k in meta["tensors"]}) == ["custom", "models", "optimizers"]
        assert "models.0.0.weight" in meta["tensors"] and "optimizers.0.state.0.weight.exp_avg" in meta["tensors"]
        tree = meta["state_tree"]
        assert tree["accelerate"]["iteration"] == int(name.split("_")[1])
        assert tree["accelerate"]["num_processes"] == 2
        assert sorted(tree) == ["accelerate", "custom", "dataloaders", "models", "optimizers", "rng", "schedulers"]
        custom = tree["custom"]["0"]["__unickpt_stateful__"]
        epoch = int(name.split("_")[1])
        assert custom["epoch"] == epoch and len(custom["history"]) == 4 * (epoch + 1)
        assert tree["dataloaders"]["0"]["__unickpt_stateful__"]["iteration"] == epoch + 1
        assert tree["dataloaders"]["0"]["__unickpt_stateful__"]["generator"] is not None


def test_load_state_restores_everything_and_resume_equals_uninterrupted(runs):
    for rank in (0, 1):
        saved, loaded = runs["A"][rank]["saves"]["1"], runs["B"][rank]["loaded"]
        for key in ("model", "optim", "rng", "lr", "generator", "loader_epoch", "step"):
            assert loaded[key] == saved[key], (rank, key)
        # the next save_state goes after the loaded checkpoint_1 and after the existing checkpoint_2
        # (iteration 2 would fail with "already exists")
        assert loaded["iteration"] == 3
        # DDP buffers differ between processes (BatchNorm statistics of each process's own batch);
        # the checkpoint holds process 0's, as Accelerate saves, not a mix of both processes'
        assert loaded["norm"] == runs["A"][0]["saves"]["1"]["norm"], rank
        # registered objects are global: every process gets process 0's state, as in Accelerate,
        # tensors included (they differ between processes: not a mix of both processes' tensors)
        assert loaded["progress"] == runs["A"][0]["saves"]["1"]["progress"]
        final_a, final_b = runs["A"][rank]["final"], runs["B"][rank]["final"]
        for key in ("model", "optim", "rng", "lr", "generator", "loader_epoch", "norm"):
            assert final_b[key] == final_a[key], (rank, key)
    # the buffers and the registered tensors did differ, and saving left process 1's own in place
    # (snapshots are taken after save_state)
    assert runs["A"][1]["saves"]["1"]["norm"] != runs["A"][0]["saves"]["1"]["norm"]
    progress0, progress1 = runs["A"][0]["saves"]["1"]["progress"], runs["A"][1]["saves"]["1"]["progress"]
    assert progress1["recent"] != progress0["recent"] and progress1["total"] != progress0["total"]
    # training did change the model between the checkpoint and the end
    assert runs["A"][0]["saves"]["1"]["model"] != runs["A"][0]["final"]["model"]


def test_fsdp2_routes_through_unickpt_not_dcp(runs):
    for rank, rep in enumerate(runs["E"]):
        assert rep["distributed_type"] == "DistributedType.FSDP" and rep["is_fsdp2"] is True
        assert rep["param_types"] == ["DTensor"]
        assert rep["local_shapes"] == [[16, 8], [16], [2, 32], [2]]  # each process holds half of every dim 0
        assert rep["perturbed_differs"] is True
        assert rep["loaded"] == rep["saved"]
        assert rep["rng_loaded"] == rep["rng_saved"]
        assert [f for f in rep["files"] if not f.startswith("unickpt/")] == []
    assert runs["E"][0]["saved"] == runs["E"][1]["saved"]  # full-state digests agree across processes
    meta = _metadata(runs["fsdp"])
    weight = meta["tensors"]["models.0.0.weight"]
    assert weight["shape"] == [32, 8]
    # one shard per process, no gather: each process's rows are its part of an even split (format v2)
    assert meta["format_version"] == 2 and weight["split"]["dim"] == 0 and weight["split"]["parts"] == 2
    from unickpt.tools.reader import CheckpointReader

    reader = CheckpointReader(os.path.join(runs["fsdp"], "unickpt", "step_0"))
    assert sorted(c.spec.offsets for c in reader.tensor_meta("models.0.0.weight").chunks) == [(0, 0), (16, 0)]
    assert "optimizers.0.state.0.weight.exp_avg" in meta["tensors"]


def test_fsdp1_flat_parameters_route_through_unickpt(runs):
    for rep in runs["F"]:
        assert rep["distributed_type"] == "DistributedType.FSDP" and rep["is_fsdp2"] is False
        assert rep["fsdp1_units"] == 3  # the root and two size-wrapped Linear units
        assert rep["perturbed_differs"] is True
        assert rep["loaded"] == rep["saved"]
        assert rep["rng_loaded"] == rep["rng_saved"]
        assert [f for f in rep["files"] if not f.startswith("unickpt/")] == []
    assert [r["local_shapes"] for r in runs["F"]] == [[[144], [0], [66], [0]], [[112], [32], [62], [4]]]
    meta = _metadata(runs["fsdp1"])
    chunks = meta["tensors"]["models.0.0.weight"]["chunks"]  # flat-parameter slices, written without a gather
    assert [(c["flat_start"], c["flat_length"]) for c in chunks] == [(0, 144), (144, 112)]
    chunks = meta["tensors"]["optimizers.0.state.0.weight.exp_avg"]["chunks"]
    assert [(c["flat_start"], c["flat_length"]) for c in chunks] == [(0, 144), (144, 112)]


@pytest.mark.parametrize("run", ["G", "H"])
def test_fsdp_full_state_dict_gathers_the_weights_into_model_safetensors(runs, run):
    """FSDP with FULL_STATE_DICT (Accelerate's own save writes a gathered model.safetensors then): FSDP2
    DTensor shards (G) and FSDP1 flat-parameter slices (H) are gathered whole by the save, each tensor into
    one process's safetensors file, linked at the folder's root and read by safetensors as the full model."""
    for rep in runs[run]:
        assert rep["distributed_type"] == "DistributedType.FSDP" and rep["loaded"] == rep["saved"]
        assert rep["weights"] == rep["saved"][0]  # the full model's digest (sorted fqns, dtypes, shapes, bytes)
    files = runs[run][0]["files"]
    assert [f for f in files if not f.startswith("unickpt/")] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    sharded = runs["E" if run == "G" else "F"][0]["files"]
    assert not any(f.endswith(".safetensors") for f in sharded)  # SHARDED_STATE_DICT: no gather, as Accelerate


def test_resume_on_one_process(runs):
    d = runs["D"]
    assert d["rng_error"][0] == "PerRankReshardError"
    assert d["rng_error"][1].startswith("'rng': per-rank state was saved by 2 ranks and is being loaded by 1;")
    assert "UNICKPT_ACCELERATE_RNG_RESHARD=by_rank|keep" in d["rng_error"][1]
    assert d["untouched_after_error"] is True
    saved0 = runs["A"][0]["saves"]["1"]
    for key in ("model", "optim", "rng", "lr", "generator", "progress", "loader_epoch", "norm"):
        assert d["ddp_loaded"][key] == saved0[key], key  # rng_reshard="by_rank": process 0's streams
    assert d["trained_after_resume"] is True
    # FSDP2 (2 processes, DTensor shards) -> a plain module and optimizer on 1 process
    assert d["fsdp_loaded"] == runs["E"][0]["saved"]
    assert d["fsdp1_loaded"] == runs["F"][0]["saved"]  # FSDP1 flat slices -> plain module and optimizer
    assert d["rng_kept"] is True


def test_folder_written_by_accelerate_itself_loads_through_accelerate(runs):
    native = runs["D"]["native"]
    assert native["files"] == ["model.safetensors", "optimizer.bin", "random_states_0.pkl"]
    assert native["reloaded"] is True


def test_repeated_saves_into_one_folder_keep_the_newest(runs):
    d = runs["D"]
    assert d["async_returned_uncommitted"] is True  # save_state returned before the commit
    assert d["same_listing"] == ["latest", "step_1"]
    assert d["same_reloaded"] is True
    assert d["same_weights"] == {"names": ["model.safetensors", "unickpt"], "equal": True, "linked": True}


def test_pickle_is_opt_in_and_safe_serialization(runs):
    d = runs["D"]
    assert d["unsafe_save"][0] == "UnsafeObjectError"
    assert d["unsafe_save"][1].startswith("'custom.0.value': a value of class __main__.Opaque has no JSON or tensor form")
    assert "safe_serialization=False" in d["unsafe_save"][1]
    assert d["unsafe_load"][0] == "UnsafeObjectError"
    assert d["unsafe_load"][1].startswith("'custom.0.value': stored object of class __main__.Opaque can only be restored")
    assert d["pickled_reloaded"] is True


def test_failed_save_keeps_last_committed_and_rotation_after_commit(runs):
    d = runs["D"]
    assert d["failed_save"][0] == "UnsafeObjectError"
    assert d["after_failed_save"] == ["checkpoint_0"]  # total_limit=1, yet the old one survives a failed save
    assert d["reloaded_after_failure"] is True
    # a killed save's checkpoint_1 is skipped by load_state(), not reused by the next save_state (which
    # failed with "already exists"), and rotation deletes it first
    assert d["iteration_after_load"] == 2
    assert d["after_rotation"] == ["checkpoint_2"]
    assert d["rotated_committed"] is True
    # a folder holding no checkpoint at all: one clear line, not Accelerate's missing pytorch_model.bin
    assert d["not_a_checkpoint"] == [
        "CheckpointNotFoundError",
        f"load_state: {str(runs['tmp'] / 'work' / 'project' / 'checkpoints')!r} is not a checkpoint: it holds "
        "neither a unickpt/ folder nor the files of Accelerate's own save_state (random_states_<r>.pkl, ...)"]


def test_switching_to_unickpt_mid_run_continues_the_numbering(runs):
    # checkpoint_0 by Accelerate itself, loaded by load_state(); the next save_state goes to checkpoint_1
    switched = runs["D"]["switched"]
    assert sorted(switched) == ["checkpoint_0", "checkpoint_1"]
    assert "random_states_0.pkl" in switched["checkpoint_0"] and "unickpt" not in switched["checkpoint_0"]
    assert switched["checkpoint_1"] == ["model.safetensors", "unickpt"]


def test_one_optimizer_over_two_models(runs):
    # it failed with a bare KeyError from get_optimizer_state_dict; now fqn-keyed per model index
    spanning = runs["D"]["spanning"]
    assert spanning["changed"] is True and spanning["restored"] is True
    assert spanning["keys"] == ["optimizers.0.state.0.0.bias.exp_avg", "optimizers.0.state.0.0.weight.exp_avg",
                                "optimizers.0.state.0.3.bias.exp_avg", "optimizers.0.state.0.3.weight.exp_avg",
                                "optimizers.0.state.1.bias.exp_avg", "optimizers.0.state.1.weight.exp_avg"]


def test_disable_one_accelerator_while_enabled_for_all(runs):
    assert runs["D"]["disabled_one"] == [False, True, ["model.safetensors", "random_states_0.pkl"]]


def test_save_and_load_pre_hooks(runs):
    h = runs["D"]["hooks"]
    assert h["folder"] == ["model_a.txt", "unickpt"]
    assert h["model_prefixes"] == ["models.1"]
    assert h["a_untouched"] is True and h["opt_a_restored"] is True and h["b_restored"] is True


_PROBE = ("import json, sys, warnings\nwarnings.simplefilter('ignore')\nimport accelerate\n"
          "from accelerate import Accelerator\n"
          "print(json.dumps(['unickpt.accelerate._patch' in sys.modules, "
          "getattr(Accelerator.save_state, '__unickpt__', False)]))")


@pytest.mark.parametrize("value, expected", [("1", [True, True]), (None, [False, False])])
def test_startup_hook_patches_only_with_the_variable(value, expected):
    env = _env() if value is None else _env(UNICKPT_ACCELERATE=value)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected


def test_bad_option_variable_leaves_accelerate_unpatched():
    env = _env(UNICKPT_ACCELERATE="1", UNICKPT_ACCELERATE_RNG_RESHARD="modulo")
    probe = _PROBE.replace("warnings.simplefilter('ignore')", "pass")
    out = subprocess.run([sys.executable, "-W", "always", "-c", probe], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False]
    assert ("unickpt.accelerate option rng_reshard must be one of ['error', 'by_rank', 'keep'], got 'modulo'"
            in out.stderr)


def test_options():
    from unickpt.accelerate import Options, options_from_env

    assert options_from_env({}) == Options(async_save=True, rng_reshard="error", allow_pickle=False)
    assert options_from_env({"UNICKPT_ACCELERATE_ASYNC": "0", "UNICKPT_ACCELERATE_RNG_RESHARD": "keep",
                             "UNICKPT_ACCELERATE_ALLOW_PICKLE": "yes"}) == Options(False, "keep", True)
    with pytest.raises(ValueError, match=r"^UNICKPT_ACCELERATE_ASYNC must be one of 1/0/true/false/yes/no/on/off, "
                                         r"got 'maybe'$"):
        options_from_env({"UNICKPT_ACCELERATE_ASYNC": "maybe"})
    with pytest.raises(ValueError, match=r"^unknown unickpt.accelerate option\(s\) \['asynchronous'\]"):
        Options().updated(asynchronous=True)
    with pytest.raises(ValueError, match=r"^unickpt.accelerate option async_save must be a bool, got 1$"):
        Options().updated(async_save=1)


def _folder(root, n: int, kind: str) -> str:
    path = os.path.join(root, f"checkpoint_{n}")
    if kind == "native":
        os.makedirs(path)
        open(os.path.join(path, "model.safetensors"), "wb").close()
        return path
    step = os.path.join(path, "unickpt", "step_0")
    os.makedirs(os.path.join(step, "data"))
    if kind == "committed":
        with open(os.path.join(step, "metadata.json"), "w") as f:
            f.write("{}")
    elif kind == "writing":  # a live writer: this test process
        with open(os.path.join(step, ".unickpt-writer"), "w") as f:
            json.dump({"host": os.uname().nodename, "pid": os.getpid(), "time": 0}, f)
    return path


def test_rotation_never_deletes_a_save_in_flight_or_the_new_checkpoint(tmp_path):
    from unickpt.accelerate import _folders

    root = str(tmp_path)
    f0 = _folder(root, 0, "native")
    _folder(root, 1, "committed")
    f2 = _folder(root, 2, "writing")
    f3 = _folder(root, 3, "committed")
    f10 = _folder(root, 10, "crashed")  # uncommitted, writer gone: numeric order, not string order
    assert _folders.newest_loadable(root) == f3
    in_flight = {os.path.join(f2, "unickpt", "step_0")}
    deleted = _folders.rotate(root, 2, keep=f3, in_flight=lambda p: p in in_flight)
    # 5 folders, limit 2: the oldest deletable ones go; checkpoint_2 is still being written, so it stays
    assert deleted == [f0, os.path.join(root, "checkpoint_1"), f10]
    assert [n for n, _ in _folders.checkpoint_folders(root)] == [2, 3]
    assert _folders.rotate(root, 1, keep=f3, in_flight=lambda p: p in in_flight) == []
    assert _folders.rotate(root, 1, keep=f3, in_flight=lambda p: False) == []  # the writer record is alive
    assert os.path.isdir(f2) and os.path.isdir(f3)
    # the leftover of a save that died goes before the oldest committed checkpoint
    other = str(tmp_path / "other")
    g0, g1, g2 = _folder(other, 0, "committed"), _folder(other, 1, "crashed"), _folder(other, 2, "committed")
    assert _folders.rotate(other, 2, keep=g2, in_flight=lambda p: False) == [g1]
    assert _folders.newest_number(other) == 2 and _folders.newest_loadable(other) == g2
    os.makedirs(os.path.join(other, "checkpoint_3"))  # killed before it wrote anything: not loadable
    assert _folders.newest_number(other) == 3 and _folders.newest_loadable(other) == g2
    assert os.path.isdir(g0)


def test_dataloader_sampler_state_is_not_skipped_silently():
    import torch

    import unickpt
    from unickpt.accelerate._state import DataLoaderState

    shuffled = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True,
                                           generator=torch.Generator().manual_seed(3))
    saved = DataLoaderState(shuffled, "dataloaders.0").state_dict()
    assert saved["generator"] is not None
    sequential = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with pytest.raises(unickpt.StateMismatchError) as e:
        DataLoaderState(sequential, "dataloaders.0").load_state_dict(saved)
    assert str(e.value) == ("'dataloaders.0.generator': the checkpoint holds a sampler generator, but this "
                            "dataloader's sampler (SequentialSampler) has no 'generator' (prepare the dataloader "
                            "as in the saving run)")
    target = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True)
    DataLoaderState(target, "dataloaders.0").load_state_dict(saved)
    assert torch.equal(target.sampler.generator.get_state(), shuffled.sampler.generator.get_state())


@pytest.fixture
def accelerator_factory():
    """``make(**kwargs)`` -> an in-process, single-process ``Accelerator`` (CPU) routed through unickpt
    (``enable(accelerator)``); Accelerate's state singletons are reset and unickpt disabled afterwards."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import unickpt.accelerate

    made = []

    def make(**kwargs):
        acc = Accelerator(cpu=True, **kwargs)
        unickpt.accelerate.enable(acc)
        made.append(acc)
        return acc

    yield make
    try:
        unickpt.accelerate.wait()
    finally:
        for acc in made:
            unickpt.accelerate.disable(acc)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_build_state_with_a_stateful_dataloader_keeps_its_position_per_process():
    # it raised NameError: a function-local `import unickpt.fsdp` (FSDP1 branch) made `unickpt` a local
    # name of build_state, unbound on every other path, where `unickpt.PerRank` is used for such loaders
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType

    import unickpt
    from unickpt.accelerate import Options
    from unickpt.accelerate._state import build_state

    class StatefulLoader:  # what Accelerate prepares with use_stateful_dataloader=True (torchdata's class)
        use_stateful_dataloader = True

        def state_dict(self):
            return {"yielded": 3}

        def load_state_dict(self, state):
            pass

    stateful, plain, model = StatefulLoader(), torch.utils.data.DataLoader(list(range(4))), torch.nn.Linear(2, 2)
    acc = SimpleNamespace(distributed_type=DistributedType.NO, _models=[model], _optimizers=[], _schedulers=[],
                          _dataloaders=[plain, stateful], _custom_objects=[], step=0, save_iteration=0,
                          num_processes=1, scaler=None)
    state = build_state(acc, [0], Options())
    assert list(state["dataloader_states"]) == ["1"]
    leaf = state["dataloader_states"]["1"]
    assert isinstance(leaf, unickpt.PerRank) and leaf.value is stateful
    assert state["models"]["0"] is model


def test_stateful_dataloader_resumes_mid_epoch(tmp_path, accelerator_factory):
    pytest.importorskip("torchdata")
    import torch
    from accelerate.utils import DataLoaderConfiguration

    acc = accelerator_factory(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(20, 2))
    loader = acc.prepare(torch.utils.data.DataLoader(data, batch_size=2))
    it = iter(loader)
    for _ in range(3):
        next(it)
    acc.save_state(str(tmp_path / "state"))  # after 3 of 10 batches
    rest = [b[0].tolist() for b in it]
    assert rest == [[[4.0 * i, 4.0 * i + 1], [4.0 * i + 2, 4.0 * i + 3]] for i in range(3, 10)]
    assert sorted(os.listdir(tmp_path / "state")) == ["unickpt"]
    acc.load_state(str(tmp_path / "state"))
    assert [b[0].tolist() for b in loader] == rest  # the 7 batches after the saved position, in order


@pytest.fixture
def slow_commit():
    """``hold(part)``: the commits (writes of ``metadata.json``) of saves started afterwards whose path
    contains ``part`` wait until ``release()`` (or 20 s), so that such an asynchronous save is still in
    flight when ``save_state`` has returned (:mod:`unickpt.testing.faults`)."""
    import glob
    from types import SimpleNamespace

    from unickpt.testing import Fault, install

    held, uninstall = [], []

    def hold(part):
        held.append(Fault("rename", match=f"*{glob.escape(part)}*metadata.json", nth=None, action="hold", delay_s=20))
        uninstall.append(install(held[-1]))

    def release():
        for fault in held:
            fault.release()

    yield SimpleNamespace(hold=hold, release=release)
    for undo in reversed(uninstall):
        undo()


def _tiny(acc):
    import torch

    model = torch.nn.Linear(2, 2)
    optim = torch.optim.Adam(model.parameters())
    return acc.prepare(model, optim)


def test_removing_the_project_right_after_save_state_removes_the_checkpoint(tmp_path, accelerator_factory,
                                                                          slow_commit):
    # Accelerate's test_with_save_limit: the TemporaryDirectory holding the project is removed as soon as
    # save_state returns. That raced the background write ("Directory not empty" in the user's rmtree, or
    # a SaveFailedError raised by the next, unrelated save_state). Removal now waits for the save inside.
    import shutil
    import threading

    from accelerate.utils import ProjectConfiguration

    project = tmp_path / "project"
    acc = accelerator_factory(project_config=ProjectConfiguration(project_dir=str(project), total_limit=2,
                                                                  automatic_checkpoint_naming=True))
    _tiny(acc)
    slow_commit.hold("checkpoint_1")  # (with total_limit=1 that save would return after its commit)
    acc.save_state()
    acc.save_state()
    folder = project / "checkpoints" / "checkpoint_1"
    assert not (folder / "unickpt" / "step_0" / "metadata.json").exists()  # still in flight
    threading.Timer(0.3, slow_commit.release).start()
    shutil.rmtree(project)  # what TemporaryDirectory.__exit__ does
    assert not project.exists()
    acc.project_configuration.automatic_checkpoint_naming = False
    acc.save_state(str(tmp_path / "other"))  # nothing of the removed save is raised here
    unickpt_wait()
    assert not project.exists()  # and nothing brought it back
    assert sorted(os.listdir(tmp_path)) == ["other"]
    acc.load_state(str(tmp_path / "other"))


def test_a_save_whose_folder_was_removed_meanwhile_is_a_warning_not_a_later_error(tmp_path, accelerator_factory,
                                                                                 slow_commit, caplog):
    import logging
    import subprocess

    acc = accelerator_factory()
    _tiny(acc)
    slow_commit.hold(str(tmp_path / "a"))
    acc.save_state(str(tmp_path / "a"))
    # not through shutil.rmtree (it waits for the save); rm -rf races the writer that still creates files there
    # ("Directory not empty"), as it would for a user: it is run again until the folder is gone
    for _ in range(50):
        if subprocess.run(["rm", "-rf", str(tmp_path / "a")], capture_output=True).returncode == 0:
            break
        time.sleep(0.05)
    assert not (tmp_path / "a").exists()
    slow_commit.release()
    with caplog.at_level(logging.WARNING, logger="unickpt.accelerate"):
        acc.save_state(str(tmp_path / "b"))  # the removed save's failure is not raised here
        unickpt_wait()
    removed = [r.getMessage() for r in caplog.records if "was removed while the save was being written" in r.getMessage()]
    assert len(removed) == 1 and removed[0].startswith(f"unickpt.accelerate: the save into {tmp_path / 'a'} did not "
                                                       "complete")
    acc.load_state(str(tmp_path / "b"))
    # a save that fails while its folder is still there is raised, as before
    import errno

    import unickpt
    from unickpt.testing import Fault, inject

    with inject(Fault("rename", match=f"*{os.sep}c{os.sep}*metadata.json", nth=None, errno=errno.ENOSPC)):
        acc.save_state(str(tmp_path / "c"))
        with pytest.raises(unickpt.SaveFailedError, match="No space left on device"):
            unickpt_wait()


def unickpt_wait():
    import unickpt.accelerate

    unickpt.accelerate.wait()


def test_total_limit_holds_when_save_state_returns(tmp_path, accelerator_factory, slow_commit):
    # Accelerate deletes the folders beyond total_limit before it saves: a listing after save_state shows
    # at most total_limit folders. Rotating only after the (asynchronous) commit showed one folder more.
    import threading

    from accelerate.utils import ProjectConfiguration

    project = tmp_path / "two"
    acc = accelerator_factory(project_config=ProjectConfiguration(project_dir=str(project), total_limit=2,
                                                                  automatic_checkpoint_naming=True))
    _tiny(acc)
    slow_commit.hold("checkpoint_2")
    for _ in range(3):
        acc.save_state()
    checkpoints = project / "checkpoints"
    assert not (checkpoints / "checkpoint_2" / "unickpt" / "step_0" / "metadata.json").exists()  # in flight
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_1", "checkpoint_2"]
    slow_commit.release()
    unickpt_wait()
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_1", "checkpoint_2"]

    # total_limit=1: the only other folder is the last committed checkpoint; it goes once the new one
    # committed, and save_state returns after that
    acc.project_configuration.total_limit = 1
    slow_commit.hold("checkpoint_3")
    threading.Timer(0.3, slow_commit.release).start()
    acc.save_state()
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_3"]
    assert (checkpoints / "checkpoint_3" / "unickpt" / "step_0" / "metadata.json").exists()
    acc.load_state()


_SAVER = """
import json, sys, time
import torch
from unickpt.testing import Fault, install
# the commit lands 2 s after save_state returned
install(Fault("rename", match="*metadata.json", nth=None, action="slow", delay_s=2.0))
from accelerate import Accelerator
acc = Accelerator(cpu=True)
torch.manual_seed(5)
model = acc.prepare(torch.nn.Linear(2, 2))
acc.save_state(sys.argv[1])
print(json.dumps(model.weight.tolist()), flush=True)
"""


def test_a_second_process_loads_the_checkpoint_once_save_state_returned(tmp_path, accelerator_factory):
    # with Accelerate, the files are on disk when save_state returns; another process loading the folder
    # then (an evaluation job) found an uncommitted unickpt save: CheckpointNotFoundError
    import torch

    folder = tmp_path / "state"
    saver = subprocess.Popen([sys.executable, "-c", _SAVER, str(folder)], env=_env(UNICKPT_ACCELERATE="1"),
                             stdout=subprocess.PIPE, text=True)
    try:
        weight = json.loads(saver.stdout.readline())
        assert not (folder / "unickpt" / "step_0" / "metadata.json").exists()  # still being written
        acc = accelerator_factory()
        model = acc.prepare(torch.nn.Linear(2, 2))
        acc.load_state(str(folder))
        assert model.weight.tolist() == weight
    finally:
        saver.communicate(timeout=120)
    assert saver.returncode == 0


def test_each_process_naming_its_own_folder(tmp_path):
    # each process passes its own tempfile.TemporaryDirectory() (Accelerate's test_distributed_data_loop.py):
    # process 1's share went into its own folder, and process 1 loaded a folder holding no commit
    pytest.importorskip("torchdata")
    _finish({"own": _start(2, "accelerate_own_folders.py", str(tmp_path / "own"), env=_env(UNICKPT_ACCELERATE="1"))})
    reports = _reports(str(tmp_path / "own"), 2)
    for rep in reports:
        assert rep["restored"] is True and rep["resumed_batches"] is True
    # the checkpoint is in process 0's folder (the weights' safetensors files linked at its root); process 1's
    # exists, as with Accelerate
    assert reports[0]["listing"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                     "model.safetensors.index.json", "unickpt"] and reports[1]["listing"] == []


def test_two_rotations_at_once_delete_only_the_oldest(tmp_path, monkeypatch):
    # save_state rotates at its return (main thread) and again after the commit (background thread). Run
    # together, the second one saw the first one's half-deleted folder (metadata.json removed, this live
    # process's writer record still there) as a save in flight and deleted the next one instead:
    # Accelerate's test_checkpoint_deletion found checkpoint_9 gone after 11 saves with total_limit=2.
    import shutil
    import threading

    from unickpt.accelerate import _folders

    root = str(tmp_path)
    for n in (8, 9):
        step = os.path.join(_folder(root, n, "committed"), "unickpt", "step_0")
        with open(os.path.join(step, ".unickpt-writer"), "w") as f:  # as every save leaves it
            json.dump({"host": os.uname().nodename, "pid": os.getpid(), "time": 0}, f)
    f10 = _folder(root, 10, "writing")
    entered, release, original = threading.Event(), threading.Event(), shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        if path.endswith("checkpoint_8"):
            entered.set()
            release.wait(10)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    results = {}

    def rotate(name):
        results[name] = _folders.rotate(root, 2, keep=f10, in_flight=lambda p: False)

    first = threading.Thread(target=rotate, args=("first",))
    first.start()
    assert entered.wait(10)  # the first rotation is deleting checkpoint_8
    second = threading.Thread(target=rotate, args=("second",))
    second.start()
    second.join(0.5)
    release.set()
    first.join(10)
    second.join(10)
    assert results == {"first": [os.path.join(root, "checkpoint_8")], "second": []}
    assert [n for n, _ in _folders.checkpoint_folders(root)] == [9, 10]
