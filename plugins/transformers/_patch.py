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
- ``shutil.rmtree`` of a folder a save is still writing waits for that save first (Trainer removes
  the last checkpoint at the end of ``train`` under ``save_total_limit=1``).
- ``train``: waits for the pending saves before it returns (what Trainer's callers see: the
  checkpoints of the run are complete), as does interpreter exit (:mod:`unickpt.teardown`).

Under FSDP2 the same save runs on the DTensor shards: each weight is gathered whole into one process's
safetensors file by the save itself (point to point, in the background), and a resume or the best-model
load reads each process's shards back by byte range (``unickpt.load``: any number of processes), where
Trainer's own loader would look for its FSDP files. Trainers under DeepSpeed keep Trainer's own methods,
and their DeepSpeed engine's checkpoint goes through :mod:`unickpt.deepspeed` (``train`` adds
``"unickpt": {"enabled": true}`` to the DeepSpeed config unless it has a ``"unickpt"`` block). Trainers
under FSDP1, XLA or SageMaker model parallelism, PEFT models (adapter-only checkpoints) and
``save_on_each_node`` (a full copy per node, no shared storage) keep Trainer's own methods and files.
"""
from __future__ import annotations

import functools
import logging
import os
import re
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


def _fsdp2(trainer: Any) -> bool:
    """Whether ``trainer`` runs under FSDP2 (``fully_shard``: DTensor parameters)."""
    return bool(trainer.is_fsdp_enabled) and getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2


def _supported(trainer: Any) -> bool:
    from transformers.trainer import _is_peft_model, is_sagemaker_mp_enabled, is_torch_xla_available

    fsdp1 = trainer.is_fsdp_enabled and not _fsdp2(trainer)
    return not (trainer.is_deepspeed_enabled or fsdp1 or is_torch_xla_available()
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
    engine = ext.EngineHandle.existing()
    if engine is not None:
        engine.wait()


def is_unickpt_checkpoint(folder: str) -> bool:
    """Whether ``folder`` (a ``checkpoint-N``) is a committed unickpt checkpoint written by this plugin and
    not overwritten since by Trainer's own save (which leaves ``metadata.json`` in place but replaces
    ``optimizer.pt``: then Trainer's files are the checkpoint)."""
    return _plugin_extra(folder) is not None


def _plugin_extra(folder: str) -> dict | None:
    """The plugin's record in ``folder``'s ``metadata.json`` (``extra["transformers"]``), or None where
    :func:`is_unickpt_checkpoint` is false."""
    from transformers.trainer import OPTIMIZER_NAME

    from . import OPTIMIZER_POINTER

    root = ext.CheckpointDir(ext.open_storage(folder), folder)
    try:
        extra = root.read_extra().get("transformers")
    except Exception:
        return None
    if not isinstance(extra, dict):
        return None
    pointer = os.path.join(folder, OPTIMIZER_NAME)
    if not os.path.exists(pointer):
        return None if extra.get("optimizer") else extra
    try:
        return extra if OPTIMIZER_POINTER in torch.load(pointer, map_location="cpu", weights_only=True) else None
    except Exception:
        return None


def _unfinished(folder: str) -> bool:
    """A folder a plugin save was writing when its run stopped: a writer record, no commit, and no save
    of this process in flight into it."""
    root = ext.CheckpointDir(ext.open_storage(folder), folder)
    return (os.path.exists(os.path.join(folder, ext.CheckpointDir.WRITER_NAME)) and not root.is_committed()
            and not ext.EngineHandle.watched_pending(folder))


def _check_finished(folder: str) -> None:
    """ValueError naming ``folder`` when it is an unfinished save (Trainer would fail on its partial files)."""
    if _unfinished(folder):
        raise ValueError(f"{folder!r} is an unfinished unickpt save (its run stopped before the save committed: "
                         f"no {ext.CheckpointDir.MARKER_NAME}); resume from an earlier checkpoint")


def _last_finished_checkpoint(get_last_checkpoint: Any) -> Any:
    """``transformers.trainer.get_last_checkpoint`` that passes over unfinished saves (newest first),
    warning about each: ``resume_from_checkpoint=True`` after a crash resumes from the last complete
    checkpoint, as it does with Trainer's own saves (which are complete when they exist)."""
    @functools.wraps(get_last_checkpoint)
    def wrapper(folder: str) -> Any:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        found = get_last_checkpoint(folder)
        if found is None or not _unfinished(found):
            return found
        numbered = sorted((int(m.group(1)), d) for d in os.listdir(folder)
                          if (m := re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", d))
                          and os.path.isdir(os.path.join(folder, d)))
        for _, name in reversed(numbered):
            path = os.path.join(folder, name)
            if _unfinished(path):
                log.warning("unickpt.transformers: %s is an unfinished save (its run stopped while writing it); "
                            "resuming from an earlier checkpoint", path)
                continue
            return path
        return None

    wrapper.__unickpt__ = True  # type: ignore[attr-defined]
    return wrapper


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
    ext.EngineHandle.wait_under(output_dir)  # an earlier save into this very folder
    engine = ext.engine()
    if engine.rank == 0 and os.path.isdir(output_dir):  # Trainer overwrites a folder of an earlier run
        shutil.rmtree(output_dir)
    called = time.time()
    module = _unwrapped(trainer)
    state: dict[str, Any] = {"model": module}
    if not args.save_only_model:
        state["optimizer"] = _inner_optimizer(trainer)
    handle = engine.save(output_dir, state, async_save=opts.async_save, step=int(trainer.state.global_step),
                         framework=FRAMEWORK, options=engine.options.with_(safetensors=GROUP, snapshot=opts.snapshot),
                         extra={"transformers": {"global_step": int(trainer.state.global_step),
                                                 "world_size": engine.world_size,
                                                 "optimizer": not args.save_only_model}},
                         on_commit=lambda: _stamp(output_dir, called))
    if opts.async_save:
        ext.EngineHandle.watch_removal(handle)  # shutil.rmtree of the folder, and this plugin's reads of it, wait for the save
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
        ext.EngineHandle.wait_under(output_dir)
        trainer._push_from_checkpoint(output_dir)

    if args.should_save:
        ext.EngineHandle.wait_under(run_dir, but=output_dir)  # rotation sorts by mtime, removes whole folders
        trainer_module.rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                                          best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)


def _stamp(folder: str, when: float) -> None:
    """Group rank 0's commit thread: give ``folder`` the modification time of its save call. Trainer's
    ``save_total_limit`` rotation sorts checkpoint folders by mtime (``use_mtime=True``); the files the
    background save adds, and its commit, would otherwise make an older folder look newer than one saved
    after it, and rotation would remove the newest checkpoint. Later writes of Trainer's own small files
    (before the next save call) keep the order."""
    try:
        os.utime(folder, (when, when))
    except OSError as e:
        log.warning("unickpt.transformers: could not set the modification time of %s: %s", folder, e)


def _deepspeed_block(trainer: Any, opts: Options) -> None:
    """A Trainer under DeepSpeed: its checkpoints are the DeepSpeed engine's ``save_checkpoint`` /
    ``load_checkpoint`` (``checkpoint-N/global_stepN/``), which :mod:`unickpt.deepspeed` takes over for an
    engine whose config has a ``"unickpt"`` block. Unless the user's config has one, ``{"enabled": true,
    "async_save": <the plugin's async_save>}`` is added to the config the engine is built from (Accelerate's
    ``DeepSpeedPlugin.deepspeed_config``, Trainer's ``hf_deepspeed_config.config``: one dict), before
    ``train`` builds the engine. Trainer still writes the weights itself (``model.safetensors``, gathered).
    ``UNICKPT_DEEPSPEED=0`` (the DeepSpeed plugin turned off) leaves the config as it is."""
    if not ext.flag("UNICKPT_DEEPSPEED", True):
        log.info("unickpt.transformers: UNICKPT_DEEPSPEED=0: this Trainer's DeepSpeed checkpoints stay DeepSpeed's own")
        return
    from unickpt import deepspeed as unickpt_deepspeed

    unickpt_deepspeed.install()  # idempotent; the startup hook did it at ``import deepspeed``
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    if "unickpt" not in config:
        config["unickpt"] = {"enabled": True, "async_save": bool(opts.async_save)}


# -- resume -------------------------------------------------------------------------------------------
def _load_optimizer_and_scheduler(trainer: Any, checkpoint: str, extra: dict) -> None:
    """Resume ``trainer``'s optimizer and scheduler from ``checkpoint`` (``extra``: its plugin record)."""
    from transformers.trainer import SCHEDULER_NAME, check_torch_load_is_safe, reissue_pt_warnings

    if not extra.get("optimizer"):  # save_only_model: as Trainer does without optimizer.pt / scheduler.pt
        log.warning("unickpt.transformers: %s was saved with save_only_model=True: no optimizer or scheduler "
                    "state to resume from; they start afresh", checkpoint)
        return
    # the optimizer state alone, keyed by the model's parameter fqns as it was saved: the weights are
    # Trainer's _load_from_checkpoint's (the safetensors files, or whatever a user put in their place).
    # strict=False lets the stored weights be; every key of the optimizer must be there all the same
    target = {"optimizer": ext.StateTools.optimizer_state(_unwrapped(trainer), _inner_optimizer(trainer))}
    _check_keys(checkpoint, target, "the optimizer state to resume")
    ext.engine().load(checkpoint, target, strict=False)
    with warnings.catch_warnings(record=True) as caught:
        check_torch_load_is_safe()
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
    reissue_pt_warnings(caught)


def _check_keys(checkpoint: str, target: dict, what: str) -> None:
    """StateMismatchError naming the entries of ``target`` that ``checkpoint`` lacks (a load with
    ``strict=False``, which leaves the checkpoint's other entries alone, never skips one of the target's)."""
    from unickpt import StateMismatchError

    meta = ext.CheckpointDir(ext.open_storage(checkpoint), checkpoint).read_metadata()
    tensors, per_rank, objects = ext.StateTools.saved_leaves(meta.state_tree)
    flat = ext.StateTools.flatten(target, for_load=True)
    wanted = set(flat.tensors) | set(flat.objects)
    missing = sorted(wanted - tensors - set(objects) - per_rank)
    if missing:
        raise StateMismatchError(f"{checkpoint!r}: {what} lacks {len(missing)} entries of this run's: "
                                 f"{', '.join(map(repr, missing[:10]))}{' ...' if len(missing) > 10 else ''} "
                                 "(another model or optimizer?)")


def _load_sharded_model(trainer: Any, checkpoint: str, model: Any) -> None:
    """FSDP2: the weights of a plugin checkpoint loaded by ``unickpt.load`` into ``model``'s shards (each process
    reads only the byte ranges of its shards from the safetensors files), where Trainer's own FSDP loader
    (``load_fsdp_model``) looks for its ``pytorch_model_fsdp_0/`` or ``pytorch_model_fsdp.bin``. Collective."""
    target = {"model": trainer.accelerator.unwrap_model(model if model is not None else trainer.model,
                                                        keep_torch_compile=False)}
    _check_keys(checkpoint, target, "the model to load")
    ext.engine().load(checkpoint, target, strict=False)


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
                ext.EngineHandle.wait_under(checkpoint)
                extra = _plugin_extra(checkpoint)
                if extra is not None:
                    return _load_optimizer_and_scheduler(self, checkpoint, extra)
            return orig["_load_optimizer_and_scheduler"](self, checkpoint)

        def waiting(name: str) -> Any:
            @functools.wraps(orig[name])
            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                if ext.EngineHandle.watched_pending():
                    wait()
                enabled = options_for(self) is not None
                if name == "_load_from_checkpoint" and args and isinstance(args[0], str) and enabled:
                    _check_finished(args[0])
                    if _fsdp2(self) and is_unickpt_checkpoint(args[0]):
                        return _load_sharded_model(self, args[0], args[1] if len(args) > 1 else kwargs.get("model"))
                if name == "_load_best_model" and enabled and _fsdp2(self):
                    best = self.state.best_model_checkpoint
                    if best is not None and is_unickpt_checkpoint(best):
                        log.info("unickpt.transformers: loading the best model from %s", best)
                        return _load_sharded_model(self, best, self.model)
                return orig[name](self, *args, **kwargs)

            return method

        @functools.wraps(orig["train"])
        def train(self: Any, *args: Any, **kwargs: Any) -> Any:
            opts = _scoped.get(self, _global)
            if opts is not None and self.is_deepspeed_enabled:
                _deepspeed_block(self, opts)
            result = orig["train"](self, *args, **kwargs)
            if ext.EngineHandle.watched_pending():
                ext.EngineHandle.wait_under(self.args.output_dir)  # DeepSpeed's saves too (their own engine)
                wait()
            return result

        load_from, load_rng, load_best = (waiting("_load_from_checkpoint"), waiting("_load_rng_state"),
                                          waiting("_load_best_model"))
        replaced: tuple[Any, ...] = (_save_checkpoint_, _load_optimizer_and_scheduler_, load_from, load_rng, load_best, train)
        for fn in replaced:
            fn.__unickpt__ = True
        Trainer._save_checkpoint = _save_checkpoint_  # type: ignore[method-assign]
        Trainer._load_optimizer_and_scheduler = _load_optimizer_and_scheduler_  # type: ignore[method-assign]
        Trainer._load_from_checkpoint = load_from  # type: ignore[method-assign]
        Trainer._load_rng_state = load_rng  # type: ignore[method-assign]
        Trainer._load_best_model = load_best  # type: ignore[method-assign]
        Trainer.train = train  # type: ignore[method-assign]
        import transformers.trainer as trainer_module

        trainer_module.get_last_checkpoint = _last_finished_checkpoint(trainer_module.get_last_checkpoint)
