"""unickpt plugin for the Hugging Face ``transformers.Trainer``: its checkpoints saved and resumed through unickpt.

Trainer writes ``<output_dir>/checkpoint-<step>/`` itself, synchronously, on one process. With this
plugin the same folder is one collective unickpt checkpoint, saved asynchronously (the call returns once
the state is staged; overlap snapshots let the next forward/backward run while it is copied), with the
model weights as real Hugging Face safetensors files written by the engine (``model.safetensors``, or
one ``model-0000k-of-0000n.safetensors`` per process + ``model.safetensors.index.json``: every process
writes its share, replicas once) and the optimizer state in unickpt's files beside them, resharded on
resume to any number of processes. Trainer's small files (``config.json``, ``trainer_state.json``,
``scheduler.pt``, ``rng_state*.pth``, ``training_args.bin``) are Trainer's own, written as before, so
``from_pretrained("out/checkpoint-N")``, ``get_last_checkpoint`` and ``save_total_limit`` work as
before. Switch it on with no code change (``UNICKPT_TRANSFORMERS=1``) or one line::

    import unickpt.transformers
    unickpt.transformers.enable(trainer)      # or enable() for every Trainer of this process

See docs/transformers.md (what is supported: one process and DDP; FSDP, DeepSpeed, XLA and PEFT
adapters keep Trainer's own path).
"""
from __future__ import annotations

from typing import Any

from ._options import Options, options_from_env

__all__ = ["enable", "disable", "is_enabled", "wait", "Options", "options_from_env", "OPTIMIZER_POINTER"]

OPTIMIZER_POINTER = "unickpt_optimizer_state"
"""The one key of the small ``optimizer.pt`` this plugin writes (its value says where the state is)."""


def enable(trainer: Any = None, **options: Any) -> Options:
    """Save and resume ``trainer``'s checkpoints (None: every Trainer of this process) through unickpt.

    ``**options``: fields of :class:`Options` (``async_save``, ``snapshot``); the rest take their
    defaults. Returns the options in force; raises ValueError for an unknown option or a bad value."""
    from ._patch import enable as _enable

    return _enable(trainer, Options().updated(**options))


def disable(trainer: Any = None) -> None:
    """Back to Trainer's own checkpoints for ``trainer`` (None: every Trainer), after pending saves."""
    from ._patch import disable as _disable

    _disable(trainer)


def is_enabled(trainer: Any = None) -> bool:
    """Whether ``trainer`` (None: every Trainer) saves its checkpoints through unickpt."""
    from ._patch import is_enabled as _is_enabled

    return _is_enabled(trainer)


def wait() -> None:
    """Block until this process's pending checkpoint saves have committed; raise
    :class:`unickpt.EarlierSaveFailedError` naming a failed one. ``Trainer.train()`` returning, a resume,
    ``save_total_limit`` rotation and interpreter exit already wait."""
    from ._patch import wait as _wait

    _wait()
