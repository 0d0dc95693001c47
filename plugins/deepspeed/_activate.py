"""Patch DeepSpeed so that a ``"unickpt"`` block in its JSON config selects unickpt (run at import).

DeepSpeed has no registry for third-party checkpoint engines: ``DeepSpeedEngine._configure_checkpointing``
calls ``create_checkpoint_engine``, a name imported into ``deepspeed.runtime.engine`` (deepspeed 0.19.8,
``runtime/engine.py:118`` and ``:1902``). :func:`install` replaces that name with a wrapper that returns a
:class:`~unickpt.deepspeed.checkpoint_engine.UnickptCheckpointEngine` when the engine's config has
``"unickpt": {"enabled": true, ...}`` and otherwise calls DeepSpeed's own factory unchanged. It also wraps
``DeepSpeedEngine.save_checkpoint`` / ``load_checkpoint``: engines whose checkpoint engine is unickpt's
take unickpt's path (:mod:`unickpt.deepspeed.checkpoint`), every other engine runs DeepSpeed's original
method with the same arguments. ``DeepSpeedEngine.step`` is wrapped too: after an optimizer step of an
engine whose block sets ``memory_every`` / ``persist_every``, the checkpoint tiers' schedule runs. And
``DeepSpeedEngine._configure_checkpointing`` (called by the engine's ``__init__`` right after the optimizer
is built): an engine that got unickpt's checkpoint engine is checked there
(:func:`~unickpt.deepspeed.checkpoint.check_supported`), so ``deepspeed.initialize`` refuses what
``save_checkpoint`` would refuse after training.

The unickpt startup hook (:mod:`unickpt._startup`, through this package's ``unickpt.startup`` entry point)
calls :func:`startup` right after ``import deepspeed`` in every interpreter; it installs unless
``UNICKPT_DEEPSPEED=0``. It is cheap: nothing beyond the already imported
``deepspeed.runtime.engine`` is imported until an engine with the block is created.
"""
from __future__ import annotations

import functools
from typing import Any

__all__ = ["install", "installed", "startup"]

_MARK = "__unickpt_wrapped__"


def installed() -> bool:
    """True once :func:`install` has patched DeepSpeed in this process."""
    import sys

    mod = sys.modules.get("deepspeed.runtime.engine")
    return mod is not None and getattr(mod.create_checkpoint_engine, _MARK, False)


def startup() -> None:
    """The startup hook's call (right after ``import deepspeed``): :func:`install` unless
    ``UNICKPT_DEEPSPEED`` is set to a false value (default on)."""
    from unickpt.ext import flag

    if flag("UNICKPT_DEEPSPEED", True):
        install()


def install() -> None:
    """Patch DeepSpeed's checkpoint-engine factory and engine save/load methods (idempotent).

    Must run before ``deepspeed.initialize()`` creates the engine (the factory is called there).
    Raises ImportError if deepspeed is not installed.
    """
    import deepspeed.runtime.engine as ds_engine

    if getattr(ds_engine.create_checkpoint_engine, _MARK, False):
        return
    original_factory = ds_engine.create_checkpoint_engine

    @functools.wraps(original_factory)
    def create_checkpoint_engine(config_params: Any, groups: Any, zero_stage: int, has_moe_layers: bool,
                                 optimize_dp_state: bool) -> Any:
        block = _unickpt_block(config_params)
        if block is not None:
            from .config import UnickptConfig

            cfg = UnickptConfig.from_block(block)
            if cfg.enabled:
                from .checkpoint_engine import UnickptCheckpointEngine

                return UnickptCheckpointEngine(config_params, cfg, has_moe_layers=has_moe_layers)
        return original_factory(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state)

    setattr(create_checkpoint_engine, _MARK, True)
    cls = ds_engine.DeepSpeedEngine
    cls.save_checkpoint = _dispatch(cls.save_checkpoint, "save_checkpoint")
    cls.load_checkpoint = _dispatch(cls.load_checkpoint, "load_checkpoint")
    cls.step = _with_tiers(cls.step)
    cls._configure_checkpointing = _checked_at_init(cls._configure_checkpointing)
    from .tools import install as install_tools  # zero_to_fp32 / ds_to_universal read unickpt checkpoints

    install_tools()
    ds_engine.create_checkpoint_engine = create_checkpoint_engine  # last: marks the install as complete


def _unickpt_block(config_params: Any) -> Any:
    """The raw ``"unickpt"`` value of a DeepSpeedConfig, or None (no config, or no block)."""
    if config_params is None:
        return None
    raw = getattr(config_params, "_param_dict", None)
    if not isinstance(raw, dict):
        return None
    if "unickpt" not in raw:  # DeepSpeed ignores unknown top-level keys: say so for a near miss ("unickp")
        import difflib
        import logging

        for key in difflib.get_close_matches("unickpt", [k for k in raw if isinstance(k, str)], n=1, cutoff=0.8):
            logging.getLogger("unickpt.deepspeed").warning(
                'DeepSpeed config: top-level key %r is not "unickpt"; DeepSpeed ignores it and saves its own '
                "checkpoints", key)
    return raw.get("unickpt")


def _with_tiers(original: Any) -> Any:
    """``DeepSpeedEngine.step``, then, after an optimizer step (``global_steps`` moved) of an engine
    whose ``"unickpt"`` block has ``memory_every`` / ``persist_every``, the tier schedule
    (:meth:`~unickpt.deepspeed.checkpoint_engine.UnickptCheckpointEngine.on_step`)."""
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        ckpt = getattr(self, "checkpoint_engine", None)
        if ckpt is None or not (getattr(ckpt, "is_unickpt", False) and ckpt.config.tiers_enabled):
            return original(self, *args, **kwargs)
        before = self.global_steps
        out = original(self, *args, **kwargs)
        if self.global_steps != before:
            from .checkpoint import memory_state

            ckpt.on_step(self, lambda: memory_state(self, ckpt))
        return out

    setattr(step, _MARK, True)
    setattr(step, "__unickpt_original__", original)
    return step


def _checked_at_init(original: Any) -> Any:
    """``DeepSpeedEngine._configure_checkpointing``, then, for an engine that got unickpt's checkpoint
    engine, :func:`~unickpt.deepspeed.checkpoint.check_supported` (raises NotImplementedError out of
    ``deepspeed.initialize``)."""
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def configure(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if getattr(getattr(self, "checkpoint_engine", None), "is_unickpt", False):
            from .checkpoint import check_supported

            check_supported(self)
        return out

    setattr(configure, _MARK, True)
    setattr(configure, "__unickpt_original__", original)
    return configure


def _dispatch(original: Any, name: str) -> Any:
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        from_unickpt = getattr(getattr(self, "checkpoint_engine", None), "is_unickpt", False)
        if not from_unickpt:
            if name == "load_checkpoint":
                from .checkpoint import refuse_unickpt_tag

                refuse_unickpt_tag(*args, **kwargs)
            return original(self, *args, **kwargs)
        from . import checkpoint

        return getattr(checkpoint, name)(self, *args, **kwargs)

    setattr(method, _MARK, True)
    setattr(method, "__unickpt_original__", original)
    return method
