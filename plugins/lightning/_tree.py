"""A Lightning checkpoint dict <-> (flat tensors, a tensor-free tree), losslessly.

Lightning's checkpoint is an arbitrary nested dict (``epoch``, ``global_step``, ``state_dict``,
``loops``, ``callbacks``, ``optimizer_states`` with integer parameter ids as keys,
``lr_schedulers``, ``hyper_parameters``, ...). unickpt stores tensors as tensor leaves and everything
else as tagged JSON (``unickpt.ext.Codec.encode``), which keeps tuples, integer keys, ``OrderedDict``, sets,
dtypes and devices. What the engine's own state traversal would not keep is handled here:

- every ``torch.Tensor`` is taken out of the tree and replaced by a placeholder
  ``{"__unickpt_lightning_tensor__": fqn, ...}`` that records what ``torch.save`` would keep and a
  state dict does not: ``nn.Parameter``, ``requires_grad``, the device;
- an ``OrderedDict`` keeps its ``_metadata`` attribute (the per-module version information that
  ``nn.Module.state_dict()`` attaches and ``load_state_dict`` reads);
- containers of any other type (``dict`` subclasses such as Lightning's ``AttributeDict``, named
  tuples) stay what they were: the codec stores them as pickles, so they load only with
  ``allow_pickle`` (Lightning's own ``.ckpt`` files are pickles throughout).

``fqn`` is the path of keys joined by ``.``, e.g. ``state_dict.layer.weight`` or
``optimizer_states.0.state.0.exp_avg``; a path that would repeat an earlier fqn gets ``#<n>``.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

import torch

__all__ = ["split", "join", "global_step", "TENSOR_TAG", "FRAMEWORK", "TENSORS_KEY", "TREE_KEY"]

TENSOR_TAG = "__unickpt_lightning_tensor__"
_ODICT_TAG = "__unickpt_lightning_odict__"
FRAMEWORK = "lightning"  # the ``framework`` recorded in the metadata of this plugin's checkpoints
TENSORS_KEY = "tensors"  # the unickpt state of a checkpoint dict: {TENSORS_KEY: the tensors of split(),
TREE_KEY = "lightning"  # TREE_KEY: the tensor-free tree}; the sharded route: TREE_KEY beside the live state


def global_step(checkpoint: Any) -> int | None:
    """The checkpoint dict's ``global_step`` (an int), or None."""
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    return int(step) if isinstance(step, int) else None


def split(checkpoint: Any, *, take_tensors: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    """Return ``(tree, tensors)``.

    With ``take_tensors`` every tensor is moved into ``tensors`` (fqn -> the caller's tensor, not a
    copy) and replaced by a placeholder; without it tensors stay in the tree (the codec stores
    them inline; only for small metadata). ``tree`` holds no reference to the caller's mutable
    containers, so later changes to ``checkpoint`` do not reach it. Raises TypeError naming the key
    for a DTensor (a sharded tensor needs the sharded route, see :mod:`unickpt.lightning._strategies`).
    """
    tensors: dict[str, torch.Tensor] = {}

    def fqn_for(path: tuple) -> str:
        base = ".".join(str(p) for p in path)
        fqn, n = base, 1
        while fqn in tensors:
            fqn, n = f"{base}#{n}", n + 1
        return fqn

    def walk(x: Any, path: tuple) -> Any:
        if isinstance(x, torch.Tensor):
            if _is_dtensor(x):
                raise TypeError(f"{'.'.join(map(str, path))!r}: a DTensor cannot be saved through a CheckpointIO "
                                "on one rank; use a sharded strategy route (unickpt.lightning routes "
                                "ModelParallelStrategy and FSDPStrategy(state_dict_type='sharded'))")
            if not take_tensors:
                return x
            fqn = fqn_for(path)
            tensors[fqn] = x.detach() if x.requires_grad else x
            tag: dict[str, Any] = {TENSOR_TAG: fqn, "device": str(x.device)}
            if isinstance(x, torch.nn.Parameter):
                tag["parameter"] = True
            if x.requires_grad:
                tag["requires_grad"] = True
            return tag
        if type(x) is collections.OrderedDict:
            odict = collections.OrderedDict((k, walk(v, path + (k,))) for k, v in x.items())
            meta = getattr(x, "_metadata", None)
            if meta is None:
                return odict
            return {_ODICT_TAG: {"items": odict, "metadata": meta}}
        if isinstance(x, dict):
            mapped = {k: walk(v, path + (k,)) for k, v in x.items()}
            return mapped if type(x) is dict else _rebuild_dict(x, mapped)
        if isinstance(x, list):
            elems = [walk(v, path + (i,)) for i, v in enumerate(x)]
            return elems if type(x) is list else _same_type(x, elems)
        if isinstance(x, tuple):
            members = [walk(v, path + (i,)) for i, v in enumerate(x)]
            return tuple(members) if type(x) is tuple else _same_type(x, members)
        return x

    return walk(checkpoint, ()), tensors


def join(tree: Any, tensor_for: Callable[[dict], Any], *, raw: bool = False) -> Any:
    """Inverse of :func:`split`: ``tensor_for(placeholder)`` gives each placeholder's tensor (already
    loaded); this puts back Parameters, ``requires_grad`` and ``OrderedDict._metadata``. Containers of
    other types are rebuilt with their own type. ``raw``: what ``tensor_for`` returns is the value as
    it is (a stand-in that carries the Parameter and ``requires_grad`` itself)."""

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if len(x) >= 2 and TENSOR_TAG in x and type(x) is dict:
                t = tensor_for(x)
                if raw:
                    return t
                if x.get("parameter"):
                    return torch.nn.Parameter(t, requires_grad=bool(x.get("requires_grad")))
                return t.requires_grad_(True) if x.get("requires_grad") else t
            if len(x) == 1 and _ODICT_TAG in x and type(x) is dict:
                body = x[_ODICT_TAG]
                out = collections.OrderedDict((k, walk(v)) for k, v in body["items"].items())
                out._metadata = body["metadata"]  # type: ignore[attr-defined]
                return out
            mapped = {k: walk(v) for k, v in x.items()}
            if type(x) is dict:
                return mapped
            if type(x) is collections.OrderedDict:
                return collections.OrderedDict(mapped)
            return _rebuild_dict(x, mapped)
        if isinstance(x, list):
            elems = [walk(v) for v in x]
            return elems if type(x) is list else _same_type(x, elems)
        if isinstance(x, tuple):
            members = [walk(v) for v in x]
            return tuple(members) if type(x) is tuple else _same_type(x, members)
        return x

    return walk(tree)


def _rebuild_dict(original: dict, items: dict) -> dict:
    """A copy of the dict subclass ``original`` holding ``items``, with its instance attributes."""
    out = original.__class__.__new__(original.__class__)
    dict.update(out, items)
    if hasattr(original, "__dict__"):
        out.__dict__.update({k: v for k, v in vars(original).items()})
    if isinstance(original, collections.defaultdict) and isinstance(out, collections.defaultdict):  # same class
        out.default_factory = original.default_factory
    return out


def _same_type(original: Any, items: list) -> Any:
    """A list / tuple subclass (named tuples included) of ``original``'s type holding ``items``."""
    cls = type(original)
    if isinstance(original, tuple) and hasattr(original, "_fields"):
        return cls(*items)
    return cls(items)


def _is_dtensor(x: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, DTensor)
