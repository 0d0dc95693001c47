"""unickpt plugin for Hugging Face Accelerate: ``accelerator.save_state`` / ``load_state`` through unickpt.

Everything ``save_state`` saves (models, optimizers, schedulers, dataloader sampler state, the gradient
scaler, per-process RNG state, ``register_for_checkpointing`` objects, ``accelerator.step``) becomes
one collective unickpt checkpoint in ``<output_dir>/unickpt/``, saved asynchronously and committed
atomically; ``load_state`` loads it in place on any number of processes (models and optimizers
reshard; see :data:`unickpt.accelerate.RNG_RESHARD` for RNG state). ``total_limit`` rotation runs
after the new checkpoint commits. Activate it with code::

    import unickpt.accelerate
    unickpt.accelerate.enable(accelerator)            # or enable() for every accelerator

or with no code change: ``UNICKPT_ACCELERATE=1 accelerate launch train.py``. See docs/accelerate.md.
"""
from __future__ import annotations

from typing import Any

from ._options import RNG_RESHARD, Options, options_from_env

__all__ = ["enable", "disable", "is_enabled", "wait", "Options", "RNG_RESHARD", "options_from_env"]


def enable(accelerator: Any = None, **options: Any) -> Options:
    """Route ``save_state`` / ``load_state`` through unickpt.

    Args:
        accelerator: the ``accelerate.Accelerator`` to switch (None: every accelerator of this
            process, present and future). DeepSpeed, Megatron-LM and XLA accelerators keep
            Accelerate's own path.
        **options: fields of :class:`Options` (``async_save=True``, ``rng_reshard="error"``,
            ``allow_pickle=False``, ``on_error="raise"``); options not given take their defaults (not
            the environment's).

    Returns the options in force. Raises ValueError for an unknown option or a bad value.
    Calling it again replaces the options.
    """
    from ._patch import enable as _enable

    return _enable(accelerator, Options().updated(**options))


def disable(accelerator: Any = None) -> None:
    """Back to Accelerate's own checkpointing (after waiting for pending saves); see :func:`enable`."""
    from ._patch import disable as _disable

    _disable(accelerator)


def is_enabled(accelerator: Any = None) -> bool:
    """Whether ``accelerator`` (None: every accelerator) saves and loads through unickpt."""
    from ._patch import is_enabled as _is_enabled

    return _is_enabled(accelerator)


def wait() -> None:
    """Block until the pending asynchronous save has committed; if it failed, raise
    :class:`unickpt.EarlierSaveFailedError` naming it (once; ``on_error="warn"``: warn). ``save_state``,
    ``load_state``, ``end_training()`` and interpreter exit already do this."""
    from ._patch import wait as _wait

    _wait()
