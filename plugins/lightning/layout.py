"""How Lightning's sharded-route checkpoints name training state, for loads into another framework
(docs/cross-framework.md; registered as the ``lightning`` layout, entry-point group ``unickpt.layouts``).

The sharded route (``ModelParallelStrategy``, ``FSDPStrategy(state_dict_type="sharded")``) stores
``state_dict.<param>``, ``optimizer_<i>.state.<param>.<key>`` and ``optimizer_<i>.param_groups`` (the
fqn-keyed layout, read by the core's generic layout) and the rest of Lightning's checkpoint dict as one
plain value ``lightning`` (``global_step``, ``epoch``, ``loops``, ``lr_schedulers``, callbacks,
hyper-parameters). Here: the training step, the epochs completed and the LR scheduler from it, and
the checkpoint behind a pointer file ``P`` (``P.unickpt/step_<v>``). Full-dict checkpoints (``.ckpt``
packs of DDP / single-device runs) key their optimizer state by parameter index and are refused.
Imports no Lightning.
"""
from __future__ import annotations

import json
import posixpath
from typing import Any

from unickpt import StateMismatchError, ext

__all__ = ["LightningLayout", "LAYOUT", "WRAPPERS", "locate"]

WRAPPERS = ("_forward_module",)
"""Lightning Fabric's wrapper module (``_FabricModule._forward_module``), dropped from parameter names."""


class LightningLayout(ext.Layout):
    """The ``lightning`` layout (see the module docstring)."""

    framework = "lightning"

    def source(self, meta: Any) -> ext.SourceNames:
        route = (meta.extra or {}).get("lightning_route")
        if route != "sharded":
            raise StateMismatchError(f"a Lightning full-dict checkpoint (route {route!r}: DDP / single device) keys its "
                                     "optimizer state by parameter index, which names no parameter; it loads only into "
                                     "Lightning. Use a sharded strategy (ModelParallelStrategy, FSDPStrategy sharded) to "
                                     "move runs between frameworks")
        out = ext.SourceNames()
        out_generic = super().source(meta)
        out.tensors, out.plain = out_generic.tensors, out_generic.plain
        _, _, objects = ext.saved_leaves(meta.state_tree)
        tree = ext.decode(objects.get("lightning"), key="lightning") if "lightning" in objects else {}
        if isinstance(tree, dict):
            if isinstance(tree.get("global_step"), int):
                out.plain["step"] = tree["global_step"]
            epochs = _epochs_done(tree)
            if epochs is not None:
                out.plain["epoch"] = epochs
            scheds = ext.decode(tree.get("lr_schedulers"), key="lightning.lr_schedulers")
            if isinstance(scheds, list) and len(scheds) > 1:
                raise StateMismatchError(f"the Lightning checkpoint holds {len(scheds)} LR schedulers; a cross-framework "
                                         "load moves one")
            if isinstance(scheds, list) and scheds:
                out.plain["scheduler"] = scheds[0]
        out.private = [f for f in out_generic.private if f != "lightning"] + [
            "lightning (loops, callbacks, hyper-parameters)"]
        return out


def locate(path: str, storage: Any) -> str | None:
    """The checkpoint a Lightning pointer file ``path`` names (the one holding its tensors, for a link), or None
    (entry-point group ``unickpt.locators``)."""
    try:
        if not storage.exists(path) or storage.isdir(path) or storage.size(path) > 1 << 16:
            return None  # a pack (a whole checkpoint in one file) or no file at all
        raw = storage.read_bytes(path)
    except (OSError, ValueError):
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != "unickpt-lightning":
        return None
    rel = doc.get("tensors_from") or doc.get("checkpoint")
    parent = posixpath.dirname(path.rstrip("/"))
    return rel if not parent or "://" in rel or rel.startswith("/") else f"{parent}/{rel}"


def _epochs_done(tree: dict) -> int | None:
    """Epochs completed at the save (a save after an epoch's last batch counts that epoch: ``is_last_batch``)."""
    try:
        fit = tree["loops"]["fit_loop"]
        total = fit["epoch_progress"]["total"]
        ended = bool(fit["epoch_loop.batch_progress"]["is_last_batch"])
        return int(total["started"] if ended else total["completed"])
    except (KeyError, TypeError):
        return tree.get("epoch") if isinstance(tree.get("epoch"), int) else None


LAYOUT = LightningLayout()
