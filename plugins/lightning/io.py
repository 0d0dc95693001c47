"""``UnickptCheckpointIO``: Lightning's ``CheckpointIO`` on the unickpt engine.

Lightning calls a ``CheckpointIO`` with the full checkpoint dict on global rank 0 (save, remove)
and on every rank (load). Sharded strategies (``ModelParallelStrategy``,
``FSDPStrategy(state_dict_type="sharded")``) bypass ``CheckpointIO``; constructing a
``UnickptCheckpointIO`` installs the route that sends them here too (:mod:`._strategies`).

Storage layout: one file per checkpoint (:mod:`unickpt.lightning._pack`) for full dicts; the pointer
layout of sharded routes (versions, links): :mod:`unickpt.lightning._layout`.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
import warnings
import weakref
from typing import Any, Callable

import torch
from lightning.fabric.plugins import CheckpointIO

from unickpt import CheckpointNotFoundError, EarlierSaveFailedError, SaveHandle, UnsafeObjectError, ext

from . import _layout, _pack
from ._layout import Pointer
from ._tree import _ODICT_TAG, TENSOR_TAG, join, split

__all__ = ["UnickptCheckpointIO"]

log = logging.getLogger("unickpt.lightning")

FRAMEWORK = "lightning"
MEMORY_PREFIX = "unickpt-memory:"  # ckpt_path of a restore from the checkpoint tiers (see memory_ckpt_path)
TENSORS_KEY = "tensors"
TREE_KEY = "lightning"


class UnickptCheckpointIO(CheckpointIO):
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
            :attr:`failed_saves` counts them and :attr:`last_error` holds the latest.

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

    def __init__(self, *, async_save: bool = True, allow_pickle: bool | None = None,
                 storage_options: dict | None = None, dedup_last: bool = True, verify: bool = True,
                 memory_every: int | None = None, tiers: Any = None, on_error: str = "raise"):
        from ._strategies import install

        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        self.on_error = on_error
        self.failed_saves = 0
        self.last_error: BaseException | None = None
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
        self._lock = threading.Lock()
        self._pending: dict[str, list[SaveHandle]] = {}  # Lightning path -> saves not yet waited for
        self._errors: list[BaseException] = []  # failures of post-commit steps (pointer, cleanup)
        self._names: dict[str, str] = {}  # io route: staging directory -> the Lightning path it is saved to
        self._next_version: dict[str, int] = {}
        self._pending_links: dict[str, str] = {}  # Lightning path -> version dir its newest link save reads
        self.last_handle: SaveHandle | None = None
        _LIVE.add(self)
        install()

    def __getstate__(self) -> dict:
        """Only the configuration travels (``ddp_spawn`` pickles the strategy into each worker)."""
        state = {k: getattr(self, k) for k in ("async_save", "allow_pickle", "storage_options", "dedup_last", "verify",
                                               "memory_every", "on_error")}
        state["tiers"] = self.tiers_config
        return state

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # -- helpers --------------------------------------------------------------------------------------
    def _options(self, storage_options: Any) -> dict | None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}")
        merged = {**self.storage_options, **(storage_options or {})}
        return merged or None

    def _save_pickle(self) -> bool:
        return self.allow_pickle is not False

    def _load_pickle(self, weights_only: bool | None) -> bool:
        if self.allow_pickle is not None:
            return self.allow_pickle
        return weights_only is False

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _track(self, path: str, handle: SaveHandle, link: str | None = None) -> None:
        """Remember ``handle`` until waited for; finished saves are dropped here unless they failed
        unreported (kept for the next call to report), so a long run does not accumulate handles."""
        self.last_handle = handle
        with self._lock:
            for p in list(self._pending):
                self._pending[p] = [h for h in self._pending[p] if not h.done() or _unreported(h)]
                if not self._pending[p]:
                    del self._pending[p]
            self._pending.setdefault(path, []).append(handle)
            if link is not None:
                self._pending_links[path] = link
            self._pending_links = {p: t for p, t in self._pending_links.items() if p in self._pending}
            staged = {h.path for hs in self._pending.values() for h in hs}
            self._names = {st: p for st, p in self._names.items() if st in staged}

    def _report_finished(self) -> None:
        """Report the failures of this plugin's saves that have finished, not reported yet (see
        ``on_error``). For the io route (this process alone); on several ranks only the engine's next
        save can agree which saves have finished everywhere (a sharded save's failure is reported there)."""
        with self._lock:
            found = [(p, h) for p, hs in self._pending.items() for h in hs if _unreported(h)]
        self._report([(h.stats.step, p, _take(h)) for p, h in found])

    def _report(self, failed: list) -> None:
        """``failed``: ``[(global step, path, error)]``, each reported once: counted, then one
        EarlierSaveFailedError naming them all raised, or (``on_error="warn"``) one warning each."""
        failed = [f for f in failed if f[2] is not None]
        if not failed:
            return
        if self.on_error == "warn":
            for f in failed:
                one = EarlierSaveFailedError([f])
                one.__cause__ = f[2]
                self._on_engine_error(one)
            return
        error = EarlierSaveFailedError(failed)
        self.failed_saves += len(failed)
        self.last_error = error
        raise error from failed[0][2]

    def _named(self, error: EarlierSaveFailedError) -> EarlierSaveFailedError:
        """``error`` with each io-route save named by its Lightning path instead of its staging directory."""
        with self._lock:
            names = dict(self._names)
        if not any(path in names for _, path, _ in error.errors):
            return error
        named = EarlierSaveFailedError([(step, names.get(path, path), e) for step, path, e in error.errors])
        named.__cause__ = error.__cause__
        return named

    def _on_engine_error(self, error: BaseException) -> bool:
        """The engine found one of this plugin's saves failed (at its next save): count it; with
        ``on_error="warn"`` warn and report it handled."""
        error = self._named(error)
        self.failed_saves += 1
        self.last_error = error
        if self.on_error != "warn":
            return False
        lines = [line.strip() for line in str(error.__cause__ or error).splitlines() if line.strip()]
        warnings.warn(f"unickpt.lightning: the asynchronous save of {error.path!r} (global step {error.steps[0]}) "
                      f"failed ({lines[-1] if lines else ''}); on_error='warn': training goes on", RuntimeWarning,
                      stacklevel=2)
        return True

    def _wait(self, path: str | None = None) -> None:
        """Wait for this plugin's pending saves (of ``path``, or all); then report their failures not
        reported yet (see ``on_error``), then a failure of a post-commit step (pointer, cleanup)."""
        with self._lock:
            if path is None:
                handles = [(p, h) for p, hs in self._pending.items() for h in hs]
                self._pending = {}
            else:
                handles = [(path, h) for h in self._pending.pop(path, [])]
        for _, h in handles:
            h.outcome()
            _cleanup(h)
        self._report([(h.stats.step, p, _take(h)) for p, h in handles])
        self._raise_errors()

    def wait(self) -> None:
        """Block until every save started by this plugin in this process has committed and its
        pointer is written; raise EarlierSaveFailedError naming every failed save not reported yet
        (``on_error="warn"``: warn)."""
        self._wait()

    def _version_for(self, storage: ext.StorageBackend, path: str) -> int:
        """The next version number of ``path`` (one above any existing or in-flight version)."""
        with self._lock:
            known = self._next_version.get(path)
        found = _layout.versions(storage, path)
        v = max([known or 0] + [x + 1 for x in found] + [1])
        with self._lock:
            self._next_version[path] = v + 1
        return v

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
        path = _fspath(path)
        options = self._options(storage_options)
        tree, tensors = split(checkpoint)
        if not self._save_pickle():
            _refuse_pickles(path, tree)
        step = _global_step(checkpoint)
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
            handle = _io_engine().save(
                staged, state, async_save=True, step=step, framework=FRAMEWORK,
                extra={"lightning_route": "io", "lightning_name": os.path.basename(path.rstrip("/"))},
                on_commit=self._publisher(path, staged, options, step, published), allow_pickle=self._save_pickle(),
                on_error=self._on_engine_error)
        except BaseException as e:
            if placeholder:
                _drop_placeholder(path, options, token)
            _rm_staged(staged)
            if isinstance(e, EarlierSaveFailedError):  # an earlier save that finished meanwhile: its own name
                raise self._named(e) from e.__cause__
            raise
        _register(path, handle)
        _CLEANUPS[id(handle)] = _Once(lambda: _finish(path, handle, staged, options, token if placeholder else None,
                                                      published))
        handle._future.add_done_callback(lambda _f: _cleanup(handle))
        self._track(path, handle)
        if not self.async_save or not trainer_running():
            # nothing to overlap with outside a Trainer run (trainer.save_checkpoint after fit, a
            # script): finish it here, then give back the engine's threads and staging memory
            try:
                handle.wait()  # this save's own failure, as it is
                self._wait(path)
            finally:
                _release_io_engine()

    def _publisher(self, path: str, staged: str, options: dict | None, step: int | None,
                   published: list) -> Callable[[], None]:
        def publish() -> None:
            try:
                _pack.write_pack(path, staged, options, extra={"global_step": step})
                published.append(True)
                _collect_old_layout(path, options)
            except BaseException as e:  # raised on the caller's next call
                log.exception("unickpt.lightning: publishing %s failed", path)
                with self._lock:
                    self._errors.append(e)
        return publish

    def _publish(self, path: str, version: int, pointer: Pointer, options: dict | None) -> None:
        """Sharded route (the pointer layout of :mod:`._layout`), after the commit of ``version``
        (background thread, group rank 0): point ``path`` at it, then delete the versions it
        replaces (keeping those that sibling links still read)."""
        storage = ext.open_storage(path, options)
        if pointer.tensors_from is not None:
            source = _layout.resolve(path, pointer.tensors_from)
            if not ext.is_committed(storage, source):
                raise RuntimeError(f"{path!r}: the checkpoint it links to, {source!r}, did not commit; "
                                   f"{path!r} was not updated")
        old = _read_pointer_or_none(storage, path)
        _layout.write_pointer(storage, path, pointer)
        keep = {_layout.resolve(other, p.tensors_from)
                for other in _layout.siblings_linking_to(storage, path)
                for p in [_layout.read_pointer(storage, other)]}
        for v in _layout.versions(storage, path):
            vdir = _layout.version_dir(storage, path, v)
            if v < version and vdir not in keep:
                _rm_version(storage, vdir)
        if old is not None and old.tensors_from and old.tensors_from != pointer.tensors_from:
            _collect_link_target(storage, path, _layout.resolve(path, old.tensors_from))

    def _sharded_publisher(self, path: str, version: int, pointer: Pointer,
                           options: dict | None) -> Callable[[], None]:
        """The ``on_commit`` step of a sharded-route save (:func:`._strategies.save_sharded`)."""
        def publish() -> None:
            try:
                self._publish(path, version, pointer, options)
            except BaseException as e:  # raised on the caller's next call
                log.exception("unickpt.lightning: publishing %s failed", path)
                with self._lock:
                    self._errors.append(e)
        return publish

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
        checkpoint = self._load(path, map_location, weights_only, ext.engine() if multi else _Solo())
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
            _refuse_pickles("memory tier", tree)
        return {TENSORS_KEY: tensors, TREE_KEY: tree} if tensors else {TREE_KEY: tree}

    def _load_memory(self, map_location: Any, weights_only: bool | None) -> dict[str, Any] | None:
        """Every rank: the checkpoint dict of the newest step that every rank holds in memory (its
        node's or a peer's), or None (then the fallback path is loaded)."""
        if self.tiers is None:
            log.warning("unickpt.lightning: ckpt_path %r but no memory tiers are set up (memory_every)", MEMORY_PREFIX)
            return None
        templates: dict[str, Any] = {}

        def target(path: str) -> dict:
            template = _tensor_template(path, None)
            templates["t"] = template
            return {TENSORS_KEY: template, TREE_KEY: None} if template else {TREE_KEY: None}

        got = self.tiers.recover(target, allow_pickle=self._load_pickle(weights_only))
        if got is None:
            return None
        step, state, stats = got
        self.last_memory_load = (step, stats)
        template = templates["t"]
        move = _mover(map_location)
        log.info("unickpt.lightning: restored global step %d from the memory tiers (%s)", step, stats.tier)
        return join(state[TREE_KEY], lambda tag: move(template[tag[TENSOR_TAG]], tag.get("device")))

    def _load(self, path: Any, map_location: Any, weights_only: bool | None, engine: Any) -> dict[str, Any]:
        """:meth:`load_checkpoint` over ``engine``'s process group (``ext.engine(ext.THIS_PROCESS)``: this
        process alone, as ``LightningModule.load_from_checkpoint`` reads, see :mod:`._strategies`).

        First waits for every save of ``path`` still in flight in this process (any instance; on
        group rank 0, which wrote it, before the others read), then for a placeholder of another
        process to be replaced."""
        given, path = path, _fspath(path)
        options = self._options(None)
        if engine.world_size > 1:
            if engine.rank == 0:
                wait_for_saves(path)
            engine.broadcast(None)  # the others read after rank 0's saves of path committed
        else:
            wait_for_saves(path)
        self._raise_errors()
        what = _pack.kind(path, options)
        if what == "pending":
            doc = _pack.read_placeholder(path, options) or {}
            if doc.get("pid") == os.getpid() and _pack.placeholder_alive(doc):  # ours, and not in flight
                raise CheckpointNotFoundError(f"{path!r}: its save in this process never committed (see the "
                                              "error of that save); nothing was saved there")
            _pack.wait_placeholder(path, options, float(os.environ.get("UNICKPT_LIGHTNING_WAIT_S", "1800")))
            what = _pack.kind(path, options)
        if what == "missing":  # the message of Lightning's TorchCheckpointIO
            raise FileNotFoundError(f"Checkpoint file not found: {given}")
        if what == "pack":
            return self._load_pack(path, options, map_location, weights_only)
        if what == "pointer":  # the layout before packs (pointer file + P.unickpt/ versions)
            return self._load_pointer(path, options, map_location, weights_only, engine)
        if what == "dir":
            raise ValueError(f"{path!r} is a directory, not a unickpt or torch.save checkpoint file (a Lightning "
                             "sharded checkpoint? load it with the strategy that wrote it)")
        # a torch.save checkpoint (written before unickpt was turned on): read it as Lightning does
        from ._strategies import original_pl_load

        log.info("unickpt.lightning: %s is not a unickpt checkpoint; reading it with torch.load", path)
        return original_pl_load()(path, map_location=map_location or (lambda storage, loc: storage),
                                  weights_only=weights_only)

    def _load_pack(self, path: str, options: dict | None, map_location: Any,
                   weights_only: bool | None) -> dict[str, Any]:
        """Read the pack at ``path`` in this process alone (every rank reads the file itself, as
        ``torch.load`` does), through one open handle (a concurrent replacement is not seen)."""
        allow = self._load_pickle(weights_only)
        with _pack.open_pack(path, options) as (url, _index):
            template = _tensor_template(url, None)
            state: dict[str, Any] = {TENSORS_KEY: template, TREE_KEY: None} if template else {TREE_KEY: None}
            try:
                ext.load_solo(url, state, strict=True, allow_pickle=allow, verify=self.verify,
                                redistribute=False)
            except UnsafeObjectError as e:
                found = _pickled(ext.read_metadata(url).state_tree.get(TREE_KEY))
                raise (_unsafe(path, found, saving=False) if found else e) from None
        move = _mover(map_location)
        return join(state[TREE_KEY], lambda tag: move(template[tag[TENSOR_TAG]], tag.get("device")))

    def _load_pointer(self, path: str, options: dict | None, map_location: Any, weights_only: bool | None,
                      engine: Any) -> dict[str, Any]:
        """Read a checkpoint of the pointer layout (:mod:`._layout`; written by earlier releases)."""
        pointer = _agree_pointer(engine, path, options, foreign=("file",))
        if pointer is None:
            raise ValueError(f"{path!r} is not a unickpt-lightning checkpoint")
        if pointer.route != "io":
            raise ValueError(f"{path!r} was saved by a sharded strategy (route {pointer.route!r}); load it with the "
                             "same kind of strategy (ModelParallelStrategy / FSDPStrategy sharded)")
        vdir = _layout.resolve(path, pointer.checkpoint)
        allow = self._load_pickle(weights_only)
        try:
            if pointer.tensors_from is None:
                template = _tensor_template(vdir, options)
                state: dict[str, Any] = {TENSORS_KEY: template, TREE_KEY: None} if template else {TREE_KEY: None}
                engine.load(vdir, state, strict=True, storage_options=options, allow_pickle=allow, verify=self.verify)
            else:
                state = {TREE_KEY: None}
                engine.load(vdir, state, strict=True, storage_options=options, allow_pickle=allow, verify=self.verify)
        except UnsafeObjectError as e:
            found = _pickled(ext.read_metadata(vdir, options).state_tree.get(TREE_KEY))
            raise (_unsafe(path, found, saving=False) if found else e) from None
        if pointer.tensors_from is not None:
            source = _layout.resolve(path, pointer.tensors_from)
            template = _tensor_template(source, options)
            tstate = {TENSORS_KEY: template}
            engine.load(source, tstate, strict=False, storage_options=options, allow_pickle=allow, verify=self.verify)
        move = _mover(map_location)
        return join(state[TREE_KEY], lambda tag: move(template[tag[TENSOR_TAG]], tag.get("device")))

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (Lightning calls it on global rank 0), after its saves
        still in flight in this process: the file itself (a symlink is removed, not its target), as
        ``TorchCheckpointIO`` does. A pointer-layout checkpoint (sharded route, earlier releases)
        loses its pointer, then its versions, except those that a sibling link still reads."""
        path = _fspath(path)
        wait_for_saves(path, follow_links=False)
        self._wait(path)
        options = self._options(None)
        if "://" not in path and os.path.islink(path):
            os.remove(path)
            return
        if _pack.kind(path, options) != "pointer":
            _pack.remove_path(path, options)
            _collect_old_layout(path, options)
            return
        root = _layout.old_data_root(path) + "/"
        with self._lock:  # a link save still in flight must publish its pointer before its target is judged
            readers = [p for p, target in self._pending_links.items() if target.startswith(root) and p in self._pending]
        for p in readers:
            self._wait(p)
        storage = ext.open_storage(path, options)
        pointer = _read_pointer_or_none(storage, path)
        if pointer is None:
            if storage.exists(path):
                storage.rm(path)
            return
        storage.rm(path)
        if not _layout.siblings_linking_to(storage, path):
            storage.rm(_layout.data_root(storage, path))
        else:
            keep = {_layout.resolve(o, _layout.read_pointer(storage, o).tensors_from)
                    for o in _layout.siblings_linking_to(storage, path)}
            for v in _layout.versions(storage, path):
                if _layout.version_dir(storage, path, v) not in keep:
                    _rm_version(storage, _layout.version_dir(storage, path, v))
        if pointer.tensors_from:
            _collect_link_target(storage, path, _layout.resolve(path, pointer.tensors_from))

    def teardown(self) -> None:
        """Wait for every pending save (Lightning calls this when the strategy tears down, at the end
        of ``fit`` / ``validate`` / ...), then give back the saving engine's threads and staging
        memory (the next save starts them again), and close the checkpoint tiers (their memory
        copies stay for a restart)."""
        try:
            self._wait()
        finally:
            _release_io_engine()
            if self.tiers is not None:
                tiers, self.tiers = self.tiers, None
                tiers.close()


# -- module helpers ----------------------------------------------------------------------------------
_ENGINE: list[ext.EngineHandle] = []  # the engine of io-route saves (this process alone), while saves need it
_ENGINE_LOCK = threading.Lock()
_RUNNING = [0]  # Trainer runs in progress in this process (see trainer_running)


def _io_engine() -> ext.EngineHandle:
    """The engine that writes io-route saves (one process), started on first use."""
    with _ENGINE_LOCK:
        if not _ENGINE:
            _ENGINE.append(ext.new_engine(ext.THIS_PROCESS))
        return _ENGINE[0]


def _release_io_engine() -> None:
    """Close the io-route engine (its threads and staging buffers) if no save is in flight and no
    Trainer is running; the next save starts a new one."""
    with _ENGINE_LOCK:
        if not _ENGINE or _RUNNING[0] > 0:
            return
        with _INFLIGHT_LOCK:
            if any(not h.done() for hs in _INFLIGHT.values() for h in hs):
                return
        engine = _ENGINE.pop()
    try:
        engine.close()
    except BaseException:  # noqa: BLE001 - every save it ran was already waited for
        log.exception("unickpt.lightning: closing the save engine failed")


def trainer_running() -> bool:
    """Whether a ``Trainer`` run (``fit`` / ``validate`` / ``test`` / ``predict``) is in progress in
    this process (counted by the wrapper that :func:`._strategies.install` puts on ``Trainer._run``)."""
    return _RUNNING[0] > 0


def _run_started() -> None:
    with _ENGINE_LOCK:
        _RUNNING[0] += 1


def _run_ended() -> None:
    with _ENGINE_LOCK:
        _RUNNING[0] = max(0, _RUNNING[0] - 1)
        last = _RUNNING[0] == 0
    if last:  # the run's saves (also those a wrapping AsyncCheckpointIO handed over late) commit first
        with _INFLIGHT_LOCK:
            paths = list(_INFLIGHT)
        for p in paths:
            wait_for_saves(p, follow_links=False)
        _release_io_engine()


_INFLIGHT: dict[str, list[SaveHandle]] = {}  # Lightning path -> saves of it not finished (every instance)
_INFLIGHT_LOCK = threading.Lock()


def _register(path: str, handle: SaveHandle) -> None:
    with _INFLIGHT_LOCK:
        _INFLIGHT.setdefault(path, []).append(handle)


def _unregister(path: str, handle: SaveHandle) -> None:
    with _INFLIGHT_LOCK:
        left = [h for h in _INFLIGHT.get(path, []) if h is not handle]
        if left:
            _INFLIGHT[path] = left
        else:
            _INFLIGHT.pop(path, None)


def in_flight(path: Any) -> bool:
    """Whether a save of Lightning path ``path`` by any :class:`UnickptCheckpointIO` of this process
    has not finished."""
    with _INFLIGHT_LOCK:
        return bool(_INFLIGHT.get(_fspath(path)))


def wait_for_saves(path: Any, follow_links: bool = True) -> None:
    """Wait until no save of ``path`` (and, for a symlink, of its target) started in this process by
    any :class:`UnickptCheckpointIO` is in flight. Failures are not raised here (the saving instance
    raises them); a reader then finds the previous checkpoint, or none."""
    path = _fspath(path)
    paths = {path}
    if follow_links and "://" not in path:
        paths.add(os.path.realpath(path))
    while True:
        with _INFLIGHT_LOCK:
            handles = [h for p in paths for h in _INFLIGHT.get(p, [])]
        if not handles:
            return
        for h in handles:
            try:
                h._future.result()
            except BaseException:  # noqa: BLE001 - reported by the saving instance
                pass
            _cleanup(h)
            _unregister_everywhere(h)


def _unregister_everywhere(handle: SaveHandle) -> None:
    with _INFLIGHT_LOCK:
        for p in [p for p, hs in _INFLIGHT.items() if handle in hs]:
            left = [h for h in _INFLIGHT[p] if h is not handle]
            if left:
                _INFLIGHT[p] = left
            else:
                del _INFLIGHT[p]


_CLEANUPS: dict[int, "_Once"] = {}  # id(handle) -> its post-save cleanup (see _cleanup)


class _Once:
    """A cleanup that runs once; a second caller waits until the first one finished it."""

    def __init__(self, fn: Callable[[], None]):
        self.fn, self.lock, self.done = fn, threading.Lock(), False

    def __call__(self) -> None:
        with self.lock:
            if not self.done:
                self.done = True
                self.fn()


def _cleanup(handle: SaveHandle) -> None:
    """Run the cleanup of finished save ``handle`` (:func:`_finish`) unless it already ran; its done
    callback and every waiter call this, so a waiter sees the outcome on storage when it returns (a
    failed save's placeholder gone)."""
    once = _CLEANUPS.get(id(handle))
    if once is not None:
        once()
        _CLEANUPS.pop(id(handle), None)


def _finish(path: str, handle: SaveHandle, staged: str, options: dict | None, token: str | None,
            published: list) -> None:
    """After an io-route save finished: drop its staging copy and its in-flight entry; if it did not
    publish, remove the placeholder it wrote (the path had no checkpoint)."""
    try:
        if token is not None and not published:
            _drop_placeholder(path, options, token)
        _rm_staged(staged)
    except BaseException:  # noqa: BLE001 - a callback must not raise
        log.exception("unickpt.lightning: cleaning up after the save of %s failed", path)
    finally:
        _unregister(path, handle)


def _drop_placeholder(path: str, options: dict | None, token: str) -> None:
    doc = _pack.read_placeholder(path, options)
    if doc is not None and doc.get("token") == token:
        _pack.remove_path(path, options)


def _rm_staged(staged: str) -> None:
    import fsspec

    mem = fsspec.filesystem("memory")
    root = mem._strip_protocol(staged)
    if mem.exists(root):
        mem.rm(root, recursive=True)


def _collect_old_layout(path: str, options: dict | None) -> None:
    """Delete ``P.unickpt`` (the data of the pointer layout) once ``path`` no longer is a pointer and
    no sibling link reads it."""
    storage = ext.open_storage(path, options)
    root = _layout.old_data_root(path)
    if storage.exists(root) and not _layout.siblings_linking_to(storage, path):
        storage.rm(root)


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


def _unreported(handle: SaveHandle) -> bool:
    """A finished save whose failure was not reported yet."""
    return handle.done() and not handle.error_reported and handle.outcome() is not None


def _take(handle: SaveHandle) -> BaseException | None:
    """A finished save's failure, unless reported already; it is reported by the caller (once)."""
    if handle.error_reported:
        return None
    error = handle.outcome()
    if error is not None:
        handle.error_reported = True
    return error


def _refuse_pickles(path: str, tree: Any) -> None:
    """Raise :func:`_unsafe` if the tensor-free ``tree`` holds a value only pickle can store."""

    found = _pickled(ext.encode(tree, allow_pickle=True))
    if found:
        raise _unsafe(path, found, saving=True)


def _fspath(path: Any) -> str:
    p = os.fspath(path)
    return p if "://" in p else os.path.abspath(p)


def _global_step(checkpoint: Any) -> int | None:
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    return int(step) if isinstance(step, int) else None


def _read_pointer_or_none(storage: ext.StorageBackend, path: str) -> Pointer | None:
    try:
        return _layout.read_pointer(storage, path)
    except (OSError, ValueError):
        return None


def _rm_version(storage: ext.StorageBackend, vdir: str) -> None:
    ext.remove_checkpoint_dir(storage, vdir)  # uncommitted first: a half-deleted version is never loadable


def _collect_link_target(storage: ext.StorageBackend, link_path: str, target_vdir: str) -> None:
    """Delete ``target_vdir`` (a version another path's link read) once nothing needs it: its own
    pointer names another version (or is gone) and no sibling link reads it."""
    owner = target_vdir.rsplit("/", 1)[0]
    if not owner.endswith(_layout.DATA_SUFFIX):
        return
    owner_path = owner[: -len(_layout.DATA_SUFFIX)]
    current = _read_pointer_or_none(storage, owner_path)
    if current is not None and _layout.resolve(owner_path, current.checkpoint) == target_vdir:
        return
    for other in _layout.siblings_linking_to(storage, owner_path):
        p = _read_pointer_or_none(storage, other)
        if p is not None and p.tensors_from and _layout.resolve(other, p.tensors_from) == target_vdir:
            return
    _rm_version(storage, target_vdir)
    if current is None and not _layout.versions(storage, owner_path):
        storage.rm(owner)


def _pickled(encoded: Any, path: tuple = ()) -> list[tuple[str, str]]:
    """``(key path, class)`` of every pickled value in a codec-encoded checkpoint tree (for errors:
    ``hyper_parameters.args``, not just the top-level key)."""

    out: list[tuple[str, str]] = []
    if isinstance(encoded, list):
        for i, v in enumerate(encoded):
            out += _pickled(v, path + (i,))
    elif isinstance(encoded, dict):
        if len(encoded) == 1:
            (tag, body), = encoded.items()
            if tag == "__pickle__":
                return [(".".join(map(str, path)) or "<root>", str(body.get("type")))]
            if tag in ("__tuple__", "__set__", "__frozenset__"):
                return _pickled(body, path)
            if tag in ("__odict__", "__dict__"):
                for k, v in body:
                    try:
                        name = ext.decode(k)
                    except Exception:  # noqa: BLE001 - a pickled key: name it by position
                        name = "<key>"
                    out += _pickled(v, path + (name,))
                return out
            if tag == _ODICT_TAG:
                return _pickled(body.get("items"), path)
        for k, v in encoded.items():
            out += _pickled(v, path + (k,))
    return out


def _unsafe(path: str, found: list[tuple[str, str]], saving: bool) -> UnsafeObjectError:
    """The one-line error for pickled values in checkpoint ``path`` (``found`` from :func:`_pickled`)."""
    key, cls = found[0]
    more = f" (and {len(found) - 1} more such value(s))" if len(found) > 1 else ""
    what = f"{path!r}: checkpoint key {key!r} holds an object of class {cls}{more}"
    if saving:
        return UnsafeObjectError(f"{what}, which only pickle can store, and UnickptCheckpointIO(allow_pickle=False) "
                                 "forbids pickle; use allow_pickle=None/True or keep only plain values there")
    return UnsafeObjectError(f"{what}, which only unpickling restores (it can execute code); if you trust this "
                             "checkpoint pass weights_only=False (trainer.fit/validate/test(ckpt_path=..., "
                             "weights_only=False), load_from_checkpoint(..., weights_only=False)) or use "
                             "UnickptCheckpointIO(allow_pickle=True)")


class _Solo:
    """The "engine" of a load in this process alone (rank 0 of 1), without starting an engine."""

    rank, world_size = 0, 1

    def broadcast(self, obj: Any) -> Any:
        return obj

    def load(self, path: str, state: dict, **kwargs: Any) -> Any:
        return ext.load_solo(path, state, **kwargs)


def _agree_pointer(engine: Any, path: str, options: dict | None, foreign: tuple = ()) -> Pointer | None:
    """Group rank 0 reads the pointer (after its own pending saves committed) and every rank gets
    its reading, or the same error. ``foreign``: kinds of existing paths that are not unickpt
    pointers (``"file"``: e.g. a ``torch.save`` checkpoint; ``"dir"``: e.g. Lightning's own sharded
    checkpoint) for which every rank gets None instead of an error, so the caller reads them with
    Lightning's own reader."""
    result: Any = None
    if engine.rank == 0:
        storage = ext.open_storage(path, options)
        try:
            if not storage.exists(path):
                hint = ""
                if _layout.versions(storage, path):
                    hint = (f" (its data directory {_layout.data_root(storage, path)!r} exists: the pointer file was deleted "
                            "or never written, e.g. a crash before the first commit)")
                raise FileNotFoundError(f"no checkpoint at {path!r}{hint}")
            kind = "dir" if storage.isdir(path) else "file"
            if kind in foreign and not _layout.claims_format(storage, path):
                result = ("foreign",)
            else:
                result = ("ok", _layout.read_pointer(storage, path).to_bytes())
        except Exception as e:  # noqa: BLE001 - every rank must get it, or the others wait in the broadcast
            result = ("error", type(e).__name__, str(e))
    result = engine.broadcast(result)
    if result[0] == "foreign":
        return None
    if result[0] == "error":
        cls = {"FileNotFoundError": FileNotFoundError, "PermissionError": PermissionError}.get(result[1], ValueError)
        raise cls(result[2])
    import json

    return _layout.pointer_from_doc(path, json.loads(result[1]))


def _tensor_template(vdir: str, options: dict | None) -> dict[str, torch.Tensor]:
    """Empty CPU tensors of the stored dtypes and shapes, one per stored tensor under ``tensors``
    (tied tensors share one)."""
    meta = ext.read_metadata(vdir, options)
    prefix = TENSORS_KEY + "."
    out: dict[str, torch.Tensor] = {}
    for fqn, tm in meta.tensors.items():
        if fqn.startswith(prefix):
            out[fqn[len(prefix):]] = torch.empty(tuple(tm.shape), dtype=ext.str_to_dtype(tm.dtype))
    for alias, target in meta.aliases.items():
        if alias.startswith(prefix) and target.startswith(prefix):
            out[alias[len(prefix):]] = out[target[len(prefix):]]
    return out


def _mover(map_location: Any) -> Callable[[torch.Tensor, str | None], torch.Tensor]:
    """How a loaded CPU tensor saved on device ``saved`` moves, following ``torch.load``'s
    ``map_location``; a callable gets ``(storage, saved location)`` and returns a storage (its device
    is the target) or None (the saved device, as ``torch.load`` does)."""
    if map_location is None:
        return lambda t, saved: t
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        def move(t: torch.Tensor, saved: str | None) -> torch.Tensor:
            out = map_location(t.untyped_storage(), saved or "cpu")
            target = torch.device(saved or "cpu") if out is None else out.device
            return t if t.device == target else t.to(target)
        return move
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return lambda t, saved: t.to(device)
    if isinstance(map_location, dict):
        return lambda t, saved: t.to(map_location.get(saved, saved)) if saved in map_location else t
    raise TypeError(f"map_location must be None, a device, a device string, a dict of device strings or a "
                    f"callable (storage, location) -> storage, "
                    f"got {type(map_location).__name__}")
