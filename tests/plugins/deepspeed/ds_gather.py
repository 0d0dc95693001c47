"""A DeepSpeed engine's parameters and Adam state, gathered by DeepSpeed's own APIs (independent of unickpt).

Shared by ``ds_tools_workers.py`` (beside this file) and ``benchmarks/deepspeed_vs_universal.py`` (which puts
this folder on ``sys.path`` in its torchrun workers); not a test file, and not part of unickpt.
"""
from __future__ import annotations

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state


def gather_params(engine) -> dict:
    """``lp.<name>``: every module parameter as the module holds it; ``fp32.<name>`` / ``exp_avg.<name>`` /
    ``exp_avg_sq.<name>``: the fp32 master and Adam's moments of each trainable one (``safe_get_full_*``).
    Collective under ZeRO-3 (every rank calls it)."""
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        engine.optimizer._lazy_init_hp_params_optimizer_state()  # links optimizer state created by a load
    out = {}
    for name, p in engine.module.named_parameters():
        if engine.zero_optimization_stage() == 3:
            with deepspeed.zero.GatheredParameters([p]):
                out[f"lp.{name}"] = p.data.clone()
        else:
            out[f"lp.{name}"] = p.data.clone()
        if p.requires_grad:
            out[f"fp32.{name}"] = safe_get_full_fp32_param(p).clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}.{name}"] = safe_get_full_optimizer_state(p, key).clone()
    return out
