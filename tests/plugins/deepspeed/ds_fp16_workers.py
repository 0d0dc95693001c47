"""torchrun worker for tests/plugins/deepspeed/test_deepspeed_fp16.py: DeepSpeed fp16 (and bf16 with DeepSpeed's
FusedAdam) engines on CPU (gloo) saving and loading through unickpt, with the optimizer wrappers DeepSpeed
builds for ``"optimizer": {"type": "Adam"}``: FP16_Optimizer (ZeRO-0, FusedAdam), FP16_UnfusedOptimizer
(ZeRO-0, torch Adam), DeepSpeedZeroOptimizer (ZeRO-1/2), DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer.

  DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tests/plugins/deepspeed/ds_fp16_workers.py save OUT CONFIGS
  DS_ACCELERATOR=cpu torchrun --nproc_per_node=1 tests/plugins/deepspeed/ds_fp16_workers.py load OUT CONFIGS

``save``: per config, train 3 steps (the second overflows in fp16: the loss scaler halves its scale, or
spends one hysteresis), save, gather the reference state (weights, fp32 masters, Adam's moments and step,
the loss-scaler fields) with DeepSpeed's own APIs, train a 4th step; a fresh engine loads at the same size:
its state must equal the reference bitwise, and its 4th step the uninterrupted one. ``load`` (another world
size): the same checkpoints resharded, bitwise, then a step; and across wrappers (ZeRO-2 into ZeRO-0's
FP16_Optimizer and back). ``refuse``: an engine unickpt cannot save fails in ``deepspeed.initialize``.

DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels (``is_fp16_supported``, an
AVX512-FP16 probe); without them ``deepspeed.initialize`` refuses ``"fp16"`` outright. The worker sets
that probe to True: torch runs fp16 on any CPU, only slower.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

import deepspeed  # noqa: E402  (the unickpt startup hook patches it here)
from deepspeed.accelerator import get_accelerator

import deepspeed_workers as W  # noqa: E402  (this script's folder is on sys.path under torchrun)

if not get_accelerator().is_fp16_supported():
    type(get_accelerator()).is_fp16_supported = lambda self: True

# name -> (ZeRO stage, dtype, torch Adam instead of DeepSpeed's FusedAdam, wrapper DeepSpeed builds)
CONFIGS = {
    "z0fused": (0, "fp16", False, "FP16_Optimizer"),
    "z0unfused": (0, "fp16", True, "FP16_UnfusedOptimizer"),
    "z1": (1, "fp16", False, "DeepSpeedZeroOptimizer"),
    "z2": (2, "fp16", False, "DeepSpeedZeroOptimizer"),
    "z3": (3, "fp16", False, "DeepSpeedZeroOptimizer_Stage3"),
    "z0bf16fused": (0, "bf16", False, "FP16_Optimizer"),  # issue #34: refused at the first save
    "z1bf16acc": (1, "bf16", False, "BF16_Optimizer"),  # fp32 gradient accumulation
    "z0fp32fused": (0, "fp32", False, "FusedAdam"),  # no wrapper: the engine steps FusedAdam itself
}
SCALER_COMMON = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def ds_config(name: str, unickpt: bool = True) -> dict:
    stage, dtype, torch_adam, _ = CONFIGS[name]
    params = {"lr": 1e-2, "weight_decay": 0.01}
    if torch_adam:
        params["torch_adam"] = True
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": params},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                      "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
    }
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
    elif dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if name == "z1bf16acc":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if unickpt:
        cfg["unickpt"] = {"enabled": True, "async_save": True}
    return cfg


def make(name: str, seed: int):
    torch.manual_seed(seed)
    model = W.Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(name))
    want = CONFIGS[name][3]
    assert type(engine.optimizer).__name__ == want, (name, type(engine.optimizer).__name__, want)
    return engine


def train_step(engine, step: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    if step == 1 and engine.fp16_enabled():
        x = x * 1e4  # fp16 gradients overflow: the step is skipped and the loss scaler reacts
    dtype = torch.float16 if engine.fp16_enabled() else torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    loss = (engine(x.to(dtype)).float() - y).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def scaler_fields(opt) -> dict:
    """The wrapper's loss scaler and flags as its own ``state_dict()`` sees them (independent of unickpt)."""
    out = {}
    holder = getattr(opt, "loss_scale_config", None) or getattr(opt, "loss_scaler", None)
    if holder is not None:
        out.update({f"scaler.{k}": v for k, v in vars(holder).items() if k != "dtype"})
    for k in ("overflow", "clip_grad", "dynamic_loss_scale"):
        if hasattr(opt, k):
            v = getattr(opt, k)
            out[k] = v.item() if torch.is_tensor(v) else v
    return out


def gather(engine) -> dict:
    """The full state: W.gather's, FP16_Optimizer's flat masters cut per parameter, the scaler fields."""
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups_flat") and hasattr(opt, "fp16_groups"):  # FP16_Optimizer
        out = {}
        for lps, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            st = opt.optimizer.state[flat]
            parts = {"fp32": _unflatten_dense_tensors(flat, lps),
                     **{k: _unflatten_dense_tensors(st[k], lps) for k in ("exp_avg", "exp_avg_sq")}}
            for i, p in enumerate(lps):
                name = engine.param_names[p]
                out[f"lp.{name}"] = p.data.clone()
                for key, tensors in parts.items():
                    out[f"{key}.{name}"] = tensors[i].clone()
        out["buffer.scale"] = engine.module.scale.clone()
        out["meta"] = {"lr": [g["lr"] for g in opt.optimizer.param_groups], "global_steps": engine.global_steps,
                       "sched": engine.lr_scheduler.state_dict()}
    else:
        out = W.gather(engine)
    base = getattr(opt, "optimizer", opt)
    out["meta"]["group_steps"] = [g.get("step") for g in base.param_groups]  # FusedAdam counts here
    out["meta"]["skipped_steps"] = engine.skipped_steps
    out["scaler"] = scaler_fields(opt)
    return out


def phase_save(out: str, names: list[str]) -> None:
    for name in names:
        d = os.path.join(out, name)
        e1 = make(name, seed=0)
        for s in range(3):
            train_step(e1, s)
        fp16 = e1.fp16_enabled()
        assert e1.skipped_steps == (1 if fp16 else 0), (name, e1.skipped_steps)
        e1.save_checkpoint(d, tag="step3")
        ref = gather(e1)
        train_step(e1, 3)  # the uninterrupted run
        after = gather(e1)
        e1.checkpoint_engine.finish_pending()
        if dist.get_rank() == 0:
            torch.save({"ref": ref, "after": after}, os.path.join(out, f"{name}_ref.pt"))
        e2 = make(name, seed=1)
        if fp16:  # a fresh scaler differs: the load has something to restore
            assert scaler_fields(e2.optimizer) != ref["scaler"], (name, ref["scaler"])
        e2.load_checkpoint(d)
        W.assert_same(gather(e2), ref, f"{name} same-size load")
        train_step(e2, 3)
        W.assert_same(gather(e2), after, f"{name} step after load")
        e1.destroy()
        e2.destroy()
        print(f"OK save {name} ws={dist.get_world_size()} scaler={ref['scaler']}", flush=True)


def phase_load(out: str, names: list[str]) -> None:
    for name in names:
        ref = torch.load(os.path.join(out, f"{name}_ref.pt"), weights_only=False)["ref"]
        e = make(name, seed=1)
        e.load_checkpoint(os.path.join(out, name))
        W.assert_same(gather(e), ref, f"{name} reshard to ws={dist.get_world_size()}")
        loss = train_step(e, 3)
        assert loss == loss and abs(loss) < 1e3, loss
        if e.fp16_enabled():
            assert gather(e)["scaler"]["scaler.cur_iter"] == ref["scaler"]["scaler.cur_iter"] + 1
        e.destroy()
        print(f"OK load {name} ws={dist.get_world_size()}", flush=True)


def phase_cross(out: str) -> None:
    """Across wrappers: ZeRO-2's checkpoint into ZeRO-0's FP16_Optimizer (flat masters) and FP16_Optimizer's
    into ZeRO-3; the weights, masters, moments and the loss scaler's common fields move bitwise."""
    for engine_name, ckpt_name in (("z0fused", "z2"), ("z3", "z0fused")):
        ref = torch.load(os.path.join(out, f"{ckpt_name}_ref.pt"), weights_only=False)["ref"]
        e = make(engine_name, seed=1)
        e.load_checkpoint(os.path.join(out, ckpt_name))
        got = gather(e)
        tensors = {k: v for k, v in ref.items() if torch.is_tensor(v)}
        W.assert_same({k: got[k] for k in tensors}, tensors, f"{ckpt_name} into {engine_name}")
        for f in SCALER_COMMON:
            assert got["scaler"][f"scaler.{f}"] == ref["scaler"][f"scaler.{f}"], (f, got["scaler"], ref["scaler"])
        assert got["meta"]["group_steps"] == ref["meta"]["group_steps"], (got["meta"], ref["meta"])
        train_step(e, 3)
        e.destroy()
        print(f"OK cross {ckpt_name}->{engine_name} ws={dist.get_world_size()}", flush=True)


def phase_refuse() -> None:
    """An engine unickpt cannot save (no optimizer: an inference engine) fails in deepspeed.initialize; the
    same config without the block, and a supported one, initialize."""
    cfg = ds_config("z0fp32fused")
    del cfg["optimizer"], cfg["scheduler"]
    torch.manual_seed(0)
    model = W.Net()
    try:
        deepspeed.initialize(model=model, config=cfg)
    except NotImplementedError as err:
        assert str(err) == ("unickpt.deepspeed: the engine has no optimizer (inference engines are not supported by "
                            'the unickpt checkpoint path); remove the "unickpt" block from the DeepSpeed config to '
                            "use DeepSpeed's own checkpoints"), str(err)
    else:
        raise AssertionError("deepspeed.initialize accepted an engine unickpt cannot save")
    del cfg["unickpt"]
    e, *_ = deepspeed.initialize(model=W.Net(), config=cfg)
    e.destroy()
    make("z0bf16fused", seed=0).destroy()
    print(f"OK refuse ws={dist.get_world_size()}", flush=True)


def _load_and_cross(out: str, names: list[str]) -> None:
    phase_load(out, names)
    phase_cross(out)


if __name__ == "__main__":
    W.run_phases({"save": phase_save, "load": _load_and_cross, "refuse": lambda out, _: phase_refuse()})
