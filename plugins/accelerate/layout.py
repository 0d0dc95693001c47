"""How Accelerate's checkpoints name training state, for loads into another framework
(docs/cross-framework.md; registered as the ``accelerate`` layout, entry-point group ``unickpt.layouts``).

``save_state`` stores ``models.<i>.<param>``, ``optimizers.<i>.state.<param>.<key>`` and
``optimizers.<i>.param_groups`` (the fqn-keyed ``get_optimizer_state_dict`` layout), ``schedulers.<i>``,
``scaler`` (fp16), ``dataloaders.<i>`` (its ``iteration`` is the epoch counter) and Accelerate's own
entries (``accelerate``, ``rng``, ``custom``, ``dataloader_states``), which stay behind. The core's
generic layout reads the models, optimizers, schedulers and scaler; this one adds the epoch and finds
the checkpoint inside an Accelerate folder (``<folder>/unickpt/step_<K>``).
"""
from __future__ import annotations


from unickpt import CheckpointMetadata, ext, interop

__all__ = ["AccelerateLayout", "LAYOUT"]


class AccelerateLayout(interop.Layout):
    """The ``accelerate`` layout (see the module docstring)."""

    framework = "accelerate"

    def source(self, meta: CheckpointMetadata) -> interop.SourceNames:
        out = super().source(meta)
        _, _, objects = ext.StateTools.saved_leaves(meta.state_tree)
        loader = objects.get("dataloaders.0")
        if isinstance(loader, dict) and isinstance(loader.get("iteration"), int):
            out.plain["epoch"] = loader["iteration"]
        return out


LAYOUT = AccelerateLayout()
