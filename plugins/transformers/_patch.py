"""The patch: ``Trainer``'s checkpoint save and resume routed through unickpt.

Which thread does what: everything here runs on the training loop's thread of every process; the
engine's background threads write the files and commit (:mod:`unickpt.saving`).

- ``Trainer._save_checkpoint`` (every process, collective): one unickpt save into
  ``checkpoint-<step>/`` of ``{"model": the unwrapped model, "optimizer": the torch optimizer}``
  (without the optimizer under ``save_only_model``) with ``SaveOptions(safetensors="model.")``, so the
  weights are Hugging Face safetensors files written by every process (:mod:`unickpt.format.hf_shards`).
  Costs the engine's save collectives (a plan agreement; 2-3 more in the background commit). Then
  Trainer's own small files, written as Trainer writes them (``config.json``, generation config,
  processing class, ``training_args.bin``, ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``,
  ``trainer_state.json``), an ``optimizer.pt`` that names where the optimizer state is, and
  ``save_total_limit`` rotation, which first waits for the saves of other folders (their files
  change the folders' mtimes, which rotation sorts by).
- ``_load_from_checkpoint`` / ``_load_rng_state`` / ``_load_best_model``: wait for this process's
  saves in flight, then Trainer's own code (the weights are real safetensors files).
- ``_load_optimizer_and_scheduler``: for a unickpt checkpoint, the optimizer state is loaded by
  ``unickpt.load`` (resharded to this run's processes), the scheduler by Trainer's ``torch.load``.
- ``train``: waits for the pending saves before it returns (what Trainer's callers see: the
  checkpoints of the run are complete), as does interpreter exit (:mod:`unickpt.teardown`).

Trainers under DeepSpeed, FSDP, XLA or SageMaker model parallelism, PEFT models (adapter-only
checkpoints) and ``save_on_each_node`` (a full copy per node, no shared storage) keep Trainer's own
methods.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from unickpt import ext

from ._options import Options

__all__ = ["enable", "disable", "is_enabled", "wait", "patch_trainer", "is_unickpt_checkpoint"]

log = logging.getLogger("unickpt.transformers")
FRAMEWORK = "transformers"
GROUP = "model."  # the fqn prefix of the weights: their safetensors names are the model's state dict keys

_lock = threading.Lock()
_global: Options | None = None
_scoped: "weakref.WeakKeyDictionary[Any, Options | None]" = weakref.WeakKeyDictionary()
_tracked: list[tuple[Any, str]] = []  # (SaveHandle, checkpoint folder) of saves not waited for yet


def _supported(trainer: Any) -> bool:
    from transformers.trainer import _is_peft_model, is_sagemaker_mp_enabled, is_torch_xla_available

    return not (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or is_torch_xla_available()
                or is_sagemaker_mp_enabled() or _is_peft_model(trainer.model) or trainer.args.save_on_each_node)


def options_for(trainer: Any) -> Options | None:
    """The options unickpt uses for ``trainer``, or None where Trainer's own path is used."""
    opts = _scoped.get(trainer, _global)
    return opts if opts is not None and _supported(trainer) else None


def is_enabled(trainer: Any = None) -> bool:
    """See :func:`unickpt.transformers.is_enabled`."""
    return _global is not None if trainer is None else options_for(trainer) is not None


def enable(trainer: Any = None, options: Options | None = None) -> Options:
    """See :func:`unickpt.transformers.enable`."""
    global _global
    patch_trainer()
    opts = (options or Options()).validated()
    with _lock:
        if trainer is None:
            _global = opts
        else:
            _scoped[trainer] = opts
    return opts


def disable(trainer: Any = None) -> None:
    """See :func:`unickpt.transformers.disable`."""
    global _global
    wait()
    with _lock:
        if trainer is None:
            _global = None
        else:
            _scoped[trainer] = None


def wait() -> None:
    """See :func:`unickpt.transformers.wait`."""
    with _lock:
        _tracked[:] = [(h, f) for h, f in _tracked if not h.done()]
    engine = ext.EngineHandle.existing()
    if engine is not None:
        engine.wait()


def _wait_under(path: str, but: str | None = None) -> None:
    """Block until no save of this process writes into ``path`` or a folder inside it (``but``: except
    the save into that folder). Errors are the save's, raised by the next :func:`wait` or save."""
    path = os.path.abspath(path)
    with _lock:
        busy = [h for h, f in _tracked if not h.done() and f != but and (f == path or f.startswith(path + os.sep))]
    for handle in busy:
        while not handle.done():
            time.sleep(0.005)


def is_unickpt_checkpoint(folder: str) -> bool:
    """Whether ``folder`` (a ``checkpoint-N``) is a committed unickpt checkpoint written by this plugin."""
    root = ext.CheckpointDir(ext.open_storage(folder), folder)
    try:
        return root.read_extra().get("transformers") is not None
    except Exception:
        return False


# -- save ---------------------------------------------------------------------------------------------
def _inner_optimizer(trainer: Any) -> torch.optim.Optimizer:
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def _unwrapped(trainer: Any) -> torch.nn.Module:
    return trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)


def _write_model_files(trainer: Any, output_dir: str, model: torch.nn.Module) -> None:
    """What ``Trainer._save`` writes besides the weights (process ``should_save`` only)."""
    from transformers.trainer import TRAINING_ARGS_NAME

    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(output_dir)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(output_dir)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(output_dir)
    elif getattr(trainer.data_collator, "tokenizer", None) is not None:
        trainer.data_collator.tokenizer.save_pretrained(output_dir)
    torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


def _save_checkpoint(trainer: Any, opts: Options, model: Any, trial: Any) -> None:
    from transformers.trainer import (OPTIMIZER_NAME, PREFIX_CHECKPOINT_DIR, SCHEDULER_NAME, TRAINER_STATE_NAME,
                                      ExportableState, ParallelMode, SaveStrategy)
    import transformers.trainer as trainer_module

    args = trainer.args
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = trainer._get_output_dir(trial=trial)
    output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    _wait_under(output_dir)  # an earlier save into this very folder
    engine = ext.engine()
    if engine.rank == 0 and os.path.isdir(output_dir):  # Trainer overwrites a folder of an earlier run
        shutil.rmtree(output_dir)
    module = _unwrapped(trainer)
    state: dict[str, Any] = {"model": module}
    if not args.save_only_model:
        state["optimizer"] = _inner_optimizer(trainer)
    handle = engine.save(output_dir, state, async_save=opts.async_save, step=int(trainer.state.global_step),
                         framework=FRAMEWORK, options=engine.options.with_(safetensors=GROUP, snapshot=opts.snapshot),
                         extra={"transformers": {"global_step": int(trainer.state.global_step),
                                                 "world_size": engine.world_size,
                                                 "optimizer": not args.save_only_model}})
    if opts.async_save:
        with _lock:
            _tracked.append((handle, os.path.abspath(output_dir)))
    handle.wait_planned()  # the folder is the save's (made, claimed) before Trainer's files go into it
    if args.should_save:
        _write_model_files(trainer, output_dir, module)

    if args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] and trainer.state.best_global_step:
        if args.parallel_mode == ParallelMode.DISTRIBUTED:
            torch.distributed.barrier()
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.best_global_step}")
        if os.path.exists(best):
            trainer.state.best_model_checkpoint = best

    if not args.save_only_model:
        if args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            trainer_module.reissue_pt_warnings(caught)
            from . import OPTIMIZER_POINTER

            torch.save({OPTIMIZER_POINTER: "the optimizer state of this checkpoint is in its unickpt files "
                                           "(metadata.json); Trainer loads it with unickpt.transformers enabled "
                                           "(UNICKPT_TRANSFORMERS=1), or read it with unickpt.load"},
                       os.path.join(output_dir, OPTIMIZER_NAME))
        trainer._save_scaler(output_dir)
        trainer._save_rng_state(output_dir)

    if args.should_save:
        for cb in [cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(trainer.state.stateful_callbacks[name], list):
                trainer.state.stateful_callbacks[name].append(cb.state())
            else:
                trainer.state.stateful_callbacks[name] = cb.state()
        trainer.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))

    if args.push_to_hub:
        _wait_under(output_dir)
        trainer._push_from_checkpoint(output_dir)

    if args.should_save:
        _wait_under(run_dir, but=os.path.abspath(output_dir))  # rotation sorts by mtime, removes whole folders
        trainer_module.rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                                          best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)


# -- resume -------------------------------------------------------------------------------------------
def _load_optimizer_and_scheduler(trainer: Any, checkpoint: str) -> None:
    from transformers.trainer import SCHEDULER_NAME, check_torch_load_is_safe, reissue_pt_warnings

    _wait_under(checkpoint)
    extra = ext.CheckpointDir(ext.open_storage(checkpoint), checkpoint).read_extra().get("transformers", {})
    if not extra.get("optimizer"):  # save_only_model: as Trainer does without optimizer.pt / scheduler.pt
        log.warning("unickpt.transformers: %s was saved with save_only_model=True: no optimizer or scheduler "
                    "state to resume from; they start afresh", checkpoint)
        return
    # the model comes along (the core names optimizer state by its parameters' fqns): the same bytes
    # Trainer's _load_from_checkpoint has just read from the safetensors files
    ext.engine().load(checkpoint, {"model": _unwrapped(trainer), "optimizer": _inner_optimizer(trainer)})
    with warnings.catch_warnings(record=True) as caught:
        check_torch_load_is_safe()
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
    reissue_pt_warnings(caught)


_originals: dict[str, Any] = {}


def patch_trainer() -> None:
    """Replace Trainer's checkpoint methods on the class (idempotent); the replacements call the
    originals for trainers unickpt is not enabled for."""
    from transformers import Trainer

    with _lock:
        if getattr(Trainer._save_checkpoint, "__unickpt__", False):
            return
        orig = {name: getattr(Trainer, name) for name in ("_save_checkpoint", "_load_optimizer_and_scheduler",
                                                          "_load_from_checkpoint", "_load_rng_state",
                                                          "_load_best_model", "train")}
        _originals.update(orig)

        @functools.wraps(orig["_save_checkpoint"])
        def _save_checkpoint_(self: Any, model: Any, trial: Any) -> None:
            opts = options_for(self)
            if opts is None:
                return orig["_save_checkpoint"](self, model, trial)
            return _save_checkpoint(self, opts, model, trial)

        @functools.wraps(orig["_load_optimizer_and_scheduler"])
        def _load_optimizer_and_scheduler_(self: Any, checkpoint: str | None) -> None:
            if checkpoint is not None and options_for(self) is not None:
                _wait_under(checkpoint)
                if is_unickpt_checkpoint(checkpoint):
                    return _load_optimizer_and_scheduler(self, checkpoint)
            return orig["_load_optimizer_and_scheduler"](self, checkpoint)

        def waiting(name: str) -> Any:
            @functools.wraps(orig[name])
            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                if _tracked:
                    wait()
                return orig[name](self, *args, **kwargs)

            return method

        @functools.wraps(orig["train"])
        def train(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = orig["train"](self, *args, **kwargs)
            if _tracked:
                wait()
            return result

        replaced = {"_save_checkpoint": _save_checkpoint_, "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler_,
                    "_load_from_checkpoint": waiting("_load_from_checkpoint"), "_load_rng_state": waiting("_load_rng_state"),
                    "_load_best_model": waiting("_load_best_model"), "train": train}
        for name, fn in replaced.items():
            fn.__unickpt__ = True
            setattr(Trainer, name, fn)
