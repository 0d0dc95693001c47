"""DeepSpeed's own checkpoint tools on unickpt checkpoints (docs/deepspeed.md, "DeepSpeed's own tools").

``deepspeed.utils.zero_to_fp32`` in process (right after an async ``save_checkpoint``), the
``save_dir/zero_to_fp32.py`` script (and ``zero_to_torch.py``) that a save leaves, as a user runs it, and
``deepspeed.checkpoint.ds_to_universal`` followed by a ``load_universal`` load at another world size.
Real DeepSpeed engines on CPU (torchrun, gloo); see tests/plugins/deepspeed/ds_tools_workers.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.timeout(900)  # torchrun of DeepSpeed engines on a busy 2-core machine

from test_deepspeed import ROOT, torchrun  # noqa: E402

import torch  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "plugins", "deepspeed", "ds_tools_workers.py")
TAG = "global_step2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_tools")
    log = torchrun(2, WORKER, "save", str(out), timeout=800)
    return out, log


def script(*args: str) -> str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("UNICKPT_DEEPSPEED", None)
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600, cwd="/")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    return out


def load_dir(out_dir) -> dict:
    """Every tensor of a zero_to_fp32 output folder (one file, or shards named by the index)."""
    names = sorted(os.listdir(out_dir))
    index = [n for n in names if n.endswith(".index.json")]
    files = sorted(set(json.load(open(out_dir / index[0]))["weight_map"].values())) if index else names
    sd = {}
    for f in files:
        if f.endswith(".safetensors"):
            from safetensors.torch import load_file

            sd.update(load_file(str(out_dir / f)))
        else:
            sd.update(torch.load(out_dir / f, weights_only=True))
    return sd


def assert_same_sd(got: dict, want: dict) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want), (sorted(got), sorted(want))
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, w.dtype)
        assert torch.equal(g.view(torch.uint8) if g.dtype == torch.bfloat16 else g,
                           w.view(torch.uint8) if w.dtype == torch.bfloat16 else w), k


def test_zero_to_fp32_in_process_right_after_an_async_save(saved):
    # regression: "Unable to find 'latest' file", then "can't find *_model_states.pt files": DeepSpeed's
    # zero_to_fp32 did not read unickpt checkpoints; now its fp32 state dict equals the engine's gathered
    # fp32 masters bitwise (ZeRO-2 bf16, ZeRO-3), with the frozen parameter, the buffer, and tied names as
    # one tensor object (also through convert_zero_checkpoint_to_fp32_state_dict's pytorch_model.bin)
    _, log = saved
    for name in ("z2bf16", "z3", "z3untied"):
        assert f"OK fp32 {name}" in log, (name, [line for line in log.splitlines() if "FAIL" in line] or log[-4000:])


def test_save_leaves_the_recovery_scripts(saved):
    out, _ = saved
    for name in ("z2bf16", "z3"):
        for f in ("zero_to_fp32.py", "zero_to_torch.py"):
            path = out / name / f
            assert path.is_file() and os.access(path, os.X_OK), path
        assert (out / name / "latest").read_text() == TAG


@pytest.mark.parametrize("name,args,files", [
    ("z2bf16", [], ["pytorch_model.bin"]),
    ("z2bf16", ["-t", TAG, "--exclude_frozen_parameters"], ["pytorch_model.bin"]),
    ("z3untied", ["--safe_serialization"], ["model.safetensors"]),
    ("z3", ["--max_shard_size", "6KB"], None),
    ("z3untied", ["--safe_serialization", "--max_shard_size", "6KB"], None),
])
def test_recovery_script_in_the_folder(saved, tmp_path, name, args, files):
    # the script a save leaves in save_dir, run as DeepSpeed users run it, writes what the in-process
    # function returns: one file, or shards and an index beyond --max_shard_size
    out, _ = saved
    save_dir = out / name
    dst = tmp_path / "fp32"
    script(str(save_dir / "zero_to_fp32.py"), str(save_dir), str(dst), *args)
    names = sorted(os.listdir(dst))
    if files is not None:
        assert names == files, names
    else:
        index = "model.safetensors.index.json" if "--safe_serialization" in args else "pytorch_model.bin.index.json"
        assert index in names and len(names) > 3, names
        weight_map = json.load(open(dst / index))["weight_map"]
        assert sorted(set(weight_map.values())) == sorted(n for n in names if n != index), names
    want = torch.load(out / f"{name}_fp32_ref.pt", weights_only=True)
    if "--exclude_frozen_parameters" in args:
        want = {k: v for k, v in want.items() if not k.startswith("frozen.")}
    got = load_dir(dst)
    assert_same_sd(got, want)
    if name != "z3untied" and files is not None:  # torch.save keeps the tie: one tensor under both names
        assert got["l1.weight"].untyped_storage().data_ptr() == got["l2.weight"].untyped_storage().data_ptr()


def test_zero_to_torch_script_beside_it(saved, tmp_path):
    # DeepSpeed's zero_to_torch.py imports the zero_to_fp32.py beside it
    out, _ = saved
    save_dir = out / "z3"
    script(str(save_dir / "zero_to_torch.py"), str(save_dir), str(tmp_path / "bf16"), "--dtype", "bf16")
    got = torch.load(tmp_path / "bf16" / "pytorch_model.bin", weights_only=True)
    want = torch.load(out / "z3_fp32_ref.pt", weights_only=True)
    assert_same_sd(got, {k: v.to(torch.bfloat16) for k, v in want.items()})


def test_recovery_script_still_reads_native_checkpoints(saved, tmp_path):
    # the same script on a DeepSpeed-native save_dir gives what DeepSpeed's own copy there gives
    out, _ = saved
    native = out / "native"
    assert (native / TAG / "mp_rank_00_model_states.pt").is_file()
    script(str(out / "z2bf16" / "zero_to_fp32.py"), str(native), str(tmp_path / "ours"))
    script(str(native / "zero_to_fp32.py"), str(native), str(tmp_path / "theirs"))
    theirs = load_dir(tmp_path / "theirs")
    assert "l1.weight" in theirs and "frozen.weight" in theirs
    assert_same_sd(load_dir(tmp_path / "ours"), theirs)


def test_ds_to_universal_output_loads_at_another_world_size(saved):
    # regression: ds_to_universal raised on a unickpt checkpoint (no *_optim_states.pt); now its output is
    # a committed copy that load_checkpoint(tag=..._universal) with load_universal loads at 1 rank, bitwise
    out, log = saved
    assert "FAIL ds_to_universal" not in log, [line for line in log.splitlines() if "FAIL" in line]
    for name in ("z2bf16", "z3"):
        uni = out / name / f"{TAG}_universal"
        assert (uni / "metadata.json").is_file() and (out / name / "latest_universal").read_text() == uni.name
        src = out / name / TAG / "metadata.json"
        assert (uni / "metadata.json").read_bytes() == src.read_bytes()
    log = torchrun(1, WORKER, "universal", str(out), timeout=800)
    for name in ("z2bf16", "z3", "z3untied"):
        assert f"OK universal {name} ws=1" in log, (name, log[-4000:])


def test_uncommitted_checkpoint_and_occupied_output_are_refused_by_name(saved, tmp_path):
    # a unickpt save that never committed is named as such (not DeepSpeed's "can't find *_model_states.pt");
    # ds_to_universal replaces its own earlier output but never a folder holding something else
    import shutil
    from types import SimpleNamespace

    import deepspeed.checkpoint.ds_to_universal as universal
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from unickpt import CheckpointExistsError, CheckpointNotFoundError

    out, _ = saved
    run = tmp_path / "run"
    shutil.copytree(out / "z3" / TAG, run / TAG)
    (run / TAG / "metadata.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint at '.*/run/global_step2': "
                                                      r"metadata.json is missing"):
        get_fp32_state_dict_from_zero_checkpoint(str(run), tag=TAG)

    def convert(dst):
        universal.main(SimpleNamespace(input_folder=str(out / "z3" / TAG), output_folder=str(dst),
                                       num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                       strict=True, inject_missing_state=False))

    convert(run / "again_universal")
    convert(run / "again_universal")  # a second run replaces the first copy
    assert (run / "latest_universal").read_text() == "again_universal"
    assert_same_sd(get_fp32_state_dict_from_zero_checkpoint(str(run), tag="again_universal"),
                   torch.load(out / "z3_fp32_ref.pt", weights_only=True))
    (run / "other").mkdir()
    (run / "other" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match=r"ds_to_universal: '.*/run/other' exists and is not a unickpt "
                                                    r"checkpoint; remove it or choose another output folder"):
        convert(run / "other")
    assert (run / "other" / "notes.txt").read_text() == "mine"
