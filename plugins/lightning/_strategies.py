"""Routing Lightning's sharded strategies, which bypass ``CheckpointIO``, through unickpt.

``ModelParallelStrategy`` (FSDP2 / TP, ``save_distributed_checkpoint=True``) and
``FSDPStrategy(state_dict_type="sharded")`` save and load with ``torch.distributed.checkpoint``
themselves (lightning 2.6 ``pytorch/strategies/model_parallel.py:299-345``, ``fsdp.py:550-640``);
``DeepSpeedStrategy`` calls ``deepspeed_engine.save_checkpoint``. :func:`install` wraps these
methods on the classes once: a strategy whose ``checkpoint_io`` is a
:class:`~unickpt.lightning.UnickptCheckpointIO` takes unickpt's path, every other strategy runs
Lightning's original method unchanged.

The sharded route saves, collectively over the default process group,
``{"state_dict": model, "optimizer_<i>": optimizer, "lightning": <the rest of the checkpoint>}``:
unickpt expands the model and optimizers with ``torch.distributed.checkpoint.state_dict`` (FSDP2
DTensors, FSDP1 sharded state), writes each shard once, and on load reshards them to the current
mesh and world size. The rest of the checkpoint (epoch, loops, callbacks, schedulers,
hyper-parameters: what Lightning itself writes to ``meta.pt``) is global rank 0's, stored as tagged
JSON. ``LightningModule.load_from_checkpoint`` reads with ``pl_load`` (``torch.load``); pointer
files are routed to unickpt there too. DeepSpeedStrategy gets the ``"unickpt"`` block of
:mod:`unickpt.deepspeed` added to its
DeepSpeed config before the engine is created.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

import torch

from unickpt import StateMismatchError, ext, interop

from . import _pointers
from ._inflight import fspath, register, run_ended, run_started, unregister
from ._pickles import pickled, refuse_pickles, unsafe_error
from ._pointers import Pointer
from ._reading import Reader, Solo, original_pl_load
from ._tree import FRAMEWORK, TENSOR_TAG, TREE_KEY, global_step, join, split
from ._versions import agree_pointer

__all__ = ["install", "unickpt_io", "save_sharded", "load_sharded", "deepspeed_config", "is_unickpt_file",
           "original_pl_load"]

log = logging.getLogger("unickpt.lightning")

_MARK = "__unickpt_lightning__"
MODEL_KEY = "state_dict"


def unickpt_io(strategy: Any) -> Any:
    """The strategy's :class:`UnickptCheckpointIO` (also inside a wrapping IO such as
    ``AsyncCheckpointIO``), or None. Never creates the strategy's default IO. An IO is one when its
    class (or a base) is marked ``is_unickpt_io`` (:mod:`.io` builds on this module, not the other way)."""
    io = getattr(strategy, "_checkpoint_io", None)
    for _ in range(4):
        if getattr(type(io), "is_unickpt_io", False):
            return io
        io = getattr(io, "_checkpoint_io", None) or getattr(io, "checkpoint_io", None) if io is not None else None
    return None


def _is_sharded(strategy: Any) -> bool:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return bool(getattr(strategy, "_save_distributed_checkpoint", True))
    if isinstance(strategy, FSDPStrategy):
        return getattr(strategy, "_state_dict_type", None) == "sharded"
    return False


def install() -> None:
    """Wrap the save/load methods of Lightning's sharded strategies and DeepSpeedStrategy (idempotent)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    for cls in (ModelParallelStrategy, FSDPStrategy):
        if not getattr(cls.save_checkpoint, _MARK, False):
            cls.save_checkpoint = _wrap_save(cls.save_checkpoint)  # type: ignore[method-assign]  # wrapped on purpose
        if not getattr(cls.load_checkpoint, _MARK, False):
            cls.load_checkpoint = _wrap_load(cls.load_checkpoint)  # type: ignore[method-assign]  # wrapped on purpose
    if not getattr(DeepSpeedStrategy.setup, _MARK, False):
        DeepSpeedStrategy.setup = _wrap_deepspeed_setup(  # type: ignore[method-assign]  # wrapped on purpose
            DeepSpeedStrategy.setup)
    _install_pl_load()
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    if not getattr(_MultiProcessingLauncher.launch, _MARK, False):
        _MultiProcessingLauncher.launch = _wrap_launch(  # type: ignore[method-assign]  # wrapped on purpose
            _MultiProcessingLauncher.launch)
    from lightning.pytorch import Trainer

    if not getattr(Trainer._run, _MARK, False):
        Trainer._run = _wrap_run(Trainer._run)  # type: ignore[method-assign]  # wrapped on purpose


def _wrap_run(original: Any) -> Any:
    """Count ``Trainer._run`` calls in progress: saves inside a run are asynchronous, saves outside
    one complete before they return (see ``UnickptCheckpointIO.save_checkpoint``)."""
    @functools.wraps(original)
    def _run(self: Any, *args: Any, **kwargs: Any) -> Any:
        run_started()
        try:
            return original(self, *args, **kwargs)
        finally:
            run_ended()

    setattr(_run, _MARK, True)
    return _run


_TRAMPOLINE = (
    "def _load(path_or_url, map_location=None, weights_only=None):\n"
    "    return _unickpt_pl_load(path_or_url, map_location=map_location, weights_only=weights_only)\n"
)


def _install_pl_load() -> None:
    """Route Lightning's checkpoint reader ``lightning.fabric.utilities.cloud_io._load`` (``pl_load``:
    ``TorchCheckpointIO``, ``LightningModule.load_from_checkpoint``, and users, who import it by
    name) to unickpt for unickpt files. The function object itself is redirected (its code becomes a
    call of :func:`_wrap_pl_load`'s reader), so every reference to it, taken before or after, reads
    unickpt checkpoints; other paths and file objects run Lightning's original code."""
    import lightning.fabric.utilities.cloud_io as cloud_io

    fn = cloud_io._load
    if getattr(fn, _MARK, False):
        return
    original = original_pl_load()
    cloud_io._unickpt_pl_load = _wrap_pl_load(original)  # type: ignore[attr-defined]  # our name, set on purpose
    namespace: dict = {}
    exec(_TRAMPOLINE, {}, namespace)  # noqa: S102 - a fixed two-line trampoline
    fn.__code__ = namespace["_load"].__code__
    setattr(fn, _MARK, True)


def _wrap_launch(original: Any) -> Any:
    """``ddp_spawn`` / ``ddp_fork``: the launcher's main process reads (and removes) the weights its
    worker saved (``_MultiProcessingLauncher._recover_results_in_main_process``) with the
    strategy's ``checkpoint_io``; the zero-code callback switches the workers' strategy only (its
    ``setup`` runs in them), so switch the main process's strategy here, before the launch: the first
    callback of the trainer whose class has ``unickpt_before_launch``
    (:class:`~unickpt.lightning._callback.UnickptCallback`) is called with the strategy."""
    @functools.wraps(original)
    def launch(self: Any, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            for cb in getattr(trainer, "callbacks", []):
                before_launch = getattr(type(cb), "unickpt_before_launch", None)
                if before_launch is not None:
                    before_launch(cb, self._strategy)
                    break
        return original(self, function, *args, trainer=trainer, **kwargs)

    setattr(launch, _MARK, True)
    return launch


def is_unickpt_file(path: Any, options: dict | None = None) -> bool:
    """Whether ``path`` holds a unickpt Lightning checkpoint (a pack, a placeholder of one being
    saved, or a pointer of the earlier layout)."""
    from . import _pack

    try:
        p = os.fspath(path)
    except TypeError:
        return False
    if p.startswith(("http://", "https://")):
        return False
    return _pack.kind(p, options) in ("pack", "pending", "pointer")


def _wrap_pl_load(original: Any) -> Any:
    """Lightning's reader ``pl_load`` (``torch.load``; lightning 2.6 ``fabric/utilities/cloud_io.py``):
    a path holding a unickpt checkpoint is read by a :class:`~unickpt.lightning.UnickptCheckpointIO`
    in this process alone (no collective: it may be called on one rank), with the caller's
    ``map_location`` and ``weights_only``; anything else (file objects, URLs, ``torch.save``
    files) goes to the original reader."""

    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and is_unickpt_file(path_or_url):
            return Reader().read(os.fspath(path_or_url), map_location, weights_only, Solo())
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    setattr(pl_load, _MARK, True)
    return pl_load


def _wrap_save(original: Any) -> Any:
    @functools.wraps(original)
    def save_checkpoint(self: Any, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        io = unickpt_io(self)
        if io is None or not _is_sharded(self):
            return original(self, checkpoint, filepath, storage_options)
        return save_sharded(io, self, checkpoint, filepath, storage_options)

    setattr(save_checkpoint, _MARK, True)
    return save_checkpoint


def _wrap_load(original: Any) -> Any:
    @functools.wraps(original)
    def load_checkpoint(self: Any, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        io = unickpt_io(self)
        if io is None:
            return original(self, checkpoint_path, weights_only=weights_only)
        if not _is_sharded(self):  # full dicts: saved through the CheckpointIO, read by Lightning's own code
            with _full_dict_reads(io, weights_only):
                return original(self, checkpoint_path, weights_only=weights_only)
        return load_sharded(io, self, checkpoint_path, weights_only, original=original)

    setattr(load_checkpoint, _MARK, True)
    return load_checkpoint


class _TorchWithLoad:
    """``torch`` with ``load`` replaced (see :func:`_full_dict_reads`)."""

    def __init__(self, load: Any):
        self.load = load

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def _full_dict_reads(io: Any, weights_only: bool | None) -> Any:
    """While a non-sharded FSDPStrategy / ModelParallelStrategy loads a full checkpoint dict with its
    own code (``_lazy_load`` in ``pytorch/strategies/fsdp.py:631``, ``torch.load`` in
    ``fabric/strategies/model_parallel.py:466``), a path holding a unickpt pointer is read through
    ``io.load_checkpoint``; anything else goes to the original readers."""
    import lightning.fabric.strategies.model_parallel as fabric_mp
    import lightning.pytorch.strategies.fsdp as pl_fsdp

    def ours(path: Any) -> bool:
        return is_unickpt_file(path)

    original_lazy, original_torch = pl_fsdp._lazy_load, fabric_mp.torch

    def lazy_load(path: Any, *args: Any, **kwargs: Any) -> Any:
        return io.load_checkpoint(path, weights_only=weights_only) if ours(path) else original_lazy(path, *args, **kwargs)

    def torch_load(path: Any, *args: Any, **kwargs: Any) -> Any:
        if ours(path):
            return io.load_checkpoint(path, weights_only=kwargs.get("weights_only", weights_only))
        return torch.load(path, *args, **kwargs)

    # replaced on purpose while the strategy reads (a module attribute and a module: typed as Lightning's)
    pl_fsdp._lazy_load, fabric_mp.torch = lazy_load, _TorchWithLoad(torch_load)  # type: ignore[assignment]
    try:
        yield
    finally:
        pl_fsdp._lazy_load, fabric_mp.torch = original_lazy, original_torch


def _optimizers(strategy: Any) -> list:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return [o._optimizer if isinstance(o, LightningOptimizer) else o for o in strategy.optimizers]


def _live_state(strategy: Any, with_optimizers: bool) -> dict[str, Any]:
    """``{"state_dict": model, "optimizer_<i>": optimizer}`` as unickpt state leaves
    (:mod:`unickpt.fsdp`: FSDP2 modules as they are, FSDP1 as flat-parameter slices; the fqns are
    ``model.state_dict()`` names either way, so FSDP1 and FSDP2 checkpoints load into each other)."""
    from unickpt.fsdp import model_state, optimizer_state

    model = strategy.model
    state: dict[str, Any] = {MODEL_KEY: model_state(model)}
    if with_optimizers:
        state.update({f"optimizer_{i}": optimizer_state(model, opt) for i, opt in enumerate(_optimizers(strategy))})
    return state


def save_sharded(io: Any, strategy: Any, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
    """Save ``checkpoint`` of a sharded strategy at ``filepath`` (collective over the default group).

    The model and optimizer states are taken from the live ``strategy.model`` and optimizers (the
    sharded state dicts in ``checkpoint`` are dropped unused: Lightning's FSDP1 optimizer state is
    a ``ShardedTensor`` dict that unickpt does not store); optimizers are saved only when
    ``checkpoint`` has ``optimizer_states``. ``filepath`` is a directory, made before this returns,
    holding the versions and the pointer (:mod:`._pointers`); each save is a whole checkpoint.
    """
    io._raise_errors()
    path = fspath(strategy.broadcast(os.fspath(filepath)))
    options = io._options(storage_options)
    storage = ext.open_storage(path, options)
    meta = {k: v for k, v in checkpoint.items() if k not in (MODEL_KEY, "optimizer_states")}
    if not io._save_pickle():
        refuse_pickles(path, split(meta, take_tensors=False)[0])
    # encoded here, tensors inline: global rank 0's values, as in Lightning's meta.pt (handed to the
    # engine as one plain value; its own traversal would treat the tensors as replicated leaves)
    tree = ext.Codec.encode(split(meta, take_tensors=False)[0], allow_pickle=io._save_pickle(), key=TREE_KEY)
    with_optimizers = "optimizer_states" in checkpoint
    state = _live_state(strategy, with_optimizers)
    engine = ext.engine()
    step = global_step(checkpoint)
    state[TREE_KEY] = tree
    target: tuple[int, str] | None = None
    created = False
    if engine.rank == 0:  # P is a directory when the save returns, as with Lightning's own (its version counter asks)
        created = not storage.exists(path)
        storage.makedirs(_pointers.data_root(storage, path))
        version = io._version_for(storage, path)
        target = (version, _pointers.version_dir(storage, path, version))
    agreed = engine.broadcast(target)
    assert agreed is not None  # group rank 0 set it above
    version, vdir = agreed
    pointer = Pointer(_pointers.relative(path, vdir), route="sharded", global_step=step)
    try:
        handle = engine.save(vdir, state, async_save=io.async_save, storage_options=options, step=step,
                             framework=FRAMEWORK, extra={"lightning_route": "sharded", "tensors_from": None},
                             on_commit=io._sharded_publisher(path, version, pointer, options),
                             allow_pickle=io._save_pickle(), on_error=io._on_engine_error)
    except BaseException:  # refused (an earlier save's failure) or failed at the call: no P of ours stays
        if created:
            _drop_if_empty(storage, path)
        raise
    def done(f: Any) -> None:
        unregister(path, handle)
        if created and f.exception() is not None:  # the failed version is gone (the engine removed it)
            _drop_if_empty(storage, path)

    register(path, handle)
    handle._future.add_done_callback(done)
    io._track(path, handle)
    if not io.async_save:
        io._wait(path)


def _drop_if_empty(storage: ext.StorageBackend, path: str) -> None:
    """Global rank 0, after the first save of ``P`` failed: remove the directory ``P`` it made, if it
    holds nothing (the failed version was removed), so that a listing shows no checkpoint that does
    not exist. A ``P`` holding anything is left alone."""
    try:
        if storage.isdir(path) and not storage.listdir(path):
            storage.rm(path)
    except OSError:  # best effort: an empty directory, no data
        log.warning("unickpt: could not remove the empty checkpoint directory %s of a failed save", path, exc_info=True)


def load_sharded(io: Any, strategy: Any, checkpoint_path: Any, weights_only: bool | None = None,
                 original: Any = None) -> dict:
    """Load a sharded-route checkpoint into ``strategy.model`` (and its optimizers while fitting),
    resharded to the current world size and mesh; return the rest of the checkpoint dict (what
    Lightning's own sharded load returns from ``meta.pt``). Collective over the default group.

    A path that is not a unickpt pointer (Lightning's own sharded directory or full ``.ckpt``) is
    read by ``original`` (Lightning's method) when given. Raises ValueError if the checkpoint was
    saved through the plain ``CheckpointIO`` route (a full dict),
    StateMismatchError (from unickpt) if keys, shapes or dtypes do not match; missing or
    unexpected model keys are allowed when ``LightningModule.strict_loading`` is False.
    """
    from lightning.pytorch.trainer.states import TrainerFn

    io._wait()
    path = fspath(strategy.broadcast(os.fspath(checkpoint_path)))
    options = io._options(None)
    engine = ext.engine()
    foreign = engine.broadcast(_foreign(path, options) if engine.rank == 0 else None)
    if foreign is not None:  # written by another framework: through its layout (docs/cross-framework.md)
        return load_foreign(io, strategy, foreign, options)
    pointer = agree_pointer(engine, path, options, foreign=("file", "dir") if original is not None else ())
    if pointer is None:  # Lightning's own checkpoint (before unickpt was turned on): Lightning's own reader
        return original(strategy, checkpoint_path, weights_only=weights_only)
    if pointer.route != "sharded":
        raise ValueError(f"{path!r} holds a full checkpoint dict (saved through CheckpointIO, route "
                         f"{pointer.route!r}); {type(strategy).__name__} with sharded state loads sharded-route "
                         "checkpoints only")
    vdir = _pointers.resolve(path, pointer.checkpoint)
    module = strategy.lightning_module
    state = _live_state(strategy, with_optimizers=module.trainer.state.fn == TrainerFn.FITTING)
    state[TREE_KEY] = None
    source = vdir if pointer.tensors_from is None else _pointers.resolve(path, pointer.tensors_from)
    engine.load(source, state, strict=bool(module.strict_loading), storage_options=options, verify=io.verify)
    if source != vdir:  # a link: the tensors came from the checkpoint it names, the rest is its own
        state = {TREE_KEY: None}
        engine.load(vdir, state, strict=True, storage_options=options, verify=io.verify)
    allow = io._load_pickle(weights_only)
    found = [] if allow else pickled(state[TREE_KEY])
    if found:
        raise unsafe_error(path, found, saving=False)
    tree = ext.Codec.decode(state[TREE_KEY], allow_pickle=allow, key=TREE_KEY)
    return join(tree, functools.partial(_no_tensor, path))


def _no_tensor(path: str, tag: dict) -> torch.Tensor:
    """The ``tensor_for`` of :func:`join` for a sharded-route tree, which holds its tensors inline (no placeholder)."""
    raise ValueError(f"{path!r}: damaged checkpoint: a tensor placeholder {tag.get(TENSOR_TAG)!r} in its "
                     f"{TREE_KEY!r} tree, which holds its tensors inline")


def _foreign(path: str, options: dict | None) -> str | None:
    """The committed unickpt checkpoint another framework wrote behind ``path`` (an Accelerate
    ``checkpoint_<N>`` folder, a DeepSpeed ``save_dir`` or tag, a ``unickpt.save`` directory), or None
    (a Lightning pointer or pack, Lightning's own files, nothing)."""
    storage = ext.open_storage(path, options)
    if not storage.isdir(path) or _pointers.claims_format(storage, path):
        return None  # pointers and packs are Lightning's
    found = interop.locate_checkpoint(path, storage)
    if not ext.CheckpointDir(storage, found).is_committed():
        return None
    return found if ext.CheckpointDir.open(found, options).read_metadata().framework != FRAMEWORK else None


def load_foreign(io: Any, strategy: Any, path: str, options: dict | None) -> dict:
    """Load a checkpoint written by another framework into ``strategy.model``, its optimizer and LR
    scheduler (while fitting), resharded, through the checkpoint's layout; return the checkpoint dict
    Lightning restores its loops from: the source's training step, its completed epochs (0 when it
    counts none) and the restored scheduler state. The run resumes at an epoch boundary: the position
    inside an epoch is not portable. Collective. Raises StateMismatchError naming what cannot move."""
    from lightning.pytorch.trainer.states import TrainerFn

    module = strategy.lightning_module
    trainer = module.trainer
    fitting = trainer.state.fn == TrainerFn.FITTING
    state = _live_state(strategy, with_optimizers=fitting)
    configs = trainer.lr_scheduler_configs if fitting else []
    if len(configs) > 1:
        raise StateMismatchError(f"{path!r}: this LightningModule has {len(configs)} LR schedulers; a checkpoint of another "
                        "framework carries one")
    if configs:
        state["lr_scheduler"] = configs[0].scheduler
    stats = ext.engine().load(path, state, strict=bool(module.strict_loading), storage_options=options,
                              verify=io.verify, mapping="auto")
    values = stats.conversion_values or {}
    step = values.get("step")
    if step is None:  # a framework that counts no training step (Accelerate): the optimizer's own, just loaded
        steps = [float(st["step"]) for o in _optimizers(strategy) for st in o.state.values() if "step" in st]
        step = int(max(steps)) if steps else 0
    step, epochs = int(step), int(values.get("epoch") or 0)
    if ext.engine().rank == 0:
        conversion = stats.conversion or {}
        log.info("unickpt.lightning: loaded %s, written by %s, at step %d (%d epochs): %s", path,
                 conversion.get("from"), step, epochs, conversion)
    import lightning

    return {"epoch": epochs, "global_step": step, "pytorch-lightning_version": lightning.__version__,
            "loops": _loops(trainer, step, epochs), "lr_schedulers": [c.scheduler.state_dict() for c in configs],
            "callbacks": {}}


def _loops(trainer: Any, step: int, epochs: int) -> dict:
    """Lightning's loop state of a run that has taken ``step`` optimizer steps over ``epochs`` finished
    epochs and stands at the start of the next one (the progress counters ``trainer.global_step``,
    ``current_epoch`` and the loops' restart logic read)."""
    loops = {"fit_loop": trainer.fit_loop.state_dict(), "validate_loop": trainer.validate_loop.state_dict(),
             "test_loop": trainer.test_loop.state_dict(), "predict_loop": trainer.predict_loop.state_dict()}
    fit = loops["fit_loop"]

    def fill(progress: dict, total: int, current: int) -> None:
        for part, n in (("total", total), ("current", current)):
            for k in progress.get(part, {}):
                progress[part][k] = n

    fill(fit["epoch_progress"], epochs, epochs)
    fill(fit["epoch_loop.batch_progress"], step, 0)
    fit["epoch_loop.batch_progress"]["is_last_batch"] = False
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] = step
    optim = fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    fill(optim["step"], step, 0)
    fill(optim["zero_grad"], step, 0)
    return loops


def deepspeed_config(config: dict, io: Any) -> dict:
    """``config`` (a DeepSpeed JSON config dict) with unickpt's ``"unickpt"`` block enabled, so the
    DeepSpeed engine built from it saves and loads through :mod:`unickpt.deepspeed`; a block the user
    already wrote is kept. Installs the DeepSpeed patch (before the engine exists)."""
    from unickpt.deepspeed import install as install_deepspeed

    install_deepspeed()
    out = dict(config)
    block = out.get("unickpt")
    if not isinstance(block, dict):
        out["unickpt"] = {"enabled": True, "async_save": bool(io.async_save)}
    return out


def _wrap_deepspeed_setup(original: Any) -> Any:
    @functools.wraps(original)
    def setup(self: Any, trainer: Any) -> None:
        io = unickpt_io(self)
        if io is not None:
            self._init_config_if_needed()  # Lightning's own config, completed from the trainer (idempotent)
            self.config = deepspeed_config(self.config, io)
        return original(self, trainer)

    setattr(setup, _MARK, True)
    return setup
