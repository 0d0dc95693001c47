"""Cross-framework interop: what a framework plugin implements so that unickpt reads, loads and converts
its checkpoints, and the one registry that finds the installed plugins.

A plugin implements (each registered under an entry-point group, :mod:`unickpt.interop.entry_points`):

- a :class:`Layout` (``unickpt.layouts``, by the ``framework`` name its saves record): how the
  framework names training state by role. Call order, on every rank of a load through a mapping
  (:func:`unickpt.load` with ``mapping=``): :meth:`Layout.source` on the stored checkpoint's metadata
  (the layout of the framework that wrote it), :meth:`Layout.target` on the state to load into (the
  mapping's target layout, the generic one by default); :func:`~unickpt.interop.view.build_view` then
  matches the two. Both are pure (no I/O, no collective) and raise StateMismatchError for a state
  they cannot read. Wrapper components (``unickpt.wrappers``) and locators (``unickpt.locators``,
  :func:`locate_checkpoint`) are groups of their own, so that finding a checkpoint imports no layout;
- a :class:`Source` (``unickpt.sources``) for ``unickpt import``: ``detect(src)``, then ``read(src, tag)``
  (see :mod:`unickpt.interop.sources`, which also holds the readers of safetensors, ``torch.save``,
  Hugging Face folders and DCP directories that sources build on);
- a :class:`Conversion` (``unickpt.conversions``) for ``--to``: ``run`` returns an :class:`ExportPlan` or
  an :class:`ImportPlan` (see :mod:`unickpt.interop.conversion`).

Plugins import these names from this package (and :mod:`unickpt.ext` for what they use of the engine).
Names are imported lazily (importing this package imports no torch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

_EXPORTS = {
    "PARAM": ".layouts", "MASTER": ".layouts", "CANONICAL": ".layouts", "SourceNames": ".layouts",
    "TargetNames": ".layouts", "Layout": ".layouts", "registered_layouts": ".layouts", "source_layout": ".layouts",
    "SUBDIR": ".locate", "locate_checkpoint": ".locate",
    "View": ".view", "build_view": ".view", "StoredParams": ".view",
    "Source": ".sources", "torch_load": ".sources", "load_safetensors": ".sources", "read_dcp": ".sources",
    "read_hf": ".sources",
    "Conversion": ".conversion", "ExportPlan": ".conversion", "ImportPlan": ".conversion",
    "StoredCheckpoint": ".conversion", "ExportRun": ".conversion", "ImportRun": ".conversion",
    "get_conversion": ".conversion", "materialize": ".conversion", "box_of": ".conversion",
    "dict_resolver": ".conversion",
    "Resolved": "..plan.mapping", "Piece": "..plan.mapping", "Rule": "..plan.mapping",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)

if TYPE_CHECKING:  # static analysers see the eager imports
    from ..plan.mapping import Piece, Resolved, Rule
    from .conversion import (Conversion, ExportPlan, ExportRun, ImportPlan, ImportRun, StoredCheckpoint, box_of,
                             dict_resolver, get_conversion, materialize)
    from .layouts import (CANONICAL, MASTER, PARAM, Layout, SourceNames, TargetNames, registered_layouts,
                          source_layout)
    from .locate import SUBDIR, locate_checkpoint
    from .sources import Source, load_safetensors, read_dcp, read_hf, torch_load
    from .view import StoredParams, View, build_view
