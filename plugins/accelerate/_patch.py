"""The patch: ``Accelerator.save_state`` / ``load_state`` / ``end_training`` routed through unickpt.

``Accelerator.save_state`` saves models (``save_fsdp_model`` for FSDP, else a full state dict),
optimizers (``save_fsdp_optimizer``, which calls ``torch.distributed.checkpoint`` with a
``FileSystemWriter``), schedulers, dataloader samplers, the scaler, per-process RNG state
(``save_accelerator_state``) and registered objects (``save_custom_state``), each to its own file.
Patching those module-level names would make one save several unrelated writes with no common
commit, and Accelerate would still delete the oldest checkpoint before the new one exists. So the
methods themselves are replaced (on the class: every instance and subclass that calls ``super()``
sees them): one collective unickpt save per ``save_state`` with everything in it (see
:mod:`._state`), written asynchronously, committed atomically, then ``total_limit`` rotation.
DeepSpeed, Megatron-LM and XLA accelerators keep Accelerate's own methods (DeepSpeed engines save
through the unickpt DeepSpeed plugin's checkpoint engine). A folder without a unickpt checkpoint
(written by Accelerate itself) is loaded by Accelerate's own ``load_state``.
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import unickpt
from unickpt import Checkpointer, ext, interop

from . import _folders
from ._options import Options
from ._state import build_state, process0_buffers

__all__ = ["enable", "disable", "is_enabled", "options_for", "wait", "patch_accelerate"]

log = logging.getLogger("unickpt.accelerate")
FRAMEWORK = "accelerate"  # recorded in metadata.json: unickpt.accelerate.layout reads these checkpoints elsewhere

_lock = threading.Lock()
_global: Options | None = None  # enable() without an accelerator
_scoped: "weakref.WeakKeyDictionary[Any, Options | None]" = weakref.WeakKeyDictionary()  # None: disabled
_originals: dict[str, Any] = {}


def options_for(accelerator: Any) -> Options | None:
    """The options unickpt uses for ``accelerator``, or None when Accelerate's own path is used."""
    from accelerate.utils import DistributedType

    opts = _scoped.get(accelerator, _global)
    if opts is None:
        return None
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        return None
    return opts


def is_enabled(accelerator: Any = None) -> bool:
    """True when ``accelerator``'s ``save_state`` / ``load_state`` go through unickpt (with no
    argument: when unickpt is on for every accelerator)."""
    if accelerator is None:
        return _global is not None
    return options_for(accelerator) is not None


def enable(accelerator: Any = None, options: Options | None = None) -> Options:
    """Route ``save_state`` / ``load_state`` of ``accelerator`` (None: every accelerator) through unickpt."""
    global _global
    patch_accelerate()
    opts = (options or Options()).validated()
    with _lock:
        if accelerator is None:
            _global = opts
        else:
            _scoped[accelerator] = opts
    return opts


def disable(accelerator: Any = None) -> None:
    """Back to Accelerate's own checkpointing for ``accelerator`` (even when unickpt is enabled for
    every accelerator; None: every accelerator not enabled on its own). Pending unickpt saves are
    waited for."""
    global _global
    wait()
    with _lock:
        if accelerator is None:
            _global = None
        else:
            _scoped[accelerator] = None


def wait() -> None:
    """Block until every pending unickpt save of this process (default group) has committed; then
    raise :class:`unickpt.EarlierSaveFailedError` naming every failed save not reported yet (on every
    process; ``on_error="warn"``: warn instead). A save whose Accelerate folder was removed while it was
    being written (by the user, after ``save_state`` returned) is not an error: its target is gone,
    and it is reported as a warning (see :func:`_wait_tracked`)."""
    _wait_tracked()
    engine = ext.EngineHandle.existing()
    if engine is not None:
        engine.wait()


# -- saves in flight: removal waits for them, and a removed target is not a later error ---------------
_tracked: list[tuple[Any, str]] = []  # (SaveHandle, Accelerate folder) of async saves not yet waited for


def _track(handle: Any, folder: str) -> None:
    with _lock:  # emptied by the next save_state / load_state / wait()
        _tracked.append((handle, os.path.abspath(folder)))
    ext.EngineHandle.watch_removal(handle)  # removing the folder right after save_state waits for the save


def _target_removed(handle: Any, folder: str) -> bool:
    """True when the save's Accelerate folder or its unickpt root is gone (the save's own directory
    is not looked at: the core removes a failed save's directory itself)."""
    return not os.path.isdir(_folders.store_root(folder))


def _wait_tracked() -> None:
    """Wait for this process's pending ``save_state`` saves. A failure is left to the engine's
    ``wait()`` that follows (it raises EarlierSaveFailedError, or warns, on every process), unless the
    save's folder was removed while it was being written: then the save's target no longer exists, and
    the failure (files could not be written or committed into a deleted folder) is logged as a warning,
    not raised into a later, unrelated ``save_state`` / ``load_state``."""
    with _lock:
        pending, _tracked[:] = list(_tracked), []
    for handle, folder in pending:
        error = handle.outcome()
        if isinstance(error, Exception) and _target_removed(handle, folder):
            handle.error_reported = True  # not raised later
            log.warning("unickpt.accelerate: the save into %s did not complete: the folder was removed while "
                        "the save was being written (%s)", folder, str(error).splitlines()[0])


def _checkpoints_dir(acc: Any) -> str:
    return os.path.join(acc.project_dir, "checkpoints")


def _output_dir(acc: Any, output_dir: str | None) -> str:
    """Accelerate's choice of folder (same checks and messages), without its pre-save deletion."""
    if acc.project_configuration.automatic_checkpoint_naming:
        base = _checkpoints_dir(acc)
        os.makedirs(base, exist_ok=True)
        output_dir = os.path.join(base, f"checkpoint_{acc.save_iteration}")
        if os.path.exists(output_dir):
            raise ValueError(
                f"Checkpoint directory {output_dir} ({acc.save_iteration}) already exists. Please manually override "
                "`self.save_iteration` with what iteration to start with."
            )
        acc.wait_for_everyone()
    if output_dir is None:
        raise ValueError("save_state: no output_dir given and automatic checkpoint naming is disabled")
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    return output_dir


def _shared_folder(engine: Any, folder: str, call: str) -> str:
    """Process 0's folder, on every process (collective). A unickpt checkpoint is one collective
    object, so when the processes name different folders (each one its own
    ``tempfile.TemporaryDirectory()``, which Accelerate tolerates: every process writes its own files
    into its own folder) all of them use process 0's; theirs still exist, as with Accelerate."""
    if engine.world_size <= 1:
        return folder
    mine = os.path.abspath(folder)
    shared = engine.broadcast(mine if engine.rank == 0 else None)
    if shared != mine:
        log.info("unickpt.accelerate: %s: this process's folder %s is not process 0's; the checkpoint is in %s",
                 call, mine, shared)
    return shared


def _kept(original: list, after_hooks: list) -> list[int]:
    """Indices of ``original`` whose object is still in ``after_hooks`` (identity)."""
    ids = {id(x) for x in after_hooks}
    return [i for i, x in enumerate(original) if id(x) in ids]


def _save_state(acc: Any, opts: Options, output_dir: str | None, safe_serialization: bool,
                kwargs: dict) -> Path:
    from accelerate.utils import DistributedType

    if kwargs:  # Accelerate passes them to DeepSpeed's save_checkpoint only, and ignores them otherwise
        log.warning("unickpt.accelerate: save_state ignores %s (arguments for DeepSpeed's save_checkpoint)",
                    sorted(kwargs))
    engine = ext.engine()
    _wait_tracked()
    engine.wait()  # the previous save commits (or raises) before this one starts
    output_dir = _shared_folder(engine, _output_dir(acc, output_dir), "save_state")

    models = list(acc._models)
    indices = list(range(len(models)))
    if acc._save_model_state_pre_hook:
        fsdp = acc.distributed_type == DistributedType.FSDP
        weights = [] if fsdp else [acc.get_state_dict(m, unwrap=False) for m in models]
        original = list(weights)
        for hook in acc._save_model_state_pre_hook.values():
            hook(acc._models, weights, output_dir)
        if not fsdp:
            indices = _kept(original, weights)

    after: Callable[[int], None] | None = None
    limit = acc.project_configuration.total_limit
    if acc.project_configuration.automatic_checkpoint_naming and limit is not None:
        checkpoints_dir, keep, total = _checkpoints_dir(acc), output_dir, limit

        def rotate(_step: int) -> None:
            _folders.rotate(checkpoints_dir, total, keep, engine.in_flight)

        after = rotate
    # the unickpt root inside this Accelerate folder keeps its newest committed save only; at each commit,
    # group rank 0 links its model.safetensors files into the folder, then runs the total_limit rotation
    group = _safetensors_group(acc, indices, safe_serialization)
    link_root = _folders.store_root(output_dir)

    def committed(step: int) -> None:
        if group is not None:
            _folders.link_weights(link_root, step, output_dir)
        if after is not None:
            after(step)

    ckpt = Checkpointer(link_root, keep_last=1, on_commit=committed,
                        allow_pickle=opts.allow_pickle or not safe_serialization, framework=FRAMEWORK,
                        on_error=opts.on_error,
                        save_options=None if group is None else engine.options.with_(safetensors=group))
    step: int | None = None
    try:
        state = build_state(acc, indices, opts, saving=True)  # collective on several processes
        step = engine.broadcast(_folders.next_step(output_dir) if engine.rank == 0 else None)
        assert step is not None  # process 0's
        with process0_buffers(acc, indices):  # the snapshot is taken when save() returns
            handle = ckpt.save(step, state, async_save=opts.async_save)
        assert handle is not None  # a Checkpointer without tiers returns its persistent save's handle
        if after is not None:
            _rotate_at_return(engine, handle, checkpoints_dir, limit, output_dir)
    except BaseException as e:
        if acc.project_configuration.automatic_checkpoint_naming:
            _remove_failed(engine, output_dir, step, e)  # so that the next save_state can use this iteration
        if isinstance(e, unickpt.UnsafeObjectError):
            raise unickpt.UnsafeObjectError(
                f"{e} (unickpt.accelerate: allow pickling with save_state(..., safe_serialization=False), "
                "unickpt.accelerate.enable(allow_pickle=True) or UNICKPT_ACCELERATE_ALLOW_PICKLE=1)") from e
        raise
    if not handle.done():
        _track(handle, output_dir)
    acc.project_configuration.iteration += 1
    return Path(output_dir)


def _safetensors_group(acc: Any, indices: list[int], safe_serialization: bool) -> str | None:
    """The fqn prefix of the weights written as ``model.safetensors`` (``"models.0."``: the first model,
    the one Accelerate's own ``save_state`` names ``model.safetensors``), or None where Accelerate's own
    save writes no ``model.safetensors``: ``safe_serialization=False``, a save hook took the first model out,
    and FSDP with a state dict type other than ``FULL_STATE_DICT`` (``SHARDED_STATE_DICT`` writes
    ``pytorch_model_fsdp_<i>/``: the weights stay sharded in unickpt's files, no gather). Sharded weights
    (FSDP ``FULL_STATE_DICT``, a model ``fully_shard``-ed by hand) are gathered whole, each into one
    process's file, by the save itself (point to point, in the background)."""
    from accelerate.utils import DistributedType

    if not safe_serialization or 0 not in indices:
        return None
    if acc.distributed_type == DistributedType.FSDP:
        kind = acc.state.fsdp_plugin.state_dict_type
        if not str(getattr(kind, "name", kind)).endswith("FULL_STATE_DICT"):
            return None
    return "models.0."


def _rotate_at_return(engine: Any, handle: Any, checkpoints_dir: str, limit: int, output_dir: str) -> None:
    """``total_limit`` as Accelerate shows it: when ``save_state`` returns, the folders beyond the limit
    are gone. Accelerate deletes them before it saves; here the previous checkpoint has committed (the
    save waited for it), so with ``total_limit >= 2`` group rank 0 deletes the oldest folders now,
    keeping the new one and at least one committed checkpoint. With ``total_limit=1`` the only other
    folder is the last committed checkpoint: this save waits for its own commit, after which rotation
    deletes the previous folder, so a failing save never leaves no checkpoint."""
    if limit >= 2:
        if engine.rank == 0:
            _folders.rotate(checkpoints_dir, limit, output_dir, engine.in_flight)
        return
    others = [p for _, p in _folders.checkpoint_folders(checkpoints_dir)
              if os.path.abspath(p) != os.path.abspath(output_dir)]
    if others and not handle.done():
        handle.wait()  # raises the save's failure here, at the call (the folder is then removed)


def _remove_failed(engine: Any, output_dir: str, step: int | None, error: BaseException) -> None:
    """Group rank 0 removes the folder of a save that failed at the call; when the failure was
    agreed by every rank (a bad state, a refused target: the group still works), the other ranks
    wait for it, so that none of them sees the folder in its next ``save_state``."""
    if engine.rank == 0:
        step_dir = os.path.join(_folders.store_root(output_dir), f"step_{step}")
        deadline = time.monotonic() + 30.0
        while step is not None and engine.in_flight(step_dir) and time.monotonic() < deadline:  # winds down
            time.sleep(0.01)
        try:
            _folders.remove_failed(output_dir)
        except OSError:
            log.exception("unickpt.accelerate: could not remove %s after a failed save", output_dir)
    if isinstance(error, Exception) and not isinstance(error, unickpt.RankFailuresError):
        try:
            engine.broadcast(None)
        except Exception:  # keep the save's own error
            log.exception("unickpt.accelerate: synchronizing after a failed save failed")


def _input_dir(acc: Any, input_dir: str | None, engine: Any) -> str:
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return input_dir
    if not acc.project_configuration.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    checkpoints_dir = _checkpoints_dir(acc)
    chosen = engine.broadcast(_folders.newest_loadable(checkpoints_dir) if engine.rank == 0 else None)
    if chosen is None:
        raise unickpt.CheckpointNotFoundError(f"load_state: no loadable checkpoint_<N> folder in {checkpoints_dir!r}")
    return chosen


def _advance_iteration(acc: Any, engine: Any, loaded: int | None) -> None:
    """With automatic naming, point the next ``save_state`` after the loaded folder (``loaded``: its
    saved iteration, None for a folder Accelerate wrote) and after every existing ``checkpoint_<N>``.
    Accelerate leaves the counter alone, so its next ``save_state`` fails with "already exists"
    (huggingface/accelerate#1601, #3306); the folder of a save that never committed (a killed run) is
    not reused either. Collective."""
    if not acc.project_configuration.automatic_checkpoint_naming:
        return
    newest = engine.broadcast(_folders.newest_number(_checkpoints_dir(acc)) if engine.rank == 0 else None)
    candidates = [n for n in (loaded, newest) if n is not None]
    if candidates:
        acc.project_configuration.iteration = max(candidates) + 1


def _foreign_behind(given: str) -> str | None:
    """:func:`_foreign` of ``given`` unless it is a folder of this plugin's or Accelerate's own layout."""
    if os.path.isdir(given) and _folders.folder_kind(given) != "none":
        return None
    return _foreign(given)


def _foreign_or_refusal(given: str) -> tuple[str | None, str | None]:
    """``(`` :func:`_foreign_behind` ``, None)``, or ``(None, message)`` when the framework that wrote
    ``given`` refuses to move it (StateMismatchError): what process 0 tells the others."""
    try:
        return _foreign_behind(given), None
    except unickpt.StateMismatchError as e:
        return None, str(e)


def _foreign(path: str) -> str | None:
    """The committed unickpt checkpoint another framework wrote behind ``path`` (a Lightning pointer
    file, a DeepSpeed ``save_dir`` or tag, a megatron directory, a ``unickpt.save`` directory), or None."""
    storage = ext.open_storage(path)
    found = interop.locate_checkpoint(path, storage)
    if not ext.CheckpointDir(storage, found).is_committed():
        return None
    return found if ext.CheckpointDir.open(found).read_metadata().framework != FRAMEWORK else None


def _load_foreign(acc: Any, opts: Options, path: str, kwargs: dict) -> None:
    """``load_state`` of a checkpoint written by another framework (docs/cross-framework.md): the models,
    optimizers, schedulers and scaler are loaded through the checkpoint's layout, resharded to this run
    (weights, fp32 master copies, optimizer moments and steps, param groups, the LR schedule); the
    dataloaders' epoch counter follows the checkpoint's epochs when it has them. Accelerate's own state
    (RNG, ``accelerator.step``, registered objects) stays as it is. Collective. Raises
    StateMismatchError naming what cannot move (see :func:`unickpt.load`)."""
    kwargs = dict(kwargs)
    kwargs.pop("map_location", None)
    strict = kwargs.pop("strict", True)
    if kwargs:
        raise TypeError(f"load_state: unexpected keyword argument(s) {sorted(kwargs)} for a checkpoint of another "
                        "framework (supported: strict, map_location)")
    state = build_state(acc, list(range(len(acc._models))), opts)
    state = {k: state[k] for k in ("scaler", "models", "optimizers", "schedulers") if k in state}
    stats = ext.engine().load(path, state, strict=strict, mapping="auto")
    epoch = (stats.conversion_values or {}).get("epoch")
    if isinstance(epoch, int):
        for dl in acc._dataloaders:
            if hasattr(dl, "iteration"):
                dl.iteration = epoch
    if acc.scaler is not None and acc.is_fsdp2:
        acc.scaler._lazy_init_scale_growth_tracker(acc.scaler._device)
    if ext.engine().rank == 0:
        conversion = stats.conversion or {}
        log.info("unickpt.accelerate: loaded %s, written by %s (%s)", path, conversion.get("from"), conversion)


def _load_state(acc: Any, opts: Options, input_dir: str | None, load_kwargs: dict | None, kwargs: dict) -> Any:
    from accelerate.utils import DistributedType

    engine = ext.engine()
    _wait_tracked()
    engine.wait()  # a pending save commits first: it may be the one being loaded
    if input_dir is not None:  # another framework's checkpoint (a file, or a folder without unickpt/)
        # decided on process 0 for all: processes may name different folders (each its own temporary
        # one), and a process whose own folder is empty must still follow process 0's path
        given = os.path.expanduser(os.fspath(input_dir))
        agreed = engine.broadcast(_foreign_or_refusal(given) if engine.rank == 0 else None)
        assert agreed is not None  # process 0's
        foreign, refused = agreed
        if refused is not None:  # a checkpoint of another framework that cannot move (a Lightning .ckpt pack)
            raise unickpt.StateMismatchError(refused)
        if foreign is not None:
            return _load_foreign(acc, opts, foreign, kwargs)
    input_dir = _input_dir(acc, input_dir, engine)
    kind = engine.broadcast(_folders.folder_kind(input_dir) if engine.rank == 0 else None)
    if kind == "none":
        raise unickpt.CheckpointNotFoundError(
            f"load_state: {input_dir!r} is not a checkpoint: it holds neither a unickpt/ folder nor the files of "
            "Accelerate's own save_state (random_states_<r>.pkl, ...)")
    if kind == "unickpt":  # another process of this host may still be writing it (its save_state returned)
        input_dir = _shared_folder(engine, input_dir, "load_state")
        engine.broadcast(_folders.wait_for_writer(input_dir) if engine.rank == 0 else None)
    if kind == "accelerate":
        log.info("unickpt.accelerate: %s holds no unickpt checkpoint; loading it with Accelerate", input_dir)
        result = _originals["load_state"](acc, input_dir, load_kwargs=load_kwargs, **kwargs)
        _advance_iteration(acc, engine, None)
        return result
    kwargs = dict(kwargs)
    kwargs.pop("map_location", None)  # tensors are loaded in place, where they already are
    if load_kwargs:
        log.warning("unickpt.accelerate: load_state ignores load_kwargs=%s (arguments for torch.load)",
                    sorted(load_kwargs))
    strict = kwargs.pop("strict", True)
    if kwargs:
        raise TypeError(f"load_state: unexpected keyword argument(s) {sorted(kwargs)} for a unickpt checkpoint "
                        "(supported: strict, map_location)")

    fsdp = acc.distributed_type == DistributedType.FSDP
    models = [] if fsdp else list(acc._models)
    original = list(models)
    for hook in acc._load_model_state_pre_hook.values():
        hook(models, input_dir)
    indices = list(range(len(acc._models))) if fsdp else _kept(original, models)

    state = build_state(acc, indices, opts)
    ckpt = Checkpointer(_folders.store_root(input_dir), allow_pickle=opts.allow_pickle)
    try:
        step = ckpt.load(state, strict=strict)
    except unickpt.UnsafeObjectError as e:
        raise unickpt.UnsafeObjectError(
            f"{e} (unickpt.accelerate: unickpt.accelerate.enable(allow_pickle=True) or "
            "UNICKPT_ACCELERATE_ALLOW_PICKLE=1)") from e
    except unickpt.PerRankReshardError as e:
        raise unickpt.PerRankReshardError(
            f"{e}. unickpt.accelerate: per-process RNG state of {input_dir!r} cannot be continued on "
            f"{acc.num_processes} process(es); choose a rule with unickpt.accelerate.enable(rng_reshard='by_rank' "
            "or 'keep') or UNICKPT_ACCELERATE_RNG_RESHARD=by_rank|keep"
        ) from e
    if step is None:
        raise unickpt.CheckpointNotFoundError(
            f"load_state: {_folders.store_root(input_dir)!r} holds no committed unickpt checkpoint "
            "(the save never finished)"
        )
    saved = state["accelerate"]
    acc.step = int(saved["step"])
    _advance_iteration(acc, engine, int(saved["iteration"]))
    if acc.scaler is not None and acc.is_fsdp2:
        acc.scaler._lazy_init_scale_growth_tracker(acc.scaler._device)
    return None


def _wait_quietly() -> None:
    try:
        wait()
    except Exception:  # at exit there is no caller left to raise to
        log.exception("unickpt.accelerate: a pending save failed")


def patch_accelerate() -> None:
    """Replace ``Accelerator.save_state`` / ``load_state`` / ``end_training`` (idempotent).

    The replacements call Accelerate's originals for accelerators unickpt is not enabled for."""
    from accelerate import Accelerator

    with _lock:
        if getattr(Accelerator.save_state, "__unickpt__", False):
            return
        orig_save, orig_load, orig_end = Accelerator.save_state, Accelerator.load_state, Accelerator.end_training
        _originals.update(save_state=orig_save, load_state=orig_load, end_training=orig_end)

        @functools.wraps(orig_save)
        def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any):
            opts = options_for(self)
            if opts is None:
                return orig_save(self, output_dir, safe_serialization=safe_serialization, **kwargs)
            return _save_state(self, opts, output_dir, safe_serialization, kwargs)

        @functools.wraps(orig_load)
        def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any):
            opts = options_for(self)
            if opts is None:
                return orig_load(self, input_dir, load_kwargs=load_kwargs, **kwargs)
            return _load_state(self, opts, input_dir, load_kwargs, kwargs)

        @functools.wraps(orig_end)
        def end_training(self):
            wait()  # the commit needs the process group that end_training destroys
            return orig_end(self)

        for fn in (save_state, load_state, end_training):
            fn.__unickpt__ = True  # type: ignore[attr-defined]
        Accelerator.save_state, Accelerator.load_state, Accelerator.end_training = save_state, load_state, end_training
        atexit.register(_wait_quietly)
