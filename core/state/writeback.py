"""The last step of a load into a module: torch's ``set_model_state_dict``, or nothing when it would
only copy every tensor onto itself.

A load fills the tensors of the module's state dict in place (:mod:`unickpt.loading`). torch's
state dict of an ordinary module (FSDP2's included) holds views of the module's own parameters and
buffers, so those writes have already landed in the module, and ``load_state_dict`` would copy each
tensor onto its own memory. That copy is not free: on the tier benchmark's restart (an FSDP2 GPT,
4 ranks on 2 cores, ``benchmarks/tiers_bench.py``) the first ``set_model_state_dict`` of a process
took 37-44 ms per rank, most of it DTensor's uncached sharding propagation of ``copy_``, plus a
memory copy of the parameters (22 MB per rank there) on every later load.

:func:`set_module_state` skips it when skipping is provably the same as running it:

* every module of the model uses torch's own ``load_state_dict``, ``_load_from_state_dict``,
  ``set_extra_state``, ``state_dict``, ``_save_to_state_dict`` and ``get_extra_state`` (on its class
  and not on the instance, torch's own not patched since import), and is not an FSDP1 wrapper (its
  state dict may be a copy in another layout);
* no state-dict hooks other than FSDP2's: its load pre-hook reshards (the save pre-hook that the
  load's ``get_state_dict`` ran has already resharded) and its post-hook re-pads a parameter's local
  shard only when the shard's storage changed (it did not: the load wrote into it);
* every tensor of the state dict is a view of exactly the memory of one of the module's registered
  parameters or persistent buffers (same device, address, shape, strides, dtype; a DTensor's local
  shard), so a state dict that holds copies (CPU offload, a full state dict, a user's hook) is
  written back;
* every tensor of the state dict is of torch's own class (a DTensor of one), not a subclass that may
  act on ``copy_``; none is an inference tensor outside inference mode (torch's ``copy_`` raises);
  ``torch.__future__``'s swap-on-conversion is off (``load_state_dict`` would swap the parameters).

Then the only effect of torch's call that remains is the autograd version counter of each tensor,
which :func:`set_module_state` increments as ``copy_`` would (a DTensor's own counter and its local
shard's: a graph that saved a parameter before the load then fails at backward, as it would have).
Otherwise torch's call runs, with every hook. (Cases checked against torch's call by a break test:
tied and shared parameters, parametrizations, weight norm, ``torch.compile``, DataParallel, DDP,
FSDP2 uneven and between forward and backward, views of one flat tensor, zero-size, bf16/fp16.)

Caller's thread of a load (the appliers of :func:`unickpt.state.flat.flatten`); no collective.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .sd_cache import FSDP2_RESHARD_HOOK, uses_torch_state_dict

__all__ = ["set_module_state", "writes_back"]

# torch's own load side (the save side, and FSDP1, as sd_cache.uses_torch_state_dict checks it)
_TORCH_LOAD_IMPLS = {name: getattr(nn.Module, name) for name in (
    "load_state_dict", "_load_from_state_dict", "set_extra_state")}
# FSDP2's load post-hook (torch.distributed.fsdp._fully_shard): a no-op when the parameters' shards
# were written in place (see the module docstring); its pre-hook is sd_cache.FSDP2_RESHARD_HOOK
_FSDP2_POST = "FSDPParam.__init__.<locals>.<lambda>"


def set_module_state(model: nn.Module, state_dict: dict) -> None:
    """Load ``state_dict`` (a state dict of ``model`` from torch's ``get_state_dict``, its tensors
    filled in place by a load) into ``model``: ``set_model_state_dict(model, state_dict)``, skipped
    when :func:`writes_back` is False. Raises what torch's call raises."""
    if not writes_back(model, state_dict):
        for t in state_dict.values():  # as copy_ would: the DTensor's own counter (what autograd saved) and its shard's
            torch.autograd.graph.increment_version(t)
            if type(t) is not torch.Tensor:
                torch.autograd.graph.increment_version(t._local_tensor)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state_dict)


def writes_back(model: nn.Module, state_dict: dict) -> bool:
    """Whether loading ``state_dict`` into ``model`` does anything beyond copying each tensor onto its
    own memory (see the module docstring); True whenever that cannot be shown."""
    if torch.__future__.get_swap_module_params_on_conversion():  # torch's call swaps the parameters
        return True
    if not all(_plain(t) for t in state_dict.values()):
        return True
    own: set[tuple] = set()
    for m in model.modules():
        # a class attribute compared with torch's own at import also catches torch patched since
        if not uses_torch_state_dict(m) or any(getattr(type(m), name) is not impl or name in m.__dict__
                                               for name, impl in _TORCH_LOAD_IMPLS.items()):
            return True
        if m._state_dict_hooks or any(_qualname(h) != FSDP2_RESHARD_HOOK for h in m._state_dict_pre_hooks.values()) \
                or any(_qualname(h) != FSDP2_RESHARD_HOOK for h in m._load_state_dict_pre_hooks.values()) \
                or any(_qualname(h) != _FSDP2_POST for h in m._load_state_dict_post_hooks.values()):
            return True
        for t in m._parameters.values():
            if t is not None:
                own.add(_memory_key(t))
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                own.add(_memory_key(b))
    return not all(_memory_key(t) in own for t in state_dict.values())


def _plain(t: Any) -> bool:
    """A dense tensor of torch's own class (or a DTensor of one) that torch's ``copy_`` could write
    outside inference mode: a tensor subclass may act on ``copy_`` (``__torch_function__``), and an
    inference tensor written outside inference mode is an error torch's call raises."""
    if type(t) is not torch.Tensor:
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is None or type(t) is not dtensor.DTensor:
            return False
        t = t._local_tensor
        if type(t) is not torch.Tensor:
            return False
    return not t.is_inference() or torch.is_inference_mode_enabled()


def _qualname(hook: Any) -> str:
    return getattr(getattr(hook, "hook", hook), "__qualname__", "")  # a load pre-hook is wrapped (_WrappedHook)


def _memory_key(t: torch.Tensor) -> tuple:
    local = getattr(t, "_local_tensor", t)  # a DTensor's local shard
    return (local.device, local.data_ptr(), tuple(local.shape), local.stride(), local.dtype, local.is_conj(),
            local.is_neg())
