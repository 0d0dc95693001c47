"""How Lightning's sharded-route checkpoints name training state, for loads into another framework
(docs/cross-framework.md; registered as the ``lightning`` layout, entry-point group ``unickpt.layouts``).

The sharded route (``ModelParallelStrategy``, ``FSDPStrategy(state_dict_type="sharded")``) stores
``state_dict.<param>``, ``optimizer_<i>.state.<param>.<key>`` and ``optimizer_<i>.param_groups`` (the
fqn-keyed layout, read by the core's generic layout) and the rest of Lightning's checkpoint dict as one
plain value ``lightning`` (``global_step``, ``epoch``, ``loops``, ``lr_schedulers``, callbacks,
hyper-parameters). Here: the training step, the epochs completed and the LR scheduler from it, and
the checkpoint behind a checkpoint path ``P`` (``P/step_<v>``, named by ``P/unickpt-lightning.json``; earlier
releases: the pointer file ``P`` naming ``P.unickpt/step_<v>``). Full-dict checkpoints (``.ckpt``
packs of DDP / single-device runs) key their optimizer state by parameter index and are refused.
Imports no Lightning.
"""
from __future__ import annotations

import json
import posixpath
from typing import Any

from unickpt import StateMismatchError, ext, interop

from ._pointers import POINTER_NAME
from ._pack import is_pack

__all__ = ["LightningLayout", "LAYOUT", "WRAPPERS", "locate"]

WRAPPERS = ("_forward_module",)
"""Lightning Fabric's wrapper module (``_FabricModule._forward_module``), dropped from parameter names."""


class LightningLayout(interop.Layout):
    """The ``lightning`` layout (see the module docstring)."""

    framework = "lightning"

    def source(self, meta: Any) -> interop.SourceNames:
        route = (meta.extra or {}).get("lightning_route")
        if route != "sharded":
            raise StateMismatchError(_full_dict(route))
        out = interop.SourceNames()
        out_generic = super().source(meta)
        out.tensors, out.plain = out_generic.tensors, out_generic.plain
        _, _, objects = ext.StateTools.saved_leaves(meta.state_tree)
        tree = ext.Codec.decode(objects.get("lightning"), key="lightning") if "lightning" in objects else {}
        if isinstance(tree, dict):
            if isinstance(tree.get("global_step"), int):
                out.plain["step"] = tree["global_step"]
            epochs = _epochs_done(tree)
            if epochs is not None:
                out.plain["epoch"] = epochs
            scheds = ext.Codec.decode(tree.get("lr_schedulers"), key="lightning.lr_schedulers")
            if isinstance(scheds, list) and len(scheds) > 1:
                raise StateMismatchError(f"the Lightning checkpoint holds {len(scheds)} LR schedulers; a cross-framework "
                                         "load moves one")
            if isinstance(scheds, list) and scheds:
                out.plain["scheduler"] = scheds[0]
        out.private = [f for f in out_generic.private if f != "lightning"] + [
            "lightning (loops, callbacks, hyper-parameters)"]
        return out


def _full_dict(route: Any) -> str:
    return (f"a Lightning full-dict checkpoint (route {route!r}: DDP / single device) keys its optimizer state by "
            "parameter index, which names no parameter; it loads only into Lightning. Use a sharded strategy "
            "(ModelParallelStrategy, FSDPStrategy sharded) to move runs between frameworks")


def locate(path: str, storage: ext.StorageBackend) -> str | None:
    """The checkpoint a Lightning pointer file ``path`` names (the one holding its tensors, for a link), or None
    (entry-point group ``unickpt.locators``). Raises StateMismatchError for a pack (a full-dict ``.ckpt`` of a
    DDP / single-device run: see :meth:`LightningLayout.source`)."""
    file = path
    try:
        if storage.isdir(path):  # a sharded-route checkpoint: the directory P, its pointer inside
            file = f"{path.rstrip('/')}/{POINTER_NAME}"
        if not storage.exists(file) or storage.isdir(file):
            return None
        size = storage.size(file)
        head = bytearray(min(size, 64))
        storage.read_into(file, [(0, len(head))], memoryview(head), 0)
    except (OSError, ValueError, EOFError):
        return None
    if is_pack(bytes(head)):
        raise StateMismatchError(f"{path!r}: " + _full_dict("io"))
    try:
        if size > 1 << 16:
            return None  # a file of another format
        raw = storage.read_bytes(file)
    except (OSError, ValueError):
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != "unickpt-lightning":
        return None
    rel = doc.get("tensors_from") or doc.get("checkpoint")
    if not isinstance(rel, str):
        return None  # a damaged pointer: like an unreadable one above
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
