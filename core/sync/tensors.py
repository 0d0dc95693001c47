"""The tensors a weight sync moves: a training rank's shards as published entries, an inference rank's
tensors as targets, and the views each side copies through (no collective, no communication).

Training side (:func:`published`): a module (its ``get_model_state_dict``: DDP's and FSDP2's names, FSDP2's
DTensor shards), a dict, or a callable returning one, whose values are tensors (the whole tensor on this
rank), DTensors (the local box of their placements), :class:`~unickpt.Shard` (a box or flat range) or a
list of them (several boxes of one tensor: Megatron's ``[gate; up]``). Tensors that share storage
(tied embeddings) are published once, under their first name.

Inference side (:func:`targets`): a module (its parameters and persistent buffers, updated in place: for
a DTensor its local shard) or a ``{name: (shape, dtype)}`` template for a ``load_weights`` callable, for
which the subscriber holds one full tensor per name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..format.dtypes import dtype_to_str
from ..geometry import Box, FlatRange, chunk_pieces
from ..plan.transfer import SourceEntry, TargetEntry
from ..state.flat import tensor_leaf
from ..state.leaves import Shard

__all__ = ["Held", "published", "targets", "local_view", "state_of"]


@dataclass
class Held:
    """Elements ``box`` of the tensor ``name`` (global ``shape``) are ``tensor`` (``box.lengths`` shaped)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    box: Box
    tensor: torch.Tensor


def state_of(obj: Any) -> dict:
    """The ``{name: leaf}`` dict of a module (``get_model_state_dict``), a dict, or a callable returning one.
    Raises TypeError for anything else."""
    if isinstance(obj, nn.Module):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(obj)
    if callable(obj) and not isinstance(obj, dict):
        obj = obj()
    if not isinstance(obj, dict):
        raise TypeError(f"expected an nn.Module, a dict of tensors or a callable returning one, got {type(obj).__name__}")
    return obj


def _held(name: str, x: Any) -> list[Held]:
    """The boxes of one published leaf (:func:`~unickpt.state.flat.tensor_leaf`, as a save reads it; a flat
    range cut into its storage-contiguous boxes)."""
    if isinstance(x, (list, tuple)) and x and all(isinstance(s, Shard) for s in x):
        return [h for s in x for h in _held(name, s)]
    if not isinstance(x, (torch.Tensor, Shard)):
        raise TypeError(f"{name!r}: a weight sync moves tensors, DTensors and unickpt.Shard leaves, got {type(x).__name__}")
    leaf = tensor_leaf(name, x)
    if isinstance(leaf.spec, FlatRange):
        flat = leaf.local.reshape(-1)
        return [Held(name, leaf.global_shape, leaf.dtype, p.box, flat[p.elem_offset:p.elem_offset + p.box.numel].view(p.box.lengths))
                for p in chunk_pieces(leaf.spec, leaf.global_shape)]
    return [Held(name, leaf.global_shape, leaf.dtype, leaf.spec, leaf.local)]


def _storage_key(t: torch.Tensor) -> tuple | None:
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _collect(state: dict) -> tuple[list[Held], dict[str, str]]:
    """The tensors of ``state`` and its aliases ``{name: earlier name}`` (tied tensors: same storage)."""
    out: list[Held] = []
    seen: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name in state:
        held = _held(name, state[name])
        keys = [_storage_key(h.tensor) for h in held]
        if held and all(k is not None and k in seen for k in keys):
            aliases[name] = seen[keys[0]]  # type: ignore[index]
            continue
        seen.update((k, name) for k in keys if k is not None)
        out += held
    return out, aliases


def published(state: dict, dtype: torch.dtype | None = None) -> tuple[list[SourceEntry], list[Held], dict[str, str]]:
    """This training rank's entries (``dtype``: publish in this dtype, cast while packing; None: each
    tensor's own), the tensors they name and the aliases (tied names, published once)."""
    held, aliases = _collect(state)
    entries = []
    for h in held:
        d = dtype if dtype is not None and h.dtype.is_floating_point else h.dtype
        entries.append(SourceEntry(h.name, dtype_to_str(d), h.shape, h.box, torch.empty((), dtype=d).element_size()))
    return entries, held, aliases


def targets(obj: Any) -> tuple[list[TargetEntry], list[Held], dict[str, str]]:
    """This inference rank's targets: a module's tensors (in place), or full tensors allocated for a
    ``{name: (shape, dtype)}`` template (the ``load_weights`` adapter); and its aliases (tied names)."""
    aliases: dict[str, str] = {}
    if isinstance(obj, dict) and all(isinstance(v, tuple) and len(v) == 2 for v in obj.values()):
        held = []
        for name, (shape, dt) in obj.items():
            shape = tuple(int(n) for n in shape)
            held.append(Held(name, shape, dt, Box((0,) * len(shape), shape), torch.empty(shape, dtype=dt)))
    else:
        held, aliases = _collect(state_of(obj))
    return [TargetEntry(h.name, dtype_to_str(h.dtype), h.shape, h.box) for h in held], held, aliases


def local_view(h: Held, box: Box) -> torch.Tensor:
    """The elements ``box`` (global coordinates, inside ``h.box``) of ``h``'s tensor, as a view."""
    if not box.lengths:
        return h.tensor
    return h.tensor[tuple(slice(o - b, o - b + n) for o, b, n in zip(box.offsets, h.box.offsets, box.lengths))]
