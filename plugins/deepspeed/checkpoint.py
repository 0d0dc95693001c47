"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` for DeepSpeed engines that use unickpt.

:mod:`unickpt.deepspeed._activate` routes the two ``DeepSpeedEngine`` methods here when the engine's
checkpoint engine is :class:`~unickpt.deepspeed.checkpoint_engine.UnickptCheckpointEngine`. Same signatures, same
directory contract as DeepSpeed: ``save_dir/<tag>/`` is the checkpoint (a unickpt checkpoint:
``metadata.json``, ``data/``, ...), ``save_dir/latest`` names the newest tag, written only after that
checkpoint committed. The saved state (fqn prefixes)::

    module.<param or buffer name>            low-precision (bf16) or fp32 model weights: whole tensors
                                             (ZeRO-0/1/2) or ZeRO-3 partitions as flat-range shards
    optimizer.fp32.<param name>              fp32 master weights, flat-range shards (ZeRO partitions)
    optimizer.state.<key>.<param name>       optimizer state shaped like the master weights (exp_avg, ...)
    optimizer.scalars                        per flat partition: the other optimizer state (Adam's step)
    optimizer.param_groups                   hyperparameters of the base optimizer's param groups
    optimizer.wrapper                        fp16 only: the DeepSpeed optimizer wrapper's own state, the
                                             loss scaler, overflow, clip_grad (zero_state.wrapper_state)
    lr_scheduler                             the LR scheduler's state dict
    client_state                             the caller's client_state (tagged JSON)
    deepspeed                                global_steps, global_samples, skipped_steps, layout info

Because every partition is stored in the coordinates of the original parameters, a load reshards: the
checkpoint loads on another data-parallel size (or ZeRO stage) without a conversion step. Pipeline
engines are one more layout: a stage's parameters have global names (``<layer idx>.weight``), a tied
layer is saved by the first stage that holds it, and the checkpoint loads on another number of stages.
Ranks that pass different tags (``checkpoint.tag_validation`` WARN / IGNORE) save and load under group
rank 0's tag.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from unickpt import Shard, StateMismatchError, UnsafeObjectError, ext

from .checkpoint_engine import finish_all_pending, wait_for_tag
from .tools import LATEST_UNIVERSAL, copy_recovery_script, model_record
from .zero_state import ZeroLayout, check_wrapper_state, restore_wrapper_state, wrapper_state, zero_layout

__all__ = ["save_checkpoint", "load_checkpoint", "check_supported", "memory_state", "LATEST_FILE", "FORMAT"]

log = logging.getLogger("unickpt.deepspeed")

LATEST_FILE = ext.CheckpointRoot.LATEST_FILE  # ``save_dir/latest``: the tag of the newest committed checkpoint (DeepSpeed's name)
FORMAT = "unickpt.deepspeed/1"
REPLACING_SUFFIX = ".unickpt-new"  # ``save_dir/.<tag>.unickpt-new``: a save replacing the committed ``<tag>``
REPLACED_SUFFIX = ".unickpt-old"  # ``save_dir/.<tag>.unickpt-old``: the replaced copy, removed after the swap


# -- building the state ---------------------------------------------------------------------------
def _module_state(engine: Any, layout: ZeroLayout, exclude_frozen: bool) -> dict:
    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        if exclude_frozen and not p.requires_grad:
            continue
        if layout.kind == "zero3":
            t, start, numel = layout.lp_shards[name]
            out[name] = Shard(t.view(-1).narrow(0, 0, numel), tuple(p.ds_shape), flat_range=(start, numel))
        else:
            out[name] = p.detach()
    for mod_name, mod in engine.module.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{b_name}" if mod_name else b_name] = b.detach()
    return out


def _state_keys(layout: ZeroLayout) -> tuple[list[str], list[dict]]:
    """Optimizer state keys shaped like the master weights, and the other (scalar) state per partition."""
    keys: list[str] = []
    scalars: list[dict] = []
    for flat in layout.flat:
        st = layout.base.state.get(flat, {})
        other = {}
        for k, v in st.items():
            if torch.is_tensor(v) and v.shape == flat.shape and v.dim() > 0:
                if k not in keys:
                    keys.append(k)
            else:
                other[k] = v
        scalars.append(other)
    return keys, scalars


def _optimizer_state(layout: ZeroLayout, state_keys: list[str], *, with_moments: bool) -> dict:
    def shards(tensors: list[torch.Tensor]) -> dict:
        return {f.name: Shard(layout.view(f, tensors[f.group]), f.shape, flat_range=(f.start, f.numel))
                for f in layout.fragments}

    out: dict[str, Any] = {"fp32": shards(layout.flat)}
    if with_moments:
        out["state"] = {k: shards([layout.base.state[flat][k] for flat in layout.flat]) for k in state_keys}
    return out


def _optimizer_class(opt: Any) -> str:
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def _info(engine: Any, layout: ZeroLayout) -> dict:
    import deepspeed

    return {"format": FORMAT, "optimizer": _optimizer_class(layout.base), "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples), "skipped_steps": int(engine.skipped_steps),
            "zero_stage": int(engine.zero_optimization_stage()),
            "dp_world_size": int(engine.seq_dp_world_size), "mp_world_size": int(engine.mp_world_size),
            "bf16": bool(engine.bfloat16_enabled()), "ds_version": deepspeed.__version__,
            **model_record(engine.module)}  # buffer_names, shared_params: for DeepSpeed's zero_to_fp32 (.tools)


def model_parallel_unsupported_reason(engine: Any) -> str | None:
    """Why unickpt cannot checkpoint this engine's model parallelism, or None (no model-parallel axis).

    Pipeline stages are a layout like any other: ``PipelineModule`` names each stage's parameters by
    global layer index (``<idx>.weight``, ``runtime/pipe/module.py`` ``_build``), unique across stages,
    and tied layers (``tied_modules.<key>.*``) are replicas saved by the first stage that holds them.
    A model-parallel (tensor-parallel) axis is refused: a pipeline topology's ``num_mp``, DeepSpeed's
    AutoTP (``"tensor_parallel": {"autotp_size": N}``) or an ``mpu`` given to ``deepspeed.initialize``
    (``engine.mp_world_size > 1``) give each model-parallel rank a different shard of a parameter under
    one name, with no layout that says where each shard lies in general; saved as one tensor they would
    be taken for replicas.
    """
    if _is_pipeline(engine):
        mp = int(engine.module.mpu().get_slice_parallel_world_size())
        where = "the PipelineModule's topology"
    else:
        mp = int(getattr(engine, "mp_world_size", 1) or 1)
        where = "AutoTP's autotp_size or the mpu given to deepspeed.initialize"
    if mp > 1:
        return (f"unickpt.deepspeed: model (tensor) parallelism is not supported (model-parallel size {mp}, "
                f"from {where}); remove the \"unickpt\" block from the DeepSpeed config")
    return None


def _check_supported(engine: Any) -> None:
    reason = model_parallel_unsupported_reason(engine)
    if reason is not None:
        raise NotImplementedError(reason)
    if engine.zero_nvme_offload_optimizer():
        raise NotImplementedError("unickpt.deepspeed: NVMe optimizer offload is not supported")


def check_supported(engine: Any) -> None:
    """Refuse, while ``deepspeed.initialize`` builds ``engine``, a configuration that ``save_checkpoint``
    would refuse: the same checks, run once the optimizer wrapper exists (right after
    ``DeepSpeedEngine._configure_checkpointing``, ``runtime/engine.py:696``, which follows
    ``_configure_optimizer``; called by :mod:`unickpt.deepspeed._activate`).

    Raises:
        NotImplementedError: what :func:`_check_supported` and :func:`unickpt.deepspeed.zero_state.zero_layout`
            raise (an optimizer wrapper the plugin does not know, no optimizer, NVMe offload, ...); the
            message names it and says to remove the ``"unickpt"`` block.
    """
    _check_supported(engine)
    zero_layout(engine)


# -- save -----------------------------------------------------------------------------------------
def save_checkpoint(engine: Any, save_dir: str, tag: Any = None, client_state: dict | None = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """``DeepSpeedEngine.save_checkpoint`` through unickpt (collective: every rank calls it).

    Writes ``save_dir/<tag>/`` (``tag`` defaults to ``global_step<N>``; group rank 0's when the ranks'
    tags differ, :func:`_agreed_tag`) and, once it has committed, ``save_dir/latest``. With
    ``async_save`` (the default) it returns once the state is copied to host memory; the commit
    follows in the background. Saving to a tag again replaces it (as DeepSpeed does): the call first
    waits for a save to that tag still in flight; on local storage the new checkpoint is written to
    ``save_dir/.<tag>.unickpt-new`` and renamed into place at its commit, so the committed ``<tag>``
    stays loadable until then (on object stores, which have no directory rename, it is deleted first).

    Raises:
        ValueError: empty ``save_dir``.
        NotImplementedError: a model-parallel axis (AutoTP, an mpu, a pipeline topology), NVMe offload, unknown
            optimizer wrappers.
        AssertionError: ``checkpoint.tag_validation`` is ``FAIL`` and the ranks' tags differ (DeepSpeed's).
        SaveFailedError: a synchronous save failed on some rank (names every rank and why); an earlier
            asynchronous save's failure is raised here too.
        UnsafeObjectError: ``client_state`` holds a value only pickle can store and ``allow_pickle`` is off.
    """
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    ckpt = engine.checkpoint_engine
    cfg = ckpt.config
    _check_supported(engine)
    ckpt._reap_done()
    tag = _agreed_tag(engine, str(tag if tag is not None else f"global_step{engine.global_steps}"), "saves")
    # before anything is touched: a client_state that cannot be saved fails the call and changes nothing
    client_enc = _encode_client_state(dict(client_state or {}), cfg.allow_pickle)
    save_dir = os.fspath(save_dir)
    storage = ext.open_storage(save_dir, cfg.storage_options or None)
    path = storage.join(save_dir, tag)
    uengine = ext.engine()
    wait_for_tag(save_dir, tag)  # the same tag twice in a row: the earlier save must finish first
    target = path
    if ext.CheckpointDir(storage, path).is_committed():  # DeepSpeed overwrites an existing tag
        if uengine.rank == 0:
            log.warning("unickpt.deepspeed: replacing the committed checkpoint %s (same tag)", path)
        if storage.is_local:  # save beside it; swapped in at the commit, so a failed save leaves it intact
            target = _sibling(path, REPLACING_SUFFIX)
            if uengine.rank == 0:
                ext.CheckpointDir(storage, target).remove()  # left by a replacement that crashed before its swap
        elif uengine.rank == 0:  # no atomic directory rename on object stores: the old copy goes first
            ext.CheckpointDir(storage, path).remove()  # uncommitted first: never a half-removed loadable copy
        torch.distributed.barrier()

    def on_commit() -> None:  # group rank 0, right after metadata.json landed
        if target != path:
            _swap_in(storage, target, path)
        if save_latest:
            ext.CheckpointRoot(save_dir, storage=storage).write_latest(tag)
        copy_recovery_script(storage, save_dir)  # save_dir/zero_to_fp32.py, as DeepSpeed leaves it

    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    try:  # the epilogue must run whatever fails (ZeRO-3: it gathers the persistent parameters again)
        handle = _save_state(engine, uengine, cfg, target, tag, client_enc, exclude_frozen_parameters, on_commit)
    finally:
        if engine._optimizer_has_ckpt_event_epilogue():
            engine.optimizer.checkpoint_event_epilogue()
    ckpt.last_save = handle
    ckpt.client_state = dict(client_state or {})
    if cfg.async_save:
        ckpt.add_pending(handle, CheckpointCommitInfo(tag=tag, save_dir=save_dir, save_latest=save_latest))
        ext.EngineHandle.watch_removal(handle)  # shutil.rmtree(save_dir) right after the call waits for it
    return True


def _agreed_tag(engine: Any, tag: str, verb: str) -> str:
    """The checkpoint tag every rank uses (collective), following ``checkpoint.tag_validation``.

    DeepSpeed's own check runs first (``runtime/engine.py`` ``_checkpoint_tag_validation``): ``FAIL``
    raises its AssertionError on every rank when the ranks' tags differ, before anything is written;
    ``WARN`` logs its warning. Under ``WARN`` / ``IGNORE`` DeepSpeed lets each rank write under its own
    tag and ``latest`` names group rank 0's; a unickpt checkpoint is one directory, so every rank takes
    group rank 0's tag (one broadcast). Under ``WARN`` each rank whose tag differs logs which tag it gave
    and which is used (``verb``: ``"saves"`` / ``"loads"``).
    """
    engine._checkpoint_tag_validation(tag)
    if engine.checkpoint_tag_validation_fail():
        return tag
    uengine = ext.engine()
    tag0 = uengine.broadcast(tag)
    if tag0 != tag and engine.checkpoint_tag_validation_enabled():
        used = (f"the checkpoint is written under {tag0!r} (the tag 'latest' names)" if verb == "saves"
                else f"{tag0!r} is loaded")
        log.warning("unickpt.deepspeed: rank %d %s with checkpoint tag %r, group rank 0 with %r: %s", uengine.rank,
                    verb, tag, tag0, used)
    return tag0


def _encode_client_state(client_state: dict, allow_pickle: bool) -> Any:
    """``client_state`` as tagged JSON. Raises UnsafeObjectError naming the innermost offending key
    (``client_state.opt.fn``, ``client_state.hist[2]``) when a value needs pickle and it is not allowed."""
    try:
        return ext.Codec.encode(client_state, allow_pickle=allow_pickle, key="client_state")
    except UnsafeObjectError:
        _raise_at_unsafe(client_state, "client_state")
        raise


def _raise_at_unsafe(value: Any, key: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _raise_at_unsafe(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _raise_at_unsafe(v, f"{key}[{i}]")
    ext.Codec.encode(value, allow_pickle=False, key=key)


def _save_state(engine: Any, uengine: Any, cfg: Any, target: str, tag: str, client_enc: Any,
                exclude_frozen: bool, on_commit: Any) -> Any:
    """Build the state (see the module docstring) and hand it to unickpt; returns the SaveHandle."""
    state = _state(engine, client_enc, exclude_frozen)
    _drop_pipeline_replicas(engine, state)
    return uengine.save(target, state, async_save=cfg.async_save, storage_options=cfg.storage_options or None,
                        step=int(engine.global_steps), framework="deepspeed", extra={"deepspeed_tag": tag},
                        on_commit=on_commit, allow_pickle=cfg.allow_pickle)


def _drop_pipeline_replicas(engine: Any, state: dict) -> None:
    """Pipeline engines: a tied parameter (``TiedLayerSpec``) lives on several stages, each with its own
    optimizer partition of it (the stages' data-parallel groups cut their flat buffers differently),
    so only the first stage holding it saves it: DeepSpeed marks the copies of the other stages
    ``param.ds_pipe_replicated`` (``runtime/pipe/module.py`` ``_index_tied_modules``). On load every
    stage reads it."""
    replicas = {n for n, p in engine.module.named_parameters() if getattr(p, "ds_pipe_replicated", False)}
    if not replicas:
        return
    for part in (state["module"], state["optimizer"]["fp32"], *state["optimizer"].get("state", {}).values()):
        for name in replicas:
            part.pop(name, None)


def memory_state(engine: Any, ckpt: Any) -> dict:
    """The state of a memory save (the checkpoint tiers): what ``save_checkpoint`` saves, with the
    client_state of the latest ``save_checkpoint`` call. The ZeRO checkpoint-event prologue/epilogue
    run around it as for a save (ZeRO-3 keeps its persistent parameters gathered otherwise)."""
    client_enc = _encode_client_state(ckpt.client_state, ckpt.config.allow_pickle)
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    try:
        return _state(engine, client_enc, exclude_frozen=False)
    finally:
        if engine._optimizer_has_ckpt_event_epilogue():
            engine.optimizer.checkpoint_event_epilogue()


def _state(engine: Any, client_enc: Any, exclude_frozen: bool) -> dict:
    layout = zero_layout(engine)
    state_keys, scalars = _state_keys(layout)
    state = {
        "module": _module_state(engine, layout, exclude_frozen),
        "optimizer": {
            **_optimizer_state(layout, state_keys, with_moments=True),
            "scalars": ext.Codec.encode(scalars, allow_pickle=False, key="optimizer.scalars"),
            "param_groups": ext.Codec.encode([{k: v for k, v in g.items() if k != "params"}
                                          for g in layout.base.param_groups], allow_pickle=False,
                                         key="optimizer.param_groups"),
        },
        "client_state": client_enc,
        "deepspeed": _info(engine, layout),
    }
    wrapper = wrapper_state(layout)
    if wrapper:  # fp16: the loss scaler and the wrapper's flags
        state["optimizer"]["wrapper"] = ext.Codec.encode(wrapper, allow_pickle=False, key="optimizer.wrapper")
    if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict"):
        state["lr_scheduler"] = engine.lr_scheduler
    return state


def _sibling(path: str, suffix: str) -> str:
    """``dir/.<name><suffix>`` for a local ``dir/<name>`` (hidden: no ``global_step*`` glob matches it)."""
    head, name = os.path.split(path.rstrip(os.sep))
    return os.path.join(head, f".{name}{suffix}")


def _swap_in(storage: ext.StorageBackend, new: str, path: str) -> None:
    """Local storage, group rank 0: replace the committed checkpoint ``path`` by the committed ``new``
    with two directory renames (the old copy is removed only after the new one is in place)."""
    final = storage.strip(path)
    old = _sibling(final, REPLACED_SUFFIX)
    ext.CheckpointDir(storage, old).remove()
    os.rename(final, old)
    os.rename(storage.strip(new), final)
    dfd = os.open(os.path.dirname(final), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    ext.CheckpointDir(storage, old).remove()


# -- load -----------------------------------------------------------------------------------------
def _read_latest(storage: ext.StorageBackend, load_dir: str, name: str = LATEST_FILE) -> str | None:
    """The tag ``load_dir/<name>`` holds (``latest``, or ``latest_universal`` under ``load_universal``),
    or None (no file, or unreadable)."""
    if name == LATEST_FILE:
        return ext.CheckpointRoot(load_dir, storage=storage).read_latest()
    try:
        return storage.read_bytes(storage.join(load_dir, name)).decode().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _is_native_deepspeed(storage: ext.StorageBackend, path: str) -> bool:
    try:
        names = storage.listdir(path)
    except (FileNotFoundError, OSError):
        return False
    return any(n.endswith("_model_states.pt") for n in names)


def refuse_unickpt_tag(load_dir: Any = None, tag: Any = None, *args: Any, **kwargs: Any) -> None:
    """Before DeepSpeed's own ``load_checkpoint`` (an engine without the block; its arguments): a tag unickpt
    wrote (committed, no DeepSpeed files) fails deep inside DeepSpeed (``assert len(self.ckpt_list) > 0``), so
    raise a ValueError that names the tag and the config block that loads it instead. A tag of DeepSpeed's
    own, or no tag at all, goes on unchanged."""
    if not isinstance(load_dir, (str, os.PathLike)) or not os.path.isdir(load_dir):
        return
    storage = ext.open_storage(os.fspath(load_dir))
    tag = tag if tag is not None else _read_latest(storage, os.fspath(load_dir))
    if tag is None:
        return
    path = storage.join(os.fspath(load_dir), str(tag))
    if ext.CheckpointDir(storage, path).is_committed() and not _is_native_deepspeed(storage, path):
        raise ValueError(f"{path!r} is a unickpt checkpoint: DeepSpeed's own load_checkpoint cannot read it. Load "
                         'it with "unickpt": {"enabled": true} in the DeepSpeed config (under the Hugging Face '
                         "Trainer: UNICKPT_TRANSFORMERS=1)")


def load_checkpoint(engine: Any, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
    """``DeepSpeedEngine.load_checkpoint`` through unickpt (collective), resharding to this engine.

    ``tag`` defaults to the content of ``load_dir/latest``; without it, logs a warning and returns
    ``(None, None)`` like DeepSpeed. A tag directory holding a DeepSpeed-native checkpoint (no
    ``metadata.json`` but ``*_model_states.pt``) is loaded by DeepSpeed's own code. Parameters, fp32
    master weights and optimizer state are filled in place from the stored flat ranges, whatever the
    data-parallel size, ZeRO stage or number of pipeline stages at save time. Ranks passing different
    tags load group rank 0's (:func:`_agreed_tag`).

    Returns:
        ``(checkpoint path, client_state)``.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``load_dir/<tag>``.
        StateMismatchError: a checkpoint written by another framework; a parameter or optimizer state
            missing from the checkpoint (named), a dtype or shape mismatch, another number of param groups,
            or another optimizer's state (checked before anything is loaded: the engine is then left as it
            was); pipeline engines: raised on every rank when any stage's layers differ (names the ranks).
        AssertionError: ``checkpoint.tag_validation`` is ``FAIL`` and the ranks' tags differ (DeepSpeed's).
        NotImplementedError: ``custom_load_fn``, a model-parallel axis, NVMe offload.
    """
    ckpt = engine.checkpoint_engine
    cfg = ckpt.config
    if custom_load_fn is not None:
        raise NotImplementedError("unickpt.deepspeed: load_checkpoint(custom_load_fn=...) is not supported")
    _check_supported(engine)
    finish_all_pending()  # a save still committing (from any engine in this process) may be the one to load
    load_dir = os.fspath(load_dir)
    storage = ext.open_storage(load_dir, cfg.storage_options or None)
    if cfg.memory_every is not None and tag is None and not load_module_only:
        restored = _load_from_memory(engine, storage, load_dir, load_module_strict, load_optimizer_states,
                                     load_lr_scheduler_states)
        if restored is not None:
            return restored
    if tag is None and engine.load_universal_checkpoint():  # DeepSpeed reads ``latest_universal`` then
        tag = _read_latest(storage, load_dir, LATEST_UNIVERSAL)
        if tag is None:
            raise ValueError(f"Invalid for universal checkpoint: {storage.join(load_dir, LATEST_UNIVERSAL)} "
                             "does not exist")
    if tag is None:
        tag = _read_latest(storage, load_dir)
        if tag is None:
            log.warning("unickpt.deepspeed: no %r file in %s; pass tag= to load a specific checkpoint",
                        LATEST_FILE, load_dir)
            return None, None
    tag = _agreed_tag(engine, str(tag), "loads")
    path = storage.join(load_dir, tag)
    if storage.is_local and not ext.CheckpointDir(storage, path).is_committed():
        for suffix in (REPLACING_SUFFIX, REPLACED_SUFFIX):  # a crash between the renames of _swap_in
            alt_path = _sibling(path, suffix)
            if ext.CheckpointDir(storage, alt_path).is_committed():
                log.warning("unickpt.deepspeed: %s is missing (a replacement was interrupted); loading %s",
                            path, alt_path)
                path = alt_path
                break
    if not ext.CheckpointDir(storage, path).is_committed() and _is_native_deepspeed(storage, path):
        from deepspeed.runtime.engine import DeepSpeedEngine

        log.info("unickpt.deepspeed: %s is a DeepSpeed-native checkpoint; loading it with DeepSpeed", path)
        original = DeepSpeedEngine.load_checkpoint.__unickpt_original__
        return original(engine, load_dir, tag=tag, load_module_strict=load_module_strict,
                        load_optimizer_states=load_optimizer_states,
                        load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
    meta = ext.CheckpointDir.open(path, cfg.storage_options or None).read_metadata()  # CheckpointNotFoundError when uncommitted or absent
    if meta.framework != "deepspeed":
        raise StateMismatchError(
            f"{path!r} was written by {meta.framework or 'unickpt.save'}; a DeepSpeed engine loads DeepSpeed "
            "checkpoints only (load it into FSDP / Accelerate / Lightning, which read other frameworks' "
            "checkpoints: docs/cross-framework.md)")
    if _is_pipeline(engine):
        _check_pipeline_stages(engine, meta, path, load_module_strict, load_module_only)
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    try:  # the epilogue must run whatever fails (ZeRO-3: it gathers the persistent parameters again)
        client_enc = _load_state(engine, meta, path, load_module_strict, load_optimizer_states,
                                 load_lr_scheduler_states, load_module_only)
    finally:
        if engine._optimizer_has_ckpt_event_epilogue():
            engine.optimizer.checkpoint_event_epilogue()
    return path, ext.Codec.decode(client_enc, allow_pickle=cfg.allow_pickle, key="client_state")


def _is_pipeline(engine: Any) -> bool:
    """True for pipeline engines (the engine's module is a ``PipelineModule``)."""
    from deepspeed.runtime.pipe.module import PipelineModule

    return isinstance(engine.module, PipelineModule)


def _other_stage(engine: Any, name: str) -> bool:
    """Pipeline engines: True when the saved module weight ``name`` belongs to a layer of the model that
    another stage builds (``<idx>.*`` with ``idx`` outside this stage's layers, or ``tied_modules.<key>.*``
    of a tied key this stage does not hold), so it is no surplus weight of this stage."""
    if not _is_pipeline(engine):
        return False
    from deepspeed.runtime.pipe.module import TiedLayerSpec

    module = engine.module
    head, _, rest = name.partition(".")
    if head == "tied_modules":
        key = rest.partition(".")[0]
        return key not in module.tied_modules and any(
            isinstance(spec, TiedLayerSpec) and spec.key == key for spec in module._layer_specs)
    if head.isdigit():
        idx = int(head)
        return idx < len(module._layer_specs) and not module._local_start <= idx < module._local_stop
    return False


def _check_pipeline_stages(engine: Any, meta: Any, path: str, load_module_strict: bool,
                           load_module_only: bool) -> None:
    """Pipeline engines, before anything is loaded (collective): every stage builds other layers, so a
    checkpoint of another model may lack the weights of one stage only. Each rank checks its weights
    and fp32 masters against the checkpoint (:func:`_load_target`), and a StateMismatchError of any
    rank is raised on every rank, naming each failing rank and its keys (no rank waits in the load)."""
    saved_tensors = set(meta.tensors) | set(meta.aliases)
    _, _, saved_objects = ext.StateTools.saved_leaves(meta.state_tree)
    error = None
    try:
        _load_target(engine, zero_layout(engine), path, saved_tensors, saved_objects, [], False, load_module_strict,
                     False, load_module_only)
    except StateMismatchError as e:
        error = str(e)
    failed = [f"rank {r}: {e}" for r, e in enumerate(ext.engine().all_gather(error)) if e is not None]
    if failed:
        raise StateMismatchError("pipeline stages and the checkpoint differ: " + "; ".join(failed))


def _load_from_memory(engine: Any, storage: ext.StorageBackend, load_dir: str, load_module_strict: bool,
                      load_optimizer_states: bool, load_lr_scheduler_states: bool) -> tuple[Any, Any] | None:
    """The checkpoint tiers (docs/tiers.md): restore the newest step that every rank holds in memory
    (its node's, or a peer node's) when it is at least as new as ``load_dir/latest``'s global step.
    Returns ``(memory copy path, client_state)``, or None (then the storage checkpoint is loaded)."""
    ckpt = engine.checkpoint_engine
    cfg = ckpt.config
    tiers = ckpt.tiers_for()
    latest = _read_latest(storage, load_dir) if tiers.rank == 0 else None
    persisted = None
    if latest is not None:
        try:
            persisted = ext.CheckpointDir.open(storage.join(load_dir, latest), cfg.storage_options or None).read_metadata().step
        except Exception:  # a native or damaged tag: memory decides alone  # noqa: BLE001
            persisted = None
    persisted = ext.engine().broadcast(persisted)
    chosen: dict = {}

    def target(path: str) -> dict:
        meta = ext.CheckpointDir.open(path).read_metadata()
        layout = zero_layout(engine)
        saved_tensors = set(meta.tensors) | set(meta.aliases)
        _, _, saved_objects = ext.StateTools.saved_leaves(meta.state_tree)
        prefix = "optimizer.state."
        state_keys = sorted({f[len(prefix):].split(".", 1)[0] for f in saved_tensors if f.startswith(prefix)})
        with_moments = load_optimizer_states
        if with_moments:
            _check_optimizer(layout, path, saved_objects, state_keys)
            for key in state_keys:
                for flat in layout.flat:
                    layout.base.state[flat].setdefault(key, torch.zeros_like(flat))
        chosen.update(layout=layout, path=path, with_moments=with_moments)
        return _load_target(engine, layout, path, saved_tensors, saved_objects, state_keys, with_moments,
                            load_module_strict, load_lr_scheduler_states, False)

    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    try:
        got = tiers.recover(target, persisted=persisted, strict=False, allow_pickle=cfg.allow_pickle)
        if got is None:
            return None
        step, state, stats = got
        ckpt.last_load_stats = stats
        _apply_loaded(engine, chosen["layout"], chosen["path"], state, chosen["with_moments"], False)
    finally:
        if engine._optimizer_has_ckpt_event_epilogue():
            engine.optimizer.checkpoint_event_epilogue()
    if tiers.rank == 0:
        log.info("unickpt.deepspeed: restored global step %d from the memory tiers (%s)", step, stats.tier)
    return chosen["path"], ext.Codec.decode(state["client_state"], allow_pickle=cfg.allow_pickle, key="client_state")


def _apply_loaded(engine: Any, layout: ZeroLayout, path: str, state: dict, with_moments: bool,
                  load_module_only: bool) -> None:
    """After a load into ``state``: the optimizer's scalars and param groups, the engine's counters."""
    info = state["deepspeed"]
    if with_moments:
        _restore_optimizer_scalars(layout, path, state["optimizer"]["scalars"], state["optimizer"]["param_groups"])
        if state["optimizer"].get("wrapper") is not None:
            wrapper = ext.Codec.decode(state["optimizer"]["wrapper"], key="optimizer.wrapper")
            if not isinstance(wrapper, dict):
                raise TypeError(f"{path!r}: 'optimizer.wrapper' is a {type(wrapper).__name__}, not a dict")
            dropped = restore_wrapper_state(layout, wrapper)
            if dropped:
                log.warning("unickpt.deepspeed: %s: this engine's %s has no place for the saved loss-scaler fields "
                            "%s; they are not restored", path, type(layout.wrapper).__name__,
                            {k: wrapper["loss_scaler"][k] for k in dropped})
    if not load_module_only:
        engine.global_steps = int(info["global_steps"])
        engine.global_samples = int(info["global_samples"])
        engine.skipped_steps = int(info["skipped_steps"])
    engine.loaded_checkpoint_dp_world_size = int(info["dp_world_size"])
    engine.loaded_checkpoint_mp_world_size = int(info["mp_world_size"])


def _load_state(engine: Any, meta: Any, path: str, load_module_strict: bool, load_optimizer_states: bool,
                load_lr_scheduler_states: bool, load_module_only: bool) -> Any:
    """Check the checkpoint against the engine, then load it in place; returns the encoded client_state.
    Nothing of the engine is changed when a check fails (StateMismatchError)."""
    ckpt = engine.checkpoint_engine
    cfg = ckpt.config
    layout = zero_layout(engine)
    saved_tensors = set(meta.tensors) | set(meta.aliases)
    _, _, saved_objects = ext.StateTools.saved_leaves(meta.state_tree)
    with_moments = load_optimizer_states and not load_module_only
    prefix = "optimizer.state."
    state_keys = sorted({f[len(prefix):].split(".", 1)[0] for f in saved_tensors if f.startswith(prefix)})
    if with_moments:
        _check_optimizer(layout, path, saved_objects, state_keys)
    injected = []  # optimizer state created so that it can be loaded into; removed again if a check fails
    if with_moments:
        for key in state_keys:
            for flat in layout.flat:
                st = layout.base.state[flat]
                if key not in st:
                    st[key] = torch.zeros_like(flat)
                    injected.append((st, key))
    try:
        state = _load_target(engine, layout, path, saved_tensors, saved_objects, state_keys, with_moments,
                             load_module_strict, load_lr_scheduler_states, load_module_only)
    except BaseException:
        for st, key in injected:
            del st[key]
        raise
    ckpt.last_load_stats = ext.engine().load(path, state, strict=False,
                                                 storage_options=cfg.storage_options or None,
                                                 allow_pickle=cfg.allow_pickle, verify=cfg.verify)
    _apply_loaded(engine, layout, path, state, with_moments, load_module_only)
    if ckpt.tiers is not None:
        ckpt.tiers.forget_newer(int(state["deepspeed"]["global_steps"]))
    return state["client_state"]


def _load_target(engine: Any, layout: ZeroLayout, path: str, saved_tensors: set, saved_objects: dict,
                 state_keys: list, with_moments: bool, load_module_strict: bool, load_lr_scheduler_states: bool,
                 load_module_only: bool) -> dict:
    """The state to load into; StateMismatchError naming the keys when it and the checkpoint differ."""
    module = _module_state(engine, layout, exclude_frozen=False)
    if not load_module_strict:
        module = {n: t for n, t in module.items() if f"module.{n}" in saved_tensors}
    state: dict[str, Any] = {"module": module,
                             "optimizer": _optimizer_state(layout, state_keys, with_moments=with_moments)}
    if with_moments:
        state["optimizer"]["scalars"] = None
        state["optimizer"]["param_groups"] = None
        if "optimizer.wrapper" in saved_objects:  # fp16 checkpoints only
            state["optimizer"]["wrapper"] = None
    state["client_state"] = None
    state["deepspeed"] = None
    restore_sched = (load_lr_scheduler_states and not load_module_only and engine.lr_scheduler is not None
                     and hasattr(engine.lr_scheduler, "load_state_dict"))
    if restore_sched and not any(f == "lr_scheduler" or f.startswith("lr_scheduler.") for f in saved_objects):
        log.warning("unickpt.deepspeed: %s has no LR scheduler state; the engine's scheduler is left as it is", path)
        restore_sched = False
    if restore_sched:
        state["lr_scheduler"] = engine.lr_scheduler

    flat = ext.StateTools.flatten(state, for_load=True)
    missing = sorted(set(flat.tensors) - saved_tensors) + sorted(
        f for f in flat.objects if f not in saved_objects and not f.startswith("lr_scheduler"))
    unexpected = sorted(f for f in saved_tensors if f.startswith("module.") and f not in flat.tensors
                        and not _other_stage(engine, f[len("module."):]))
    if missing or (load_module_strict and unexpected):
        parts = []
        if missing:
            more = f" ({len(missing)} in all)" if len(missing) > 20 else ""
            parts.append(f"missing from the checkpoint: {missing[:20]}{more}")
        if load_module_strict and unexpected:
            parts.append(f"model weights in the checkpoint but not in the model: {unexpected[:20]}")
        raise StateMismatchError(f"{path!r}: the DeepSpeed engine and the checkpoint differ; " + "; ".join(parts))
    return state


def _check_optimizer(layout: ZeroLayout, path: str, saved_objects: dict, state_keys: list) -> None:
    """Before anything is loaded: the checkpoint's optimizer state fits this engine's optimizer.

    Raises StateMismatchError for another number of optimizer partitions or param groups, or when this
    optimizer already keeps state under other keys (SGD's ``momentum_buffer`` vs Adam's ``exp_avg``).
    A checkpoint of another optimizer class with the same state keys (FusedAdam -> torch AdamW) loads
    with a warning.
    """
    scalars = _saved_plain(saved_objects, "optimizer.scalars", twice=True)
    groups = _saved_plain(saved_objects, "optimizer.param_groups", twice=True)
    if scalars is not None:
        _scalars_for(layout, path, scalars)
    check_wrapper_state(layout, path, _saved_plain(saved_objects, "optimizer.wrapper", twice=True) or {})
    if groups is not None and len(groups) != len(layout.base.param_groups):
        raise StateMismatchError(f"{path!r}: 'optimizer.param_groups': the checkpoint has {len(groups)} param "
                                 f"groups, this optimizer has {len(layout.base.param_groups)}")
    have = sorted({k for flat in layout.flat for k, v in layout.base.state.get(flat, {}).items()
                   if torch.is_tensor(v) and v.dim() > 0 and v.shape == flat.shape})
    if have and have != state_keys:
        raise StateMismatchError(f"{path!r}: 'optimizer.state': the checkpoint holds optimizer state {state_keys}, "
                                 f"this engine's optimizer keeps {have} (another optimizer?); pass "
                                 "load_optimizer_states=False to load the weights only")
    info = _saved_plain(saved_objects, "deepspeed") or {}
    saved_cls, cls = info.get("optimizer"), _optimizer_class(layout.base)
    if saved_cls is not None and saved_cls != cls:
        log.warning("unickpt.deepspeed: %s holds the state of a %s optimizer; loading it into %s", path,
                    saved_cls, cls)


def _scalars_for(layout: ZeroLayout, path: str, scalars: list) -> list:
    """The saved per-partition non-tensor optimizer state (Adam's ``step``), one entry per partition of
    this engine. The number of partitions may differ (ZeRO-3 forms ``sub_group_size`` sub-groups of
    each rank's partition, so their number changes with the DP size; ZeRO-0 has one per parameter)
    when every saved entry is the same; otherwise StateMismatchError."""
    if len(scalars) == len(layout.flat):
        return scalars
    if scalars and all(_same_plain(scalars[0], other) for other in scalars[1:]):
        return [scalars[0]] * len(layout.flat)
    raise StateMismatchError(f"{path!r}: 'optimizer.scalars': the checkpoint has {len(scalars)} optimizer "
                             f"partitions, this engine has {len(layout.flat)}, and their non-tensor state "
                             "(such as Adam's step) differs between partitions")


def _same_plain(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_plain(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _saved_plain(saved_objects: dict, fqn: str, twice: bool = False) -> Any:
    """A plain value of the checkpoint's state tree, decoded (``twice``: the plugin encoded it itself)."""
    if fqn not in saved_objects:
        return None
    value = ext.Codec.decode(saved_objects[fqn], key=fqn)
    return ext.Codec.decode(value, key=fqn) if twice else value


def _decoded_list(path: str, encoded: Any, key: str) -> list:
    """The list this plugin encoded as ``key``, decoded; TypeError naming ``key`` for anything else."""
    value = ext.Codec.decode(encoded, key=key)
    if not isinstance(value, list):
        raise TypeError(f"{path!r}: {key!r} is a {type(value).__name__}, not a list")
    return value


def _restore_optimizer_scalars(layout: ZeroLayout, path: str, scalars_enc: Any, groups_enc: Any) -> None:
    scalars = _scalars_for(layout, path, _decoded_list(path, scalars_enc, "optimizer.scalars"))
    groups = _decoded_list(path, groups_enc, "optimizer.param_groups")
    if len(groups) != len(layout.base.param_groups):
        raise StateMismatchError(f"{path!r}: 'optimizer.param_groups': the checkpoint has {len(groups)} param "
                                 f"groups, this optimizer has {len(layout.base.param_groups)}")
    for flat, values in zip(layout.flat, scalars):
        # a copy per partition: torch's Adam increments its ``step`` tensor in place
        layout.base.state[flat].update({k: v.clone() if torch.is_tensor(v) else v for k, v in values.items()})
    for group, saved in zip(layout.base.param_groups, groups):
        for k, v in saved.items():
            group[k] = v
