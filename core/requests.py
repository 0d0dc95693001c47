"""What one ``save`` or ``load`` call asked for, built once at the public call (:func:`unickpt.save`,
:func:`unickpt.load`, :class:`unickpt.Checkpointer`, :class:`unickpt.ext.EngineHandle`) and passed
down whole through the engine to the :class:`~unickpt.saving.saver.Saver` or the
:class:`~unickpt.loading.loader.Loader`. Immutable; nothing here is checked yet: bad values are
raised by the collective part of the save or load, on every rank alike.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from .errors import EarlierSaveFailedError
from .options import LoadOptions, SaveOptions

__all__ = ["SaveRequest", "LoadRequest"]


@dataclass(frozen=True)
class SaveRequest:
    """One save call (see :func:`unickpt.save` for each argument).

    Attributes:
        path: the checkpoint directory (local path or fsspec URL).
        async_save: return once the state is snapshotted; write and commit in the background.
        storage_options: passed to the fsspec filesystem.
        step, framework, extra: recorded in ``metadata.json`` (``extra``: a JSON-able dict).
        allow_pickle: store plain values that have no JSON or tensor form as pickles.
        options: how this save runs; None: the engine's defaults.
        on_commit: called on group rank 0 (commit thread) right after the commit.
        on_error: ``on_error(EarlierSaveFailedError) -> bool``, called when a later call of the engine
            finds this save failed; True: handled, not raised.
    """

    path: str
    async_save: bool = False
    storage_options: dict | None = None
    step: int | None = None
    framework: str | None = None
    extra: dict = field(default_factory=dict)
    allow_pickle: bool = False
    options: SaveOptions | None = None
    on_commit: Callable[[], None] | None = None
    on_error: Callable[[EarlierSaveFailedError], bool] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))
        object.__setattr__(self, "extra", dict(self.extra or {}))


@dataclass(frozen=True)
class LoadRequest:
    """One load call (see :func:`unickpt.load` for each argument).

    Attributes:
        path: the checkpoint directory (local path or fsspec URL; with ``mapping``, also a framework's
            own handle of a checkpoint).
        strict: missing or unexpected keys are errors.
        storage_options: passed to the fsspec filesystem.
        allow_pickle: allow objects stored as pickles to be unpickled.
        options: how this load runs, with the call's ``verify`` / ``redistribute`` already merged in
            (:meth:`of`); checked by the load itself (TypeError / ValueError on every rank).
        mapping: None, ``"auto"`` or a :class:`unickpt.Mapping` (a cross-framework load); checked by
            the load itself.
    """

    path: str
    strict: bool = True
    storage_options: dict | None = None
    allow_pickle: bool = False
    options: LoadOptions = field(default_factory=LoadOptions)
    mapping: object = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))

    @classmethod
    def of(cls, path: str | os.PathLike, *, strict: bool = True, storage_options: dict | None = None,
           allow_pickle: bool = False, verify: bool | None = None, redistribute: bool | None = None,
           options: LoadOptions | None = None, mapping: object = None) -> LoadRequest:
        """The request of a load call: ``verify`` / ``redistribute``, when not None, override the fields
        of ``options`` (the one place the two are merged). Raises ValueError for a bad ``verify`` /
        ``redistribute`` value given with them."""
        opts = options if options is not None else LoadOptions()
        changes = {k: v for k, v in (("verify", verify), ("redistribute", redistribute)) if v is not None}
        if changes:
            opts = opts.with_(**changes)
        return cls(os.fspath(path), strict=strict, storage_options=storage_options, allow_pickle=allow_pickle, options=opts,
                   mapping=mapping)
