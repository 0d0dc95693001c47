"""Worker functions for the optimizer-state tests in test_save_load.py (every rank of a DistPool: gloo, CPU).

A save must leave the optimizer it saves as it is: torch's ``get_state_dict`` initialises an optimizer
that has not stepped with a zero-gradient, lr=0 ``step()`` (Adam's step count 0 -> 1).
"""
from __future__ import annotations

import torch

import unickpt
import unickpt.fsdp
import unickpt.state.flat
from fsdp_workers import build, full_state, train


def _optim_summary(optim: torch.optim.Optimizer) -> dict:
    return {"n_state": len(optim.state),
            "steps": sorted(float(st["step"]) for st in optim.state.values() if "step" in st)}


def save_unstepped(path: str, flavour: str, how: str) -> dict:
    """Save a model and its never-stepped AdamW (``how``: "direct" puts both in the state, "fsdp" uses
    ``unickpt.fsdp.state``); report the optimizer and gradients after the save, then train one step,
    load the early checkpoint back and report the optimizer again."""
    model, optim = build(flavour)
    state = {"model": model, "optim": optim} if how == "direct" else unickpt.fsdp.state(model, optim)
    unickpt.save(path, state, async_save=False)
    out = {"after_save": _optim_summary(optim), "grads": [p.grad is None for p in model.parameters()]}
    with unickpt.state.flat.optimizers_untouched():  # the reference read must not step it either
        before = full_state(model, optim)
    out["untouched_by_reference"] = _optim_summary(optim)
    train(model, optim, 1, seed=1)
    out["trained"] = _optim_summary(optim)
    state = {"model": model, "optim": optim} if how == "direct" else unickpt.fsdp.state(model, optim)
    unickpt.load(path, state)
    out["after_load"] = _optim_summary(optim)
    with unickpt.state.flat.optimizers_untouched():
        after = full_state(model, optim)
    if before is not None:
        out["weights_equal"] = _equal(before, after)
    return out


def save_direct_load_direct(path: str, flavour: str) -> dict:
    """Train, save ``{"model": m, "optim": o}`` as they are, load into a freshly built pair: equal?"""
    model, optim = build(flavour)
    train(model, optim, 2, seed=0)
    unickpt.save(path, {"model": model, "optim": optim})
    want = full_state(model, optim)
    model2, optim2 = build(flavour, seed=5)
    unickpt.load(path, {"model": model2, "optim": optim2})
    got = full_state(model2, optim2)
    if want is None:
        return {}
    return {"equal": _equal(want, got), "n_keys": len(want)}


def _equal(a: dict, b: dict) -> bool:
    """Bitwise equality of two :func:`fsdp_workers.full_state` results."""
    if a.keys() != b.keys():
        return False
    return all(torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items())
