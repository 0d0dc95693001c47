"""unickpt plugin for DeepSpeed: a ``"unickpt"`` block in the DeepSpeed JSON config selects unickpt.

::

    "unickpt": {"enabled": true, "async_save": true}

With the block, ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (and every framework that calls
them: Accelerate, Lightning's DeepSpeedStrategy, the Hugging Face Trainer) save and load unickpt
checkpoints: ZeRO stages 0-3, fp32 and bf16, with the optimizer partitions stored as flat-range shards of
the original parameters, so a checkpoint loads on a different data-parallel size (or ZeRO stage) without
DeepSpeed's offline ``ds_to_universal`` conversion. Without the block DeepSpeed is unchanged.

Activation needs no code: unickpt's startup hook calls :func:`unickpt.deepspeed._activate.install` after
``import deepspeed`` (``UNICKPT_DEEPSPEED=0`` turns this off). Modules: :mod:`._activate` (the patch),
:mod:`.config` (the JSON block), :mod:`.checkpoint_engine` (the checkpoint engine, async commit),
:mod:`.zero_state` (ZeRO partitions -> flat-range shards), :mod:`.checkpoint` (save / load). See
``docs/deepspeed.md``.
"""
from __future__ import annotations

from unickpt.ext import lazy_getattr

__all__ = ["install", "UnickptConfig", "UnickptCheckpointEngine", "save_checkpoint", "load_checkpoint"]

_LAZY = {
    "install": "._activate",
    "UnickptConfig": ".config",
    "UnickptCheckpointEngine": ".checkpoint_engine",
    "save_checkpoint": ".checkpoint",
    "load_checkpoint": ".checkpoint",
}
__getattr__ = lazy_getattr(__name__, _LAZY)
