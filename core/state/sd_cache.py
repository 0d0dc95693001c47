"""The state dicts of a model and its optimizer, reused from one save to the next when nothing they
depend on has changed.

torch's ``get_state_dict(model, optimizer)`` costs 4-9 ms per call on the benchmarks' GPT (0.65 GB of
state, 3 FSDP2 blocks of width 1024, 1-4 ranks on a 2-core machine; ``benchmarks/save_load.py``'s
``call-parts`` record) and 14-19 ms on 15 blocks of width 512: half or more of a save's stall in
overlap snapshot mode. Save after save it returns the same thing: views of
the same parameter and buffer storages under the same fqns, and the optimizer's own per-parameter
state dicts (the live dicts, not copies) under the same fqns; only the ``param_groups`` values (a
learning rate a scheduler changed) are read anew. This module keeps the last result per (model,
optimizer) and hands it out again while a fingerprint of what that result depends on is unchanged:

* every module's registered parameters and buffers: name, object identity, and the address, shape,
  strides, dtype and conjugate/negative bits of their data (a DTensor's local shard), so a
  ``param.data = ...`` swap (a transposed view too) or FSDP2's unsharded parameters (registered in
  place of the sharded ones between forward and backward) miss; every module's children's names
  (a renamed child changes the fqns);
* the optimizer's parameters (by group) and the identity of each parameter's state dict (a
  ``load_state_dict`` or a new parameter group miss).

It is never used (torch's call runs, every time) when what torch returns could differ for the same
fingerprint: a module or optimizer whose ``state_dict`` (or a module whose ``_save_to_state_dict`` or
``get_extra_state``) is not torch's own, on its class or on the instance, or torch's own patched after
this module was imported; state-dict hooks other than FSDP2's resharding pre-hook (which only
reshards, and resharded parameters are what the fingerprint holds); optimizer state-dict hooks;
FSDP1 modules; an optimizer without state yet (torch would initialise it). The cached tensors are
views that share the parameters' storage, as torch's own result does, so a cached result keeps the
storage of a parameter replaced since alive until the model's next save; the cache keeps one result
per (model, live optimizer), drops an optimizer's result once the optimizer is gone (at the model's
next save), and all of a model's with the model.

Caller's thread of a save only (:func:`unickpt.state.flat.flatten` with ``for_load=False``); no
collective. Thread-safe (one lock).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, cast

import torch
from torch import nn

__all__ = ["state_dicts", "clear", "cache_info", "uses_torch_state_dict", "FSDP2_RESHARD_HOOK"]

_LOCK = threading.Lock()
_COUNTS = {"hits": 0, "misses": 0, "uncacheable": 0}
_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()  # model -> {id(optim): entry}
FSDP2_RESHARD_HOOK = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"
"""``__qualname__`` of FSDP2's state-dict pre-hook (save and load): it only reshards the parameters."""


def clear() -> None:
    """Forget every cached result and reset the counts (tests; a caller that changed a model in a
    way the fingerprint does not see)."""
    with _LOCK:
        _CACHE.clear()
        _COUNTS.update(hits=0, misses=0, uncacheable=0)


def cache_info() -> dict[str, int]:
    """``{"hits", "misses", "uncacheable"}``: calls of :func:`state_dicts` served from the cache,
    served by torch's call and then cached (or not, when the call changed the fingerprint), and
    served by torch's call because the fingerprint is None."""
    with _LOCK:
        return dict(_COUNTS)


def state_dicts(model: nn.Module, optim: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """``get_state_dict(model, optim)`` (``optim`` None: ``(get_model_state_dict(model), None)``), from
    the cache when the fingerprint of ``model`` and ``optim`` equals that of the cached result.

    Returns fresh outer dicts (the caller may keep them); the tensors and per-parameter optimizer
    state dicts in them are shared with the model and optimizer, as in torch's result. Raises what
    torch's call raises."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    key = _fingerprint(model, optim)
    if key is not None:
        with _LOCK:
            entry = _CACHE.get(model, {}).get(id(optim) if optim is not None else None)
            hit = entry is not None and entry["optim"]() is optim and entry["key"] == key
            _COUNTS["hits" if hit else "misses"] += 1
        if hit and entry is not None:
            return _copy(entry, optim)
    else:
        with _LOCK:
            _COUNTS["uncacheable"] += 1
    osd: dict | None
    if optim is None:
        msd, osd = get_model_state_dict(model), None
    else:  # torch types the optimizer state as a union of its values; "state" is a dict, "param_groups" a list
        msd, osd = cast("tuple[dict, dict]", get_state_dict(model, optim))
    if key is not None and _fingerprint(model, optim) == key:  # torch's call changed nothing it depends on
        entry = {"key": key, "optim": weakref.ref(optim) if optim is not None else (lambda: None),
                 "msd": dict(msd), "state": None if osd is None else dict(osd["state"]),
                 "groups": None if osd is None else [list(g["params"]) for g in osd["param_groups"]]}
        if optim is None or len(entry["groups"]) == len(optim.param_groups):
            with _LOCK:
                entries = _CACHE.setdefault(model, {})
                for k in [k for k, e in entries.items() if k is not None and e["optim"]() is None]:
                    del entries[k]  # an optimizer that is gone (re-created): its entry goes with it
                entries[id(optim) if optim is not None else None] = entry
    return msd, osd


def _copy(entry: dict, optim: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    msd = dict(entry["msd"])
    if optim is None:
        return msd, None
    groups = []
    for fqns, group in zip(entry["groups"], optim.param_groups):  # as Optimizer.state_dict packs them
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(fqns)
        groups.append(packed)
    return msd, {"state": dict(entry["state"]), "param_groups": groups}


def _data_key(t: torch.Tensor) -> tuple:
    local = getattr(t, "_local_tensor", t)  # a DTensor's local shard
    return id(t), local.data_ptr(), local.shape, local.stride(), local.dtype, local.is_conj(), local.is_neg()


# torch's own implementations: a class or an instance with another one (or torch patched after this
# module was imported) gets torch's call every time
_TORCH_IMPLS = {"state_dict": nn.Module.state_dict, "_save_to_state_dict": nn.Module._save_to_state_dict,
                "get_extra_state": nn.Module.get_extra_state}
_OPTIM_STATE_DICT = torch.optim.Optimizer.state_dict


def uses_torch_state_dict(m: nn.Module) -> bool:
    """Whether ``m``'s ``state_dict``, ``_save_to_state_dict`` and ``get_extra_state`` are torch's own
    (on its class and not on the instance; torch's own not patched since import) and ``m`` is not an
    FSDP1 wrapper."""
    cls, own = type(m), m.__dict__
    for name, impl in _TORCH_IMPLS.items():
        if getattr(cls, name) is not impl or name in own:
            return False
    return "torch.distributed.fsdp.fully_sharded_data_parallel" not in cls.__module__


def _fingerprint(model: nn.Module, optim: torch.optim.Optimizer | None) -> tuple | None:
    """What the state dicts depend on, or None when they must come from torch's call every time."""
    if any(getattr(nn.Module, name) is not impl for name, impl in _TORCH_IMPLS.items()):
        return None  # torch's own patched since this module was imported
    parts: list = []
    for m in model.modules():
        if not uses_torch_state_dict(m) or m._state_dict_hooks or any(
                getattr(h, "__qualname__", "") != FSDP2_RESHARD_HOOK for h in m._state_dict_pre_hooks.values()):
            return None
        parts.append(tuple(m._modules))  # the children's names (a renamed child changes the fqns)
        for name, t in m._parameters.items():
            parts.append((name, None if t is None else _data_key(t)))
        for name, b in m._buffers.items():
            parts.append((name, None if b is None or name in m._non_persistent_buffers_set else _data_key(b)))
    if optim is None:
        return tuple(parts)
    if type(optim).state_dict is not _OPTIM_STATE_DICT or torch.optim.Optimizer.state_dict is not _OPTIM_STATE_DICT \
            or "state_dict" in optim.__dict__ or not optim.state \
            or optim._optimizer_state_dict_pre_hooks or optim._optimizer_state_dict_post_hooks:
        return None
    state = optim.state
    for group in optim.param_groups:
        ps = group["params"]
        parts.append(len(ps))
        parts.extend((id(p), id(state.get(p))) for p in ps)
    parts.append(len(state))
    return tuple(parts)
