"""The wrapper components PyTorch inserts into parameter names, dropped by cross-framework loads
(docs/cross-framework.md; entry-point group ``unickpt.wrappers``).

``module`` first (``DistributedDataParallel``), and anywhere: ``_orig_mod`` (``torch.compile``),
``_fsdp_wrapped_module`` (FSDP1 units), ``_checkpoint_wrapped_module`` (activation checkpointing).
``get_model_state_dict`` already drops them; a checkpoint of ``model.state_dict()`` of a wrapped model
keeps them.
"""
from __future__ import annotations

__all__ = ["WRAPPERS"]

WRAPPERS = ("^module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""``^`` marks a component dropped only when it comes first."""
