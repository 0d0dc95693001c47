"""unickpt.deepspeed with pipeline engines (``PipelineModule``: stages are a layout like any other) and
``checkpoint.tag_validation`` (DeepSpeed lets ranks name different tags under WARN / IGNORE).

Real DeepSpeed engines on CPU (DS_ACCELERATOR=cpu, gloo) under torchrun; see
tests/plugins/deepspeed/ds_pipeline_workers.py. Regressions: a pipeline engine's ``save_checkpoint`` raised
NotImplementedError after training; ``tag=f"tag-{rank}"`` under WARN / IGNORE raised "ranks saved to
different targets".
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed")

from test_deepspeed import ROOT, torchrun  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "plugins", "deepspeed", "ds_pipeline_workers.py")
pytestmark = pytest.mark.timeout(900)  # torchrun of 2 and 4 DeepSpeed ranks on a busy 2-core machine


def test_pipeline_two_stages_round_trip_and_reshard_to_one_stage(tmp_path):
    # 2 stages x 1 DP saved; loaded as 2 x 1 (bitwise, and the next train_batch equals the uninterrupted
    # run's bitwise) and as 1 stage x 2 DP (bitwise); fp32 ZeRO-0 and bf16 ZeRO-1; a tied layer on both
    # stages; a model whose last stage misses weights is refused on every rank
    log = torchrun(2, WORKER, "pipe", str(tmp_path), "2x1", "2x1,1x2", "z0,z1bf16", "errors", timeout=600)
    for name in ("z0", "z1bf16"):
        for layout in ("2x1", "1x2"):
            assert log.count(f"OK pipe {name} 2x1->{layout}") == 2, (name, layout, log[-4000:])
    assert log.count("OK pipe errors") == 2, log[-4000:]
    files = sorted(os.listdir(tmp_path / "z0_2x1" / "step2"))
    assert "metadata.json" in files and not any(f.endswith(".pt") for f in files), files


def test_pipeline_2x2_reshards_to_4_stages_and_to_4_way_data_parallel(tmp_path):
    # ZeRO-1 partitions inside each stage's DP group (the tied layer's partitions differ between stages)
    log = torchrun(4, WORKER, "pipe", str(tmp_path), "2x2", "2x2,4x1,1x4", "z1,z0bf16", timeout=800)
    for name in ("z1", "z0bf16"):
        for layout in ("2x2", "4x1", "1x4"):
            assert log.count(f"OK pipe {name} 2x2->{layout}") == 4, (name, layout, log[-4000:])


def test_tag_validation_modes_and_model_parallel_pipeline_refused_at_initialize(tmp_path):
    # FAIL: DeepSpeed's AssertionError, nothing written; WARN / IGNORE: one checkpoint under group rank 0's
    # tag, `latest` names it, a load with each rank's own tag restores it bitwise; WARN: rank 1 is told
    log = torchrun(2, WORKER, "tags", str(tmp_path), timeout=600)
    for mode in ("FAIL", "WARN", "IGNORE"):
        assert log.count(f"OK tags {mode}") == 2, (mode, log[-4000:])
    assert log.count("OK pipe model-parallel refused") == 2, log[-4000:]
