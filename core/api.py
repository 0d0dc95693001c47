"""``unickpt.save`` and ``unickpt.load``: one checkpoint directory, collective over a process group."""
from __future__ import annotations

import os
from typing import Any

from .engine import SaveHandle, get_engine
from .loading.stats import LoadStats
from .options import LoadOptions, SaveOptions
from .requests import LoadRequest, SaveRequest

__all__ = ["save", "load"]


def save(path: str | os.PathLike, state: dict, *, async_save: bool = False, process_group: Any = None,
         storage_options: dict | None = None, step: int | None = None, framework: str | None = None,
         allow_pickle: bool = False, options: SaveOptions | None = None) -> SaveHandle:
    """Save ``state`` to the directory ``path``; collective over ``process_group`` (default: world).

    Args:
        path: a new directory (local path or fsspec URL). An incomplete directory left by a failed
            save is replaced; a committed one raises CheckpointExistsError.
        state: a nested dict; leaves as described in :mod:`unickpt.state` (tensors, DTensors,
            :class:`~unickpt.Shard`, :class:`~unickpt.PerRank`, modules, optimizers, stateful
            objects, plain values). Replicated tensors are written once.
        async_save: return as soon as the state is snapshotted into host memory (the only blocking
            part); writing and the commit continue in the background. Changing tensors after the
            return cannot reach the checkpoint.
        process_group: the ranks taking part; every one of them must call ``save``.
        storage_options: passed to the fsspec filesystem.
        step, framework: recorded in ``metadata.json``.
        allow_pickle: store plain values of classes that have no JSON or tensor form as pickles
            (loading them then needs ``allow_pickle=True`` too). Off: such a value raises
            UnsafeObjectError naming its key.
        options: how this save runs (:class:`~unickpt.SaveOptions`: staging ring size, snapshot mode,
            writer, flat-range merging, two-tier upload, ...); default: the group engine's defaults.

    Returns:
        a :class:`SaveHandle`; ``wait()`` blocks until committed and raises the save's error.
        ``handle.stats.stall_s`` is the time this call blocked.

    Raises:
        SaveFailedError: (sync saves, or planning failures) naming every failed rank and why.
        EarlierSaveFailedError: (a ``SaveFailedError``) an earlier ``async_save`` of the group failed
            after its call returned and was not reported yet: raised on every rank by the next
            ``save`` (this one then saves nothing) or ``load`` of the group, naming that save's path
            (docs/design.md, "Failures of asynchronous saves").
        StateMismatchError: ranks disagree on a tensor's dtype or global shape.
    """
    request = SaveRequest(os.fspath(path), async_save=async_save, storage_options=storage_options, step=step,
                          framework=framework, allow_pickle=allow_pickle, options=options)
    return get_engine(process_group).save(request, state)


def load(path: str | os.PathLike, state: dict, *, strict: bool = True, process_group: Any = None,
         storage_options: dict | None = None, allow_pickle: bool = False, verify: bool | None = None,
         redistribute: bool | None = None, options: LoadOptions | None = None, mapping: Any = None) -> LoadStats:
    """Load the checkpoint at ``path`` into ``state`` in place, resharding to the current layout.

    Collective over ``process_group``. Tensors (and DTensor / Shard local shards) are filled in
    place from exactly the stored byte ranges that overlap them, whatever the world size or
    placements at save time; non-tensor
    leaves are replaced in their dicts; modules, optimizers and stateful objects get
    ``load_state_dict``; :class:`~unickpt.PerRank` state is restored per rank.

    Args:
        strict: missing or unexpected keys are errors (else only common keys are loaded).
        allow_pickle: allow objects that were stored as pickles (arbitrary classes) to be
            unpickled. Off by default: unpickling can execute code.
        verify: check every byte used against its checksum block (partial reads are widened to
            whole blocks of at least 1 MiB; small chunks are read whole). Default True.
        redistribute: read each stored byte once job-wide and send it over the group to the other
            ranks that need it (zero-redundancy loading). Default: on for remote (fsspec) storage or
            ranks on several hosts, off for local storage on one host, where the page cache already
            reads each byte from the device once. ``UNICKPT_LOAD_REDISTRIBUTE=0/1`` overrides.
        options: how this load runs (:class:`~unickpt.LoadOptions`: ``verify``, ``redistribute``,
            read buffer and read threads); ``verify`` / ``redistribute`` given here override it.
        mapping: load a checkpoint written under another framework (docs/cross-framework.md):
            ``"auto"`` matches the stored roles (weights, fp32 master copies, optimizer moments and
            steps, param groups, LR scheduler, step counter) with the state's, wrapper prefixes
            (``module.``, ``_orig_mod.``, ...) dropped; a :class:`~unickpt.Mapping` adds declared rules
            (:class:`~unickpt.Rename`, :class:`~unickpt.Split`, :class:`~unickpt.Fuse`,
            :class:`~unickpt.Permute`). ``path`` may then also be a framework's own handle of a
            checkpoint (a DeepSpeed ``save_dir``, an Accelerate ``checkpoint_<N>`` folder, a Lightning
            pointer, a Megatron checkpoint directory). Every rank still reads only the stored byte
            ranges its own shards need. ``stats.conversion`` reports what moved and what stayed.

    Returns:
        this rank's :class:`~unickpt.LoadStats` (bytes read from storage, bytes received and sent
        over the group, read requests, seconds per stage).

    Raises:
        CheckpointNotFoundError: no ``metadata.json`` (an uncommitted or missing checkpoint).
        FormatVersionError: an unknown format version.
        StateMismatchError: keys, dtypes or shapes differ (dtype and shape are never converted).
        PerRankReshardError: per-rank state saved at another world size without a reshard rule.
        IntegrityError: a checksum mismatch, a truncated or missing file, malformed metadata.
        LoadFailedError: ranks failed with different errors (each rank's traceback attached).
        UnsafeObjectError: a pickled object and ``allow_pickle=False``.
        TypeError / ValueError: ``options`` or ``mapping`` of the wrong kind or with bad values on some
            rank (raised on every rank, naming the rank), or ranks passing different ``redistribute``.
    """
    request = LoadRequest.of(path, strict=strict, storage_options=storage_options, allow_pickle=allow_pickle,
                             verify=verify, redistribute=redistribute, options=options, mapping=mapping)
    return get_engine(process_group).load(request, state)
