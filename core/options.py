"""How saves and loads run: :class:`SaveOptions`, :class:`LoadOptions`, and the environment.

Options are values, passed down with each save or load (``unickpt.save(..., options=...)``,
``unickpt.load(..., options=...)``, ``Checkpointer(save_options=..., load_options=...)``); nothing
below this module reads ``os.environ``. The environment (:class:`Env`) is read once per process, on
first use, and only gives the defaults of the options that a call does not set.

==============================  =========================================  =========================
variable                        default of                                 default
==============================  =========================================  =========================
``UNICKPT_POOL_BYTES``          :attr:`SaveOptions.pool_bytes`             a quarter of RAM / local ranks
``UNICKPT_CHECK_REPLICAS``      :attr:`SaveOptions.check_replicas`         ``"first"``
``UNICKPT_LOAD_REDISTRIBUTE``   :attr:`LoadOptions.redistribute` (0 / 1)   by storage and hosts
``UNICKPT_LOAD_BUFFER_BYTES``   :attr:`LoadOptions.read_buffer_bytes`      512 MiB
``UNICKPT_READ_THREADS``        :attr:`LoadOptions.read_threads`           4
``UNICKPT_COLLECTIVE_TIMEOUT_S`` :attr:`Env.collective_timeout_s`          1800
``UNICKPT_RETRY_TOTAL_S``       :attr:`Env.retry_total_s`                  120
``LOCAL_WORLD_SIZE``            ranks per host (set by ``torchrun``)       the group's world size
==============================  =========================================  =========================

Imports neither torch nor fsspec (the startup hook and the writer process import it).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["SaveOptions", "LoadOptions", "Env", "env", "check_options"]


@dataclass(frozen=True)
class Env:
    """The core's environment variables, read once per process (see the module docstring)."""

    pool_bytes: int | None = None
    check_replicas: str = "first"
    load_redistribute: bool | None = None
    load_buffer_bytes: int = 512 << 20
    read_threads: int = 4
    collective_timeout_s: float = 1800.0
    retry_total_s: float = 120.0
    local_world_size: int | None = None

    @classmethod
    def read(cls, environ: Any = None) -> "Env":
        """The settings of ``environ`` (default ``os.environ``). Raises ValueError naming a bad variable."""
        e = os.environ if environ is None else environ

        def number(name: str, kind: Any, default: Any) -> Any:
            raw = e.get(name, "").strip()
            if not raw:
                return default
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None

        redistribute = e.get("UNICKPT_LOAD_REDISTRIBUTE", "").strip()
        return cls(pool_bytes=number("UNICKPT_POOL_BYTES", int, None),
                   check_replicas=e.get("UNICKPT_CHECK_REPLICAS", "").strip() or "first",
                   load_redistribute={"0": False, "1": True}.get(redistribute),
                   load_buffer_bytes=number("UNICKPT_LOAD_BUFFER_BYTES", int, 512 << 20),
                   read_threads=number("UNICKPT_READ_THREADS", int, 4),
                   collective_timeout_s=number("UNICKPT_COLLECTIVE_TIMEOUT_S", float, 1800.0),
                   retry_total_s=number("UNICKPT_RETRY_TOTAL_S", float, 120.0),
                   local_world_size=number("LOCAL_WORLD_SIZE", int, None))


@functools.lru_cache(maxsize=None)
def env() -> Env:
    """This process's :class:`Env`, read on the first call."""
    return Env.read()


def check_options(options: Any, cls: type, call: str) -> Any:
    """``options`` if it is a ``cls``; TypeError naming what was passed otherwise (``call``: ``"save"``
    or ``"load"``, for the message)."""
    if not isinstance(options, cls):
        raise TypeError(f"{call}(options=...) takes a unickpt.{cls.__name__}, got {type(options).__name__} "
                        f"{options!r}")
    return options


def _check_types(opts: Any, kinds: dict[str, tuple]) -> None:
    """TypeError naming the field, the expected type and the value, for each field of the wrong type
    (``bool`` is not accepted where an int is expected)."""
    for name, types in kinds.items():
        value = getattr(opts, name)
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise TypeError(f"{type(opts).__name__}.{name} must be {want}, got {type(value).__name__} {value!r}")


def _replaced(opts: Any, kind: str, changes: dict) -> Any:
    unknown = sorted(set(changes) - {f.name for f in fields(opts)})
    if unknown:
        what = "save" if kind == "SaveOptions" else "load"
        raise ValueError(f"unknown {what} option(s) {unknown}; see unickpt.{kind}")
    return replace(opts, **changes).validated()


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs. ``SaveOptions()`` has the defaults (the environment's where it sets one, see
    :meth:`validated`); every field can be set per save (``unickpt.save(..., options=SaveOptions(...))``)
    or as an engine's default (:meth:`unickpt.ext.EngineHandle.configure`).

    Attributes:
        pool_bytes: bound of each of the two staging rings, bytes (a multiple of 1 MiB is used;
            at least ``2 * piece_bytes``). None: a quarter of physical memory shared by the ranks of
            this host (``unickpt.saving.staging.default_ring_bytes``). A rank's save larger than this
            streams through the ring.
        piece_bytes: the stager's step: it copies at most this much before handing it to the
            drain (and needs this much free ring space to go on).
        segment_bytes: data files are cut at this size (a larger chunk gets a file of its own);
            with ``upload_to`` a smaller size lets uploads overlap writes sooner.
        flat_ranges: ``"store"`` (flat-range shards stored as they are) or ``"merge"`` (merged
            into regular row blocks by point-to-point transfers; :mod:`unickpt.plan.merge`).
        snapshot: ``"sync"`` (the call returns once every byte is staged) or ``"overlap"`` (it returns
            at once; optimizer-owned tensors are staged while the loop runs its next forward/backward
            and ``optimizer.step()`` waits for them; :mod:`unickpt.saving.saver`).
        writer: ``"thread"`` (hash and write threads in this process) or ``"process"`` (a worker
            process on shared-memory rings; local storage only, else threads are used).
        direct_io: write local data files of at least 1 MiB with ``O_DIRECT`` (DMA from the ring,
            no copy into the page cache; file systems that refuse it, such as tmpfs, get buffered
            writes). On by default: measured here it keeps a save's time to durable within 1.2-1.3x
            of the disk's sequential bandwidth and the training loop's step-time interference at
            0-4 %, against 1.3-1.8x and 15-25 % for page-cache writes (benchmarks/README.md).
        overlap_drain: start checksumming and writing with the first staged piece (each stage
            overlapping the others); False: only once the snapshot is complete (or the ring is
            full), so that the drain does not compete with the snapshot for the CPU.
        upload_to: a directory URL; each checkpoint ``path`` is mirrored to
            ``upload_to/<basename(path)>`` and committed there first (two-tier saving).
        upload_options: fsspec storage options of ``upload_to``.
        background_nice: niceness of the drain threads / process (0: none).
        write_block: the writer's largest single write, bytes.
        check_replicas: compare the holders' copies of every chunk saved as replicated
            (:mod:`unickpt.saving.replicas`): ``"first"`` a sampled digest on the first save of each
            layout, ``"always"`` every byte on every save (a debug option), ``"off"`` never.
            Different copies raise ReplicaMismatchError on every rank. Default:
            ``UNICKPT_CHECK_REPLICAS`` or ``"first"``.

    Options that shape the plan or the commit (:meth:`plan_key`) must be equal on every rank of a
    save (it raises ValueError otherwise).
    """

    pool_bytes: int | None = None
    piece_bytes: int = 16 << 20
    segment_bytes: int = 1 << 30
    flat_ranges: str = "store"
    snapshot: str = "sync"
    writer: str = "thread"
    direct_io: bool = True
    overlap_drain: bool = True
    upload_to: str | None = None
    upload_options: dict | None = None
    background_nice: int = 0
    write_block: int = 16 << 20
    check_replicas: str | None = None

    def with_(self, **changes: Any) -> "SaveOptions":
        """A validated copy with ``changes``. Raises ValueError for unknown fields or bad values."""
        return _replaced(self, "SaveOptions", changes)

    def validated(self) -> "SaveOptions":
        """This, with ``pool_bytes`` and ``check_replicas`` taken from the environment where None (see
        the module docstring); raises ValueError naming the field for a bad value."""
        _check_types(self, {"pool_bytes": (int, type(None)), "piece_bytes": (int,), "segment_bytes": (int,),
                            "flat_ranges": (str,), "snapshot": (str,), "writer": (str,), "direct_io": (bool,),
                            "overlap_drain": (bool,), "upload_to": (str, type(None)),
                            "upload_options": (dict, type(None)), "background_nice": (int,), "write_block": (int,),
                            "check_replicas": (str, type(None))})
        opts = self
        if opts.pool_bytes is None and env().pool_bytes is not None:
            opts = replace(opts, pool_bytes=env().pool_bytes)
        if opts.check_replicas is None:
            opts = replace(opts, check_replicas=env().check_replicas)
        choices = {"check_replicas": ("first", "always", "off"), "flat_ranges": ("store", "merge"),
                   "snapshot": ("sync", "overlap"), "writer": ("thread", "process")}
        for name, allowed in choices.items():
            if getattr(opts, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(opts, name)!r}")
        if opts.piece_bytes < 4096 or opts.piece_bytes % 4096:
            raise ValueError(f"piece_bytes must be a positive multiple of 4096, got {opts.piece_bytes}")
        if opts.pool_bytes is not None and opts.pool_bytes < 2 * opts.piece_bytes:
            raise ValueError(f"pool_bytes ({opts.pool_bytes}) must be at least 2 * piece_bytes ({opts.piece_bytes})")
        if opts.segment_bytes < 1:
            raise ValueError(f"segment_bytes must be positive, got {opts.segment_bytes}")
        if opts.write_block < 4096:
            raise ValueError(f"write_block must be at least 4096, got {opts.write_block}")
        return opts

    def plan_key(self) -> tuple:
        """The options every rank must share (they shape the plan or the commit)."""
        return (self.flat_ranges, self.segment_bytes, self.upload_to, self.snapshot, self.check_replicas)


@dataclass(frozen=True)
class LoadOptions:
    """How a load runs (``unickpt.load(..., options=LoadOptions(...))``; fields left None take the
    environment's settings, see :meth:`validated`).

    Attributes:
        verify: check every byte used against its checksum block (partial reads are widened to
            whole blocks of at least 1 MiB; small chunks are read whole).
        redistribute: read each stored byte once job-wide and send it over the group to the other
            ranks that need it (zero-redundancy loading). None: on for remote (fsspec) storage or
            ranks on several hosts, off for local storage on one host, where the page cache already
            reads each byte from the device once (measured in benchmarks/load_bench.py).
        read_buffer_bytes: bound of this rank's read buffers per read/exchange round, bytes (reads
            straight into the caller's tensors do not count). Default 512 MiB.
        read_threads: ranged reads in flight per rank. Default 4.
    """

    verify: bool = True
    redistribute: bool | None = None
    read_buffer_bytes: int | None = None
    read_threads: int | None = None

    def with_(self, **changes: Any) -> "LoadOptions":
        """A validated copy with ``changes``. Raises ValueError for unknown fields or bad values."""
        return _replaced(self, "LoadOptions", changes)

    def validated(self) -> "LoadOptions":
        """This, with the fields that are None taken from the environment (see the module docstring;
        ``redistribute`` stays None, i.e. automatic, unless ``UNICKPT_LOAD_REDISTRIBUTE`` is 0 or 1);
        raises ValueError naming the field for a bad value."""
        _check_types(self, {"verify": (bool,), "redistribute": (bool, type(None)),
                            "read_buffer_bytes": (int, type(None)), "read_threads": (int, type(None))})
        e = env()
        opts = replace(self, redistribute=e.load_redistribute if self.redistribute is None else self.redistribute,
                       read_buffer_bytes=e.load_buffer_bytes if self.read_buffer_bytes is None else self.read_buffer_bytes,
                       read_threads=e.read_threads if self.read_threads is None else self.read_threads)
        if opts.read_buffer_bytes < 1:
            raise ValueError(f"read_buffer_bytes must be positive, got {opts.read_buffer_bytes}")
        if opts.read_threads < 1:
            raise ValueError(f"read_threads must be at least 1, got {opts.read_threads}")
        return opts
