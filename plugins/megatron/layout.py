"""How megatron-core checkpoints saved through unickpt name their tensors, as parameter names
(docs/cross-framework.md; registered as the ``megatron`` layout, entry-point group ``unickpt.layouts``).

:mod:`unickpt.megatron.sharded_state` stores a ShardedTensor key with prepended (stacked-layer) axes as
``KEY[i]`` and a key some rank held in ``k`` pieces along one axis (SwiGLU's ``linear_fc1``) as ``k``
slabs ``KEY[i]#s/k``. As parameter names:

- ``decoder.layers.<rest>[i]`` -> ``decoder.layers.<i>.<rest>`` (the layer index where ``named_parameters``
  puts it; other stacked keys keep their ``[i]``);
- slabs are leaves ``<name>#s/k`` plus a rule ``Fuse(<name>, [<name>#0/k, ...], dim=axis)``, so
  ``decoder.layers.0.mlp.linear_fc1.weight`` is the whole ``[gate; up]`` tensor;
- ShardedObjects (``megatron_sharded_objects/...``: RNG state, ``_extra_state``) stay behind.

The names are the ShardedTensor keys (``self_attention.linear_qkv.layer_norm_weight`` is the input norm
of both the Transformer-Engine and the local layer specs).
"""
from __future__ import annotations

import re

from unickpt import CheckpointMetadata, Fuse, interop

from .sharded_state import OBJECT_PREFIX

__all__ = ["MegatronLayout", "LAYOUT", "SUBDIR", "param_name", "stored_key"]

SUBDIR = "unickpt"  # the unickpt checkpoint inside a megatron checkpoint directory (strategy.SUBDIR)
_FQN = re.compile(r"(?P<key>.+?)(?:\[(?P<idx>[0-9,]+)\])?(?:#(?P<slab>\d+/\d+))?")


def param_name(key: str, idx: tuple[int, ...]) -> str:
    """The parameter name of stored key ``key`` at prepended offsets ``idx``."""
    parts = key.split(".")
    if len(idx) == 1 and "layers" in parts:
        j = parts.index("layers")
        return ".".join(parts[: j + 1] + [str(idx[0])] + parts[j + 1:])
    return key + (f"[{','.join(map(str, idx))}]" if idx else "")


def stored_key(name: str) -> tuple[str, tuple[int, ...]]:
    """Inverse of :func:`param_name` for layer parameters: ``(key, (i,))``; other names ``(name, ())``."""
    m = re.fullmatch(r"(?P<head>.*?\blayers)\.(?P<i>\d+)\.(?P<rest>.+)", name)
    if m is None:
        return name, ()
    return f"{m.group('head')}.{m.group('rest')}", (int(m.group("i")),)


class MegatronLayout(interop.Layout):
    """The ``megatron`` layout (see the module docstring)."""

    framework = "megatron"

    def source(self, meta: CheckpointMetadata) -> interop.SourceNames:
        keys = (meta.extra.get("megatron") or {}).get("keys", {})
        out = interop.SourceNames()
        slabs: dict[str, tuple[int, int]] = {}
        for fqn in sorted(set(meta.tensors) | set(meta.aliases)):
            if fqn.startswith(OBJECT_PREFIX):
                out.private.append(fqn)
                continue
            m = _FQN.fullmatch(fqn)
            assert m is not None  # _FQN matches every non-empty name
            key, idx = m.group("key"), tuple(int(x) for x in (m.group("idx") or "").split(",") if x)
            name = param_name(key, idx)
            if m.group("slab"):
                split = (keys.get(key) or {}).get("split")
                if not split:
                    out.private.append(fqn)
                    continue
                slabs[name] = (int(split[0]), int(split[1]))
                name = f"{name}#{m.group('slab')}"
            out.tensors[(interop.PARAM, name)] = fqn
        out.rules = [Fuse(name, tuple(f"{name}#{s}/{k}" for s in range(k)), axis) for name, (axis, k) in sorted(slabs.items())]
        return out


LAYOUT = MegatronLayout()
