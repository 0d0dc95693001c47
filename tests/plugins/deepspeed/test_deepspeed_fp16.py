"""unickpt.deepspeed with DeepSpeed's fp16 and FusedAdam optimizer wrappers (issue #34): FP16_Optimizer (ZeRO-0 with
``"optimizer": {"type": "Adam"}``, fp16 and bf16), FP16_UnfusedOptimizer, ZeRO-1/2/3 and BF16_Optimizer save and
load bitwise, the dynamic loss scaler and the wrappers' flags included, at the same size and resharded; and a
configuration the plugin cannot save is refused in ``deepspeed.initialize``, not after training.

Real DeepSpeed engines on CPU (DS_ACCELERATOR=cpu, gloo) under torchrun: tests/plugins/deepspeed/ds_fp16_workers.py.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed")

from test_deepspeed import ROOT, torchrun  # noqa: E402  (this folder is on sys.path: pytest prepend mode)

pytestmark = pytest.mark.timeout(900)  # torchrun of DeepSpeed engines on a busy 2-core machine
WORKER = os.path.join(ROOT, "tests", "plugins", "deepspeed", "ds_fp16_workers.py")
TIMEOUT = 850  # seconds for one torchrun (about 40 s on an idle machine)
CONFIGS = "z0fused,z0unfused,z1,z2,z3,z0bf16fused,z1bf16acc,z0fp32fused"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every config trained 3 steps (one fp16 overflow) and saved at world size 2, then loaded at the same
    size by a fresh engine: bitwise state (loss scaler included) and the next step bitwise."""
    out = tmp_path_factory.mktemp("ds_fp16")
    return out, torchrun(2, WORKER, "save", str(out), CONFIGS, timeout=TIMEOUT)


def test_fp16_and_fused_adam_wrappers_round_trip_with_the_loss_scaler(saved):
    # regression: FP16_Optimizer was refused at the first save_checkpoint, after training ("optimizer wrapper
    # FP16_Optimizer is not supported"), and fp16 engines at initialize (the loss scaler was not saved)
    _, log = saved
    for name in CONFIGS.split(","):
        assert log.count(f"OK save {name} ws=2") == 2, (name, log[-3000:])
    # the dynamic scaler state is not the fresh one: the overflow at step 2 halved FP16_Optimizer's scale and
    # spent one of ZeRO's two hysteresis steps
    assert ("OK save z0fused ws=2 scaler={'scaler.use_grad_scaling': True, 'scaler.dynamic_loss_scale': True, "
            "'scaler.cur_iter': 3, 'scaler.cur_scale': 128.0, 'scaler.last_overflow_iter': 1") in log, log[-3000:]
    assert "OK save z2 ws=2 scaler={'scaler.cur_scale': 256, 'scaler.dynamic': True, 'scaler.cur_iter': 3, " \
           "'scaler.last_overflow_iter': 1" in log and "'scaler.cur_hysteresis': 1" in log, log[-3000:]


def test_fp16_checkpoints_reshard_and_move_between_wrappers(saved):
    out, _ = saved
    log = torchrun(1, WORKER, "load", str(out), CONFIGS, timeout=TIMEOUT)
    for name in CONFIGS.split(","):
        assert log.count(f"OK load {name} ws=1") == 1, (name, log[-3000:])
    for cross in ("z2->z0fused", "z0fused->z3"):
        assert log.count(f"OK cross {cross} ws=1") == 1, (cross, log[-3000:])
    # ZeRO's hysteresis has no place in FP16_Optimizer's scaler: said, not dropped silently
    assert (f"unickpt.deepspeed: {os.path.join(str(out), 'z2', 'step3')}: this engine's FP16_Optimizer has no place "
            "for the saved loss-scaler fields {'delayed_shift': 2, 'cur_hysteresis': 1, 'consecutive_hysteresis': "
            "False, 'raise_error_at_min_scale': True}; they are not restored") in log, log[-3000:]


def test_unsavable_engine_is_refused_at_initialize(tmp_path):
    # regression: an engine unickpt cannot save initialized and trained; the error came at save_checkpoint
    log = torchrun(2, WORKER, "refuse", str(tmp_path), timeout=TIMEOUT)
    assert log.count("OK refuse ws=2") == 2, log[-3000:]


def test_wrapper_state_mismatch_is_named_before_anything_loads():
    """check_wrapper_state refuses a static scaler into a dynamic one (and a missing one) by name."""
    import torch

    from unickpt import StateMismatchError
    from unickpt.deepspeed.zero_state import ZeroLayout, check_wrapper_state, restore_wrapper_state, wrapper_state

    class Scaler:  # the fields of deepspeed's DynamicLossScaler that matter here
        dynamic, cur_scale, cur_iter, delayed_shift, cur_hysteresis = True, 256.0, 3, 2, 1

    class Zero:  # a ZeRO wrapper: loss_scaler object, overflow, clip_grad
        def __init__(self):
            self.loss_scaler, self.overflow, self.clip_grad, self.dtype = Scaler(), False, 1.0, torch.float16
            self.dynamic_loss_scale = True

    layout = ZeroLayout("zero12", None, [], [], {}, Zero())
    saved = wrapper_state(layout)
    assert saved == {"loss_scaler": {"dynamic": True, "cur_scale": 256.0, "cur_iter": 3, "delayed_shift": 2,
                                     "cur_hysteresis": 1}, "overflow": False, "clip_grad": 1.0}
    static = {**saved, "loss_scaler": {**saved["loss_scaler"], "dynamic": False}}
    with pytest.raises(StateMismatchError) as e:
        check_wrapper_state(layout, "/ck", static)
    assert str(e.value) == ("'/ck': 'optimizer.wrapper.loss_scaler': the checkpoint's fp16 loss scaling is static, "
                            "this engine's is dynamic (the \"fp16\" block's \"loss_scale\": 0 selects dynamic scaling)")
    with pytest.raises(StateMismatchError) as e:
        check_wrapper_state(layout, "/ck", {"clip_grad": 1.0})
    assert str(e.value) == ("'/ck': 'optimizer.wrapper.loss_scaler': the checkpoint holds none, this engine scales "
                            "the loss (fp16)")
    other = Zero()
    other.loss_scaler.cur_scale, other.loss_scaler.cur_iter, other.overflow = 65536.0, 0, True
    target = ZeroLayout("zero12", None, [], [], {}, other)
    assert restore_wrapper_state(target, saved) == []
    assert wrapper_state(target) == saved
