"""How DeepSpeed checkpoints saved through unickpt name training state, for loads into another framework
(docs/cross-framework.md; registered as the ``deepspeed`` layout, entry-point group ``unickpt.layouts``).

:mod:`unickpt.deepspeed.checkpoint` stores ``module.<param>`` (the engine's weights, bf16 or fp32),
``optimizer.fp32.<param>`` (fp32 master weights), ``optimizer.state.<key>.<param>`` (moments),
``optimizer.scalars`` (per optimizer partition, Adam's ``step``), ``optimizer.param_groups``,
``lr_scheduler``, ``deepspeed`` (``global_steps``, ...) and the caller's ``client_state`` (which stays
behind). Imports no DeepSpeed.
"""
from __future__ import annotations

from typing import Any

from unickpt import CheckpointMetadata, StateMismatchError, ext, interop

__all__ = ["DeepSpeedLayout", "LAYOUT"]


def _twice(objects: dict, fqn: str) -> Any:
    """A plain value the plugin encoded itself before handing it to the engine (decoded twice)."""
    return ext.Codec.decode(ext.Codec.decode(objects[fqn], key=fqn), key=fqn)


class DeepSpeedLayout(interop.Layout):
    """The ``deepspeed`` layout (see the module docstring)."""

    framework = "deepspeed"

    def source(self, meta: CheckpointMetadata) -> interop.SourceNames:
        _, _, objects = ext.StateTools.saved_leaves(meta.state_tree)
        out = interop.SourceNames()
        for fqn in sorted(set(meta.tensors) | set(meta.aliases)):
            if fqn.startswith("module."):
                out.tensors[(interop.PARAM, fqn[len("module."):])] = fqn
            elif fqn.startswith("optimizer.fp32."):
                out.tensors[(interop.MASTER, fqn[len("optimizer.fp32."):])] = fqn
            elif fqn.startswith("optimizer.state."):
                key, _, name = fqn[len("optimizer.state."):].partition(".")
                out.tensors[(f"state.{key}", name)] = fqn
            else:
                out.private.append(fqn)
        if "optimizer.scalars" in objects:
            scalars = _twice(objects, "optimizer.scalars")
            steps: list[Any] = [s.get("step") for s in scalars if isinstance(s, dict) and "step" in s]
            if steps:
                first = steps[0]
                same = all(type(x) is type(first) and (x.equal(first) if hasattr(first, "equal") else x == first)
                           for x in steps[1:])
                if not same:
                    raise StateMismatchError(f"'optimizer.scalars': the optimizer partitions of this DeepSpeed "
                                             f"checkpoint have different steps {steps}; they name no parameter, so "
                                             "they cannot be given to another framework's parameters")
                out.plain["optim.step"] = first
        if "optimizer.param_groups" in objects:
            out.plain["optim.param_groups"] = _twice(objects, "optimizer.param_groups")
        if "lr_scheduler" in objects:
            out.plain["scheduler"] = ext.Codec.decode(objects["lr_scheduler"], key="lr_scheduler")
        info = ext.Codec.decode(objects["deepspeed"], key="deepspeed") if "deepspeed" in objects else {}
        if isinstance(info, dict) and "global_steps" in info:
            out.plain["step"] = int(info["global_steps"])
        out.private += sorted(f for f in objects if f not in ("optimizer.scalars", "optimizer.param_groups",
                                                              "lr_scheduler", "deepspeed"))
        return out


LAYOUT = DeepSpeedLayout()
