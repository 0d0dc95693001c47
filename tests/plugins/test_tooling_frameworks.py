"""``unickpt import`` from native DeepSpeed ZeRO and Megatron-core torch_dist checkpoints, written by
the frameworks themselves (2 ranks, gloo, CPU) in a torchrun subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from unickpt.tools.reader import CheckpointReader
from unickpt.tools.cli import main
from unickpt.errors import UnsafeObjectError
from unickpt.tools.importers import detect_source, import_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun(script: str, out: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, script), out]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert res.returncode == 0, res.stderr[-3000:]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def zero_ckpts(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = str(tmp_path_factory.mktemp("zero"))
    _torchrun("tooling_ds_zero.py", out, {"DS_ACCELERATOR": "cpu"})
    return out


@pytest.fixture(scope="module")
def mcore_ckpt(tmp_path_factory):
    pytest.importorskip("megatron.core")
    out = str(tmp_path_factory.mktemp("mcore"))
    _torchrun("tooling_mcore_torch_dist.py", out)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_import_deepspeed_zero_equals_the_gathered_fp32_params(zero_ckpts, tmp_path, capsys, stage):
    src = os.path.join(zero_ckpts, f"zero{stage}")
    want = torch.load(os.path.join(zero_ckpts, f"zero{stage}_expected.pt"), weights_only=True)
    assert detect_source(src) == detect_source(os.path.join(src, "step2")) == "deepspeed"
    with pytest.raises(UnsafeObjectError, match="reading a deepspeed checkpoint runs the unpickler"):
        import_checkpoint(src, str(tmp_path / "u"))
    assert main(["import", src, str(tmp_path / "u"), "--allow-pickle", "--prefix", "model", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # DeepSpeed's own prints went to stderr
    assert (report["source"], report["tensors"]) == ("deepspeed", 4)
    reader = CheckpointReader(str(tmp_path / "u"))
    assert reader.keys() == sorted(f"model.{k}" for k in want)
    for k, v in want.items():
        assert _bits_equal(reader.read(f"model.{k}"), v), k
    # a tag directory is accepted directly
    import_checkpoint(os.path.join(src, "step2"), str(tmp_path / "u2"), allow_pickle=True)
    assert all(_bits_equal(CheckpointReader(str(tmp_path / "u2")).read(k), v) for k, v in want.items())


def test_import_megatron_torch_dist_tensors_objects_and_common(mcore_ckpt, tmp_path):
    src = os.path.join(mcore_ckpt, "ckpt")
    want = torch.load(os.path.join(mcore_ckpt, "expected.pt"), weights_only=True)
    assert detect_source(src) == "megatron"
    with pytest.raises(UnsafeObjectError, match="reading a megatron checkpoint runs the unpickler"):
        import_checkpoint(src, str(tmp_path / "u"))
    res = import_checkpoint(src, str(tmp_path / "u"), allow_pickle=True)
    assert (res.source, res.tensors) == ("megatron", 3)
    reader = CheckpointReader(str(tmp_path / "u"))
    assert reader.keys() == sorted(want)  # row-split, stacked-layer (prepend axis) and replicated tensors, whole
    for k, v in want.items():
        assert _bits_equal(reader.read(k), v), k
    objects = reader.decoded_objects()
    assert objects["common"] == {"iteration": 7, "args": {"tp": 2, "lr": 0.5}}
    assert {k: v for k, v in objects.items() if k.startswith("rng_state/")} == {
        "rng_state/shard_0_2": [{"seed": 1000}], "rng_state/shard_1_2": [{"seed": 1001}]}
