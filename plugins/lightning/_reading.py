"""Reading a Lightning checkpoint file: a pack, a placeholder being replaced, a pointer of the earlier
layout, or a ``torch.save`` file (with Lightning's own reader).

:class:`Reader` is what ``UnickptCheckpointIO.load_checkpoint`` and the ``pl_load`` route
(:mod:`._strategies`, a default reader in this process alone) run: wait for this process's saves of
the path, then read it by its kind (:func:`unickpt.lightning._pack.kind`). Tensors come back as CPU
tensors of the stored dtypes and shapes, moved as ``torch.load``'s ``map_location`` says
(:func:`mover`).
"""
from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from unickpt import CheckpointNotFoundError, UnsafeObjectError, ext

from . import _pack, _pointers
from ._inflight import fspath, wait_for_saves
from ._pickles import load_allowed, pickled, unsafe_error
from ._tree import TENSOR_TAG, TENSORS_KEY, TREE_KEY, join
from ._versions import agree_pointer

__all__ = ["Reader", "Solo", "tensor_template", "mover", "original_pl_load"]

log = logging.getLogger("unickpt.lightning")


@dataclass(frozen=True)
class Reader:
    """How checkpoints are read: fsspec ``storage_options`` (None: none), the trust model's
    ``allow_pickle`` (see ``UnickptCheckpointIO``) and ``verify`` (checksums of every byte read)."""

    storage_options: dict | None = None
    allow_pickle: bool | None = None
    verify: bool = True

    def read(self, path: Any, map_location: Any, weights_only: bool | None, engine: Any,
             after_wait: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """The checkpoint dict at ``path``, read over ``engine``'s process group (:class:`Solo`: this
        process alone, as ``LightningModule.load_from_checkpoint`` reads, see :mod:`._strategies`).

        First waits for every save of ``path`` still in flight in this process (any instance; on
        group rank 0, which wrote it, before the others read), then calls ``after_wait`` (the IO
        raises its post-commit failures there), then waits for a placeholder of another process to be
        replaced. Raises FileNotFoundError (missing), CheckpointNotFoundError (a save of this process
        that never committed), ValueError (a directory, a damaged file), UnsafeObjectError."""
        given, path = path, fspath(path)
        options = self.storage_options
        if engine.world_size > 1:
            if engine.rank == 0:
                wait_for_saves(path)
            engine.broadcast(None)  # the others read after rank 0's saves of path committed
        else:
            wait_for_saves(path)
        after_wait()
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
            return self._read_pack(path, options, map_location, weights_only)
        if what == "pointer":  # the layout before packs (pointer file + P.unickpt/ versions)
            return self._read_pointer(path, options, map_location, weights_only, engine)
        if what == "dir":
            raise ValueError(f"{path!r} is a directory, not a unickpt or torch.save checkpoint file (a Lightning "
                             "sharded checkpoint? load it with the strategy that wrote it)")
        # a torch.save checkpoint (written before unickpt was turned on): read it as Lightning does
        log.info("unickpt.lightning: %s is not a unickpt checkpoint; reading it with torch.load", path)
        return original_pl_load()(path, map_location=map_location or (lambda storage, loc: storage),
                                  weights_only=weights_only)

    def _read_pack(self, path: str, options: dict | None, map_location: Any,
                   weights_only: bool | None) -> dict[str, Any]:
        """Read the pack at ``path`` in this process alone (every rank reads the file itself, as
        ``torch.load`` does), through one open handle (a concurrent replacement is not seen)."""
        allow = load_allowed(self.allow_pickle, weights_only)
        with _pack.open_pack(path, options) as (url, _index):
            template = tensor_template(url, None)
            state: dict[str, Any] = {TENSORS_KEY: template, TREE_KEY: None} if template else {TREE_KEY: None}
            try:
                ext.load_solo(url, state, strict=True, allow_pickle=allow, verify=self.verify,
                                redistribute=False)
            except UnsafeObjectError as e:
                found = pickled(ext.CheckpointDir.open(url).read_metadata().state_tree.get(TREE_KEY))
                raise (unsafe_error(path, found, saving=False) if found else e) from None
        move = mover(map_location)
        return join(state[TREE_KEY], lambda tag: move(template[tag[TENSOR_TAG]], tag.get("device")))

    def _read_pointer(self, path: str, options: dict | None, map_location: Any, weights_only: bool | None,
                      engine: Any) -> dict[str, Any]:
        """Read a checkpoint of the pointer layout (:mod:`._pointers`; written by earlier releases)."""
        pointer = agree_pointer(engine, path, options, foreign=("file",))
        if pointer is None:
            raise ValueError(f"{path!r} is not a unickpt-lightning checkpoint")
        if pointer.route != "io":
            raise ValueError(f"{path!r} was saved by a sharded strategy (route {pointer.route!r}); load it with the "
                             "same kind of strategy (ModelParallelStrategy / FSDPStrategy sharded)")
        vdir = _pointers.resolve(path, pointer.checkpoint)
        allow = load_allowed(self.allow_pickle, weights_only)
        try:
            if pointer.tensors_from is None:
                template = tensor_template(vdir, options)
                state: dict[str, Any] = {TENSORS_KEY: template, TREE_KEY: None} if template else {TREE_KEY: None}
                engine.load(vdir, state, strict=True, storage_options=options, allow_pickle=allow, verify=self.verify)
            else:
                state = {TREE_KEY: None}
                engine.load(vdir, state, strict=True, storage_options=options, allow_pickle=allow, verify=self.verify)
        except UnsafeObjectError as e:
            found = pickled(ext.CheckpointDir.open(vdir, options).read_metadata().state_tree.get(TREE_KEY))
            raise (unsafe_error(path, found, saving=False) if found else e) from None
        if pointer.tensors_from is not None:
            source = _pointers.resolve(path, pointer.tensors_from)
            template = tensor_template(source, options)
            tstate = {TENSORS_KEY: template}
            engine.load(source, tstate, strict=False, storage_options=options, allow_pickle=allow, verify=self.verify)
        move = mover(map_location)
        return join(state[TREE_KEY], lambda tag: move(template[tag[TENSOR_TAG]], tag.get("device")))


class Solo:
    """The "engine" of a load in this process alone (rank 0 of 1), without starting an engine."""

    rank, world_size = 0, 1

    def broadcast(self, obj: Any) -> Any:
        """``obj`` (there is no other rank)."""
        return obj

    def load(self, path: str, state: dict, **kwargs: Any) -> Any:
        """:func:`unickpt.ext.load_solo`: load ``path`` into ``state`` in place; returns its LoadStats."""
        return ext.load_solo(path, state, **kwargs)


def tensor_template(vdir: str, options: dict | None) -> dict[str, torch.Tensor]:
    """Empty CPU tensors of the stored dtypes and shapes, one per stored tensor under ``tensors``
    (tied tensors share one)."""
    meta = ext.CheckpointDir.open(vdir, options).read_metadata()
    prefix = TENSORS_KEY + "."
    out: dict[str, torch.Tensor] = {}
    for fqn, tm in meta.tensors.items():
        if fqn.startswith(prefix):
            out[fqn[len(prefix):]] = torch.empty(tuple(tm.shape), dtype=ext.Codec.str_to_dtype(tm.dtype))
    for alias, target in meta.aliases.items():
        if alias.startswith(prefix) and target.startswith(prefix):
            out[alias[len(prefix):]] = out[target[len(prefix):]]
    return out


def mover(map_location: Any) -> Callable[[torch.Tensor, str | None], torch.Tensor]:
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


_ORIGINAL_PL_LOAD: list = []


def original_pl_load() -> Any:
    """Lightning's own ``lightning.fabric.utilities.cloud_io._load`` (its behaviour before
    :func:`unickpt.lightning._strategies.install`)."""
    if not _ORIGINAL_PL_LOAD:
        import lightning.fabric.utilities.cloud_io as cloud_io

        fn = cloud_io._load
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__, copy.__doc__ = fn.__kwdefaults__, fn.__doc__
        _ORIGINAL_PL_LOAD.append(copy)
    return _ORIGINAL_PL_LOAD[0]
