"""``UnickptCheckpointIO``: Lightning's ``CheckpointIO`` on the unickpt engine.

Lightning calls a ``CheckpointIO`` with the full checkpoint dict on global rank 0 (save, remove)
and on every rank (load). Sharded strategies (``ModelParallelStrategy``,
``FSDPStrategy(state_dict_type="sharded")``) bypass ``CheckpointIO``; constructing a
``UnickptCheckpointIO`` installs the route that sends them here too (:mod:`._strategies`).

Storage layout: one file per checkpoint (:mod:`unickpt.lightning._pack`) for full dicts; the pointer
layout of sharded routes (versions, links): :mod:`unickpt.lightning._pointers` and
:mod:`unickpt.lightning._versions`. The pending saves of an instance and their failures:
:mod:`._tracking`; what the process has in flight (any instance): :mod:`._inflight`; reading:
:mod:`._reading`; the trust model: :mod:`._pickles`.
"""
from __future__ import annotations

import atexit
import logging
import os
import uuid
import weakref
from typing import Any, Callable

from lightning.fabric.plugins import CheckpointIO

from unickpt import EarlierSaveFailedError, ext

from . import _pack, _pointers
from ._inflight import (drop_placeholder, finish_io_save, fspath, in_flight, io_engine, on_finished, register,
                        release_io_engine, rm_staged, trainer_running, wait_for_saves)
from ._pickles import load_allowed, refuse_pickles
from ._pointers import Pointer
from ._reading import Reader, Solo, mover, tensor_template
from ._strategies import install
from ._torchzip import TorchPickle, pickle_checkpoint
from ._tracking import SaveTracker
from ._tree import FRAMEWORK, TENSOR_TAG, TENSORS_KEY, TREE_KEY, global_step, join, split
from ._versions import collect_old_layout, publish_version, remove_pointer_checkpoint

__all__ = ["UnickptCheckpointIO", "MEMORY_PREFIX", "in_flight", "wait_for_saves"]

log = logging.getLogger("unickpt.lightning")

MEMORY_PREFIX = "unickpt-memory:"  # ckpt_path of a restore from the checkpoint tiers (see memory_ckpt_path)


class UnickptCheckpointIO(SaveTracker, CheckpointIO):
    """Save, load and remove Lightning checkpoints with unickpt.

    ``Trainer(plugins=[UnickptCheckpointIO()])`` (or ``Fabric(plugins=[...])`` with DDP or one
    device). Every checkpoint the Trainer writes or restores (``ModelCheckpoint``,
    ``trainer.save_checkpoint``, ``fit(ckpt_path=...)``, ``ckpt_path="last"``) then goes through
    unickpt. The whole checkpoint dict comes back exactly: epoch, global step, loop and callback
    state, optimizer states with their integer keys, LR schedulers, hyper-parameters, and
    ``OrderedDict._metadata`` (see :mod:`._tree`).

    Args:
        async_save: return from a save once the tensors are copied into host memory (the stall);
            writing and the commit go on in the background. A background save that failed is reported
            by the next save (when it has finished by then), or by the next load, remove, :meth:`wait`
            or :meth:`teardown` of its path (which wait for it): see ``on_error``.
        allow_pickle: values only pickle can store (objects of arbitrary classes, e.g. in
            hyper-parameters). ``None`` (default) follows ``torch.save`` / ``torch.load``, i.e.
            Lightning's own trust model: saving pickles them; loading unpickles them only when the
            caller passes ``weights_only=False`` (``trainer.fit(ckpt_path=..., weights_only=False)``),
            else raises ``unickpt.UnsafeObjectError`` naming the key and the class. ``True``: always
            allowed; ``False``: never (a save of such a value raises UnsafeObjectError).
        storage_options: fsspec options for remote paths (``s3://...``); Lightning's per-call
            ``storage_options`` are merged over them.
        dedup_last: accepted for compatibility, without effect: every checkpoint is whole (one
            file, or one directory for sharded routes), so it can be copied or removed alone, as
            with Lightning's own IO; links of earlier releases (a ``last`` checkpoint reading a
            sibling's tensors) still load. ``ModelCheckpoint(save_last="link")`` makes ``last`` a
            symbolic link instead of a second copy.
        verify: check every byte read against its checksum on load.
        memory_every: the checkpoint tiers (docs/tiers.md): a memory save of the whole checkpoint
            dict every this many optimizer steps (this rank's node memory, copied to a rank of
            another node), and a save of the current step on a preemption notice (``SIGTERM`` /
            ``SIGUSR1`` to any rank: ``<checkpoint dir>/preempted-step=<N>.ckpt``, then the fit
            stops). Restore with ``trainer.fit(..., ckpt_path=io.memory_ckpt_path(fallback))``.
            Run by :class:`~unickpt.lightning._tiers.UnickptTiersCallback` (put on the Trainer by
            the entry point).
        tiers: the other tier options (:class:`~unickpt.TierOptions`: memory directory, steps kept,
            memory bound, node id, signals, peer copies).
        on_error: how a failed background save is reported (each once, on every rank of a sharded
            save): ``"raise"`` (default) raises ``unickpt.EarlierSaveFailedError`` naming the
            checkpoint path(s) and global step(s), with the save's own error as ``__cause__`` (a
            save that raises it saved nothing); ``"warn"``: a ``RuntimeWarning`` per failed save, and
            training goes on. ``UNICKPT_LIGHTNING_ON_ERROR`` with the entry point. Either way
            :attr:`failed_saves` counts them and :attr:`last_error` holds the latest
            (:class:`~unickpt.lightning._tracking.SaveTracker`).

    A file that is not a unickpt pointer (a ``torch.save`` checkpoint from before unickpt was turned
    on) is read as ``TorchCheckpointIO`` reads it. Constructing the plugin also routes
    Lightning's reader ``pl_load`` (``LightningModule.load_from_checkpoint``) of unickpt files to
    unickpt (:mod:`._strategies`).

    Raises (on save/load): TypeError for a DTensor in a full checkpoint dict; ValueError for a
    damaged pointer (naming the field) or a directory; UnsafeObjectError naming the key inside the
    checkpoint (``'hyper_parameters.args'``) of a value the trust model refuses; the unickpt errors
    of :func:`unickpt.save` /
    :func:`unickpt.load` (``StateMismatchError``, ``IntegrityError``, ``UnsafeObjectError``, ...).
    """

    is_unickpt_io = True  # what :func:`unickpt.lightning._strategies.unickpt_io` looks for

    def __init__(self, *, async_save: bool = True, allow_pickle: bool | None = None,
                 storage_options: dict | None = None, dedup_last: bool = True, verify: bool = True,
                 memory_every: int | None = None, tiers: Any = None, on_error: str = "raise"):
        SaveTracker.__init__(self, on_error)
        self.memory_every, self.tiers_config = memory_every, tiers
        self.tier_options = None
        if memory_every is not None or tiers is not None:
            from unickpt import TierOptions

            opts = tiers or TierOptions()
            self.tier_options = opts.with_(**({"memory_every": memory_every} if memory_every is not None else {}))
        self.tiers: Any = None  # the TiersHandle, created at the Trainer's setup (UnickptTiersCallback)
        self.tiers_root: str | None = None
        self.preempted, self.preempted_path = False, None
        self.last_memory_load: Any = None  # (step, LoadStats) of the latest restore from memory
        self.async_save = bool(async_save)
        self.allow_pickle = allow_pickle
        self.storage_options = dict(storage_options or {})
        self.dedup_last = bool(dedup_last)
        self.verify = bool(verify)
        _LIVE.add(self)
        install()

    def __getstate__(self) -> dict:
        """Only the configuration travels (``ddp_spawn`` pickles the strategy into each worker)."""
        state = {k: getattr(self, k) for k in ("async_save", "allow_pickle", "storage_options", "dedup_last", "verify",
                                               "memory_every", "on_error")}
        state["tiers"] = self.tiers_config
        return state

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, **state)

    # -- helpers --------------------------------------------------------------------------------------
    def _options(self, storage_options: Any) -> dict | None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}")
        merged = {**self.storage_options, **(storage_options or {})}
        return merged or None

    def _save_pickle(self) -> bool:
        return self.allow_pickle is not False

    def _load_pickle(self, weights_only: bool | None) -> bool:
        return load_allowed(self.allow_pickle, weights_only)

    def _reader(self) -> Reader:
        return Reader(self._options(None), self.allow_pickle, self.verify)

    # -- CheckpointIO -----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Save the full checkpoint dict at ``path`` from this process alone (Lightning calls it on
        global rank 0). Returns once the tensors are snapshotted (``async_save``) or committed.

        When it returns, ``path`` exists: the previous checkpoint there until this one commits (then
        replaced atomically), or, for a new path, a placeholder that readers wait on (see
        :mod:`._pack`). A failed save leaves the previous checkpoint and removes its placeholder.

        First reports the failures of this plugin's earlier saves that have finished (``on_error``);
        raising, it saves nothing."""
        self._raise_errors()
        self._report_finished()
        path = fspath(path)
        options = self._options(storage_options)
        tree, tensors = split(checkpoint)
        if not self._save_pickle():
            refuse_pickles(path, tree)
        step = global_step(checkpoint)
        torch_pickle = _torch_pickle(path, tree, tensors)
        staged = _pack.staging_dir()
        state = {TENSORS_KEY: tensors, TREE_KEY: tree} if tensors else {TREE_KEY: tree}
        token = uuid.uuid4().hex
        placeholder = _pack.kind(path, options) == "missing"
        if placeholder:  # so that the path exists when this call returns (ModelCheckpoint's version counter)
            _pack.write_placeholder(path, options, token)
        published: list[bool] = []
        with self._lock:
            self._names[staged] = path
        try:
            handle = io_engine().save(
                staged, state, async_save=True, step=step, framework=FRAMEWORK,
                extra={"lightning_route": "io", "lightning_name": os.path.basename(path.rstrip("/"))},
                on_commit=self._publisher(path, staged, options, step, published, torch_pickle),
                allow_pickle=self._save_pickle(),
                on_error=self._on_engine_error)
        except BaseException as e:
            if placeholder:
                drop_placeholder(path, options, token)
            rm_staged(staged)
            if isinstance(e, EarlierSaveFailedError):  # an earlier save that finished meanwhile: its own name
                raise self._named(e) from e.__cause__
            raise
        register(path, handle)
        on_finished(handle, lambda: finish_io_save(path, handle, staged, options, token if placeholder else None,
                                                   published))
        self._track(path, handle)
        if not self.async_save or not trainer_running():
            # nothing to overlap with outside a Trainer run (trainer.save_checkpoint after fit, a
            # script): finish it here, then give back the engine's threads and staging memory
            try:
                handle.wait()  # this save's own failure, as it is
                self._wait(path)
            finally:
                release_io_engine()

    def _publisher(self, path: str, staged: str, options: dict | None, step: int | None,
                   published: list, torch_pickle: TorchPickle) -> Callable[[], None]:
        """The ``on_commit`` step of an io-route save: write the pack at ``path`` (``torch.load``
        reads it as the dict ``torch_pickle`` pickled), then collect the data of the earlier pointer
        layout."""
        def publish() -> None:
            _pack.write_pack(path, staged, options, extra={"global_step": step}, torch_pickle=torch_pickle)
            published.append(True)
            collect_old_layout(path, options)
        return self._guarded(path, publish)

    def _sharded_publisher(self, path: str, version: int, pointer: Pointer,
                           options: dict | None) -> Callable[[], None]:
        """The ``on_commit`` step of a sharded-route save (:func:`._strategies.save_sharded`):
        :func:`._versions.publish_version`."""
        return self._guarded(path, lambda: publish_version(path, version, pointer, options))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint dict saved at ``path`` (collective: every rank of the default process
        group calls it, as Lightning does; each gets the whole dict).

        ``map_location``: ``None`` (CPU, as Lightning's ``TorchCheckpointIO``), a device or device
        string, or a ``{saved device: device}`` dict. ``weights_only=False`` allows unpickling (see
        ``allow_pickle``). A file that is not a unickpt pointer (a ``torch.save`` checkpoint written
        before unickpt was turned on) is read as ``TorchCheckpointIO`` would. Waits for saves of
        ``path`` in flight (see :func:`wait_for_saves`). Raises ValueError for a damaged file or
        pointer or a directory, FileNotFoundError if ``path`` does not exist.
        """
        import torch.distributed as dist

        fallback = isinstance(path, str) and path.startswith(MEMORY_PREFIX)
        if fallback:
            restored = self._load_memory(map_location, weights_only)
            if restored is not None:
                return restored
            path = path[len(MEMORY_PREFIX):]
            if not path:
                raise FileNotFoundError("Checkpoint file not found: no step to restore in the memory tiers "
                                        "and no fallback path (memory_ckpt_path(fallback))")
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        engine = ext.engine() if multi else Solo()
        checkpoint = self._reader().read(path, map_location, weights_only, engine, after_wait=self._raise_errors)
        if fallback and self.tiers is not None and isinstance(checkpoint.get("global_step"), int):
            self.tiers.forget_newer(checkpoint["global_step"])  # memory copies of later steps: another future
        return checkpoint

    # -- the checkpoint tiers (docs/tiers.md, :mod:`._tiers`) --------------------------------------------
    @staticmethod
    def memory_ckpt_path(fallback: Any = "") -> str:
        """``ckpt_path`` for ``trainer.fit``: restore the newest step held in the memory tiers, else
        ``fallback`` (a checkpoint path; empty: none)."""
        return MEMORY_PREFIX + (os.fspath(fallback) if fallback else "")

    def memory_state(self, checkpoint: dict) -> dict:
        """The unickpt state of a memory save of ``checkpoint`` (what ``save_checkpoint`` saves)."""
        tree, tensors = split(checkpoint)
        if not self._save_pickle():
            refuse_pickles("memory tier", tree)
        return {TENSORS_KEY: tensors, TREE_KEY: tree} if tensors else {TREE_KEY: tree}

    def _load_memory(self, map_location: Any, weights_only: bool | None) -> dict[str, Any] | None:
        """Every rank: the checkpoint dict of the newest step that every rank holds in memory (its
        node's or a peer's), or None (then the fallback path is loaded)."""
        if self.tiers is None:
            log.warning("unickpt.lightning: ckpt_path %r but no memory tiers are set up (memory_every)", MEMORY_PREFIX)
            return None
        templates: dict[str, Any] = {}

        def target(path: str) -> dict:
            template = tensor_template(path, None)
            templates["t"] = template
            return {TENSORS_KEY: template, TREE_KEY: None} if template else {TREE_KEY: None}

        got = self.tiers.recover(target, allow_pickle=self._load_pickle(weights_only))
        if got is None:
            return None
        step, state, stats = got
        self.last_memory_load = (step, stats)
        template = templates["t"]
        move = mover(map_location)
        log.info("unickpt.lightning: restored global step %d from the memory tiers (%s)", step, stats.tier)
        return join(state[TREE_KEY], lambda tag: move(template[tag[TENSOR_TAG]], tag.get("device")))

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (Lightning calls it on global rank 0), after its saves
        still in flight in this process: the file itself (a symlink is removed, not its target), as
        ``TorchCheckpointIO`` does. A pointer-layout checkpoint (sharded route, earlier releases)
        loses its pointer, then its versions, except those that a sibling link still reads."""
        path = fspath(path)
        wait_for_saves(path, follow_links=False)
        self._wait(path)
        options = self._options(None)
        if "://" not in path and os.path.islink(path):
            os.remove(path)
            return
        if _pack.kind(path, options) != "pointer":
            _pack.remove_path(path, options)
            collect_old_layout(path, options)
            return
        self._wait_for_links_into(_pointers.old_data_root(path) + "/")
        remove_pointer_checkpoint(ext.open_storage(path, options), path)

    def teardown(self) -> None:
        """Wait for every pending save (Lightning calls this when the strategy tears down, at the end
        of ``fit`` / ``validate`` / ...), then give back the saving engine's threads and staging
        memory (the next save starts them again), and close the checkpoint tiers (their memory
        copies stay for a restart)."""
        try:
            self._wait()
        finally:
            release_io_engine()
            if self.tiers is not None:
                tiers, self.tiers = self.tiers, None
                tiers.close()


_LIVE: "weakref.WeakSet[UnickptCheckpointIO]" = weakref.WeakSet()


@atexit.register
def _wait_at_exit() -> None:
    """Let pending saves commit before the interpreter exits (e.g. the weights a ``ddp_spawn`` worker
    saves for the main process right before it returns); failures are logged."""
    for io in list(_LIVE):
        try:
            io.wait()
        except BaseException:  # noqa: BLE001 - nothing left to raise to
            log.exception("unickpt.lightning: a checkpoint save failed before exit")


def _torch_pickle(path: str, tree: Any, tensors: dict) -> TorchPickle:
    """``data.pkl`` of the checkpoint (caller's thread, at the save call), so that ``torch.load(path)``
    reads the checkpoint dict. Raises, before anything is written, ValueError naming the key for a
    tensor unickpt cannot store, and ``pickle.PicklingError`` naming the path and the key of a value
    ``pickle`` cannot store (which ``torch.save`` could not write either)."""
    import pickle

    try:
        return pickle_checkpoint(tree, tensors)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - pickle raises several types; the key is what helps
        raise pickle.PicklingError(f"{path!r}: the checkpoint dict holds a value pickle cannot store, at key "
                                   f"{_unpicklable_key(tree)!r} (torch.save could not write it either): {e}") from e


def _unpicklable_key(tree: Any, prefix: str = "") -> str | None:
    """The first key (dotted) of ``tree`` whose value ``pickle`` cannot store, or None."""
    import pickle

    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else None
    if items is None:
        try:
            pickle.dumps(tree, protocol=2)
            return None
        except Exception:  # noqa: BLE001
            return prefix or "<root>"
    for k, v in items:
        found = _unpicklable_key(v, f"{prefix}.{k}" if prefix else str(k))
        if found is not None:
            return found
    return None
