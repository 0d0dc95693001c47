"""How saves and loads run: :class:`SaveOptions`, :class:`LoadOptions`, and the environment.

Options are values, passed down with each save or load (``unickpt.save(..., options=...)``,
``unickpt.load(..., options=...)``, ``Checkpointer(save_options=..., load_options=...)``); nothing
below this module reads ``os.environ``. The environment (:class:`Env`) is read once per process, on
first use, and only gives the defaults of the options that a call does not set.

==============================  =========================================  =========================
variable                        default of                                 default
==============================  =========================================  =========================
``UNICKPT_POOL_BYTES``          :attr:`SaveOptions.pool_bytes`             a quarter of RAM / local ranks
``UNICKPT_CHECK_REPLICAS``      :attr:`SaveOptions.check_replicas`         ``"sample"``
``UNICKPT_LOAD_REDISTRIBUTE``   :attr:`LoadOptions.redistribute` (0 / 1)   by storage and hosts
``UNICKPT_LOAD_BUFFER_BYTES``   :attr:`LoadOptions.read_buffer_bytes`      512 MiB
``UNICKPT_READ_THREADS``        :attr:`LoadOptions.read_threads`           4
``UNICKPT_COLLECTIVE_TIMEOUT_S`` :attr:`Env.collective_timeout_s`          1800
``UNICKPT_RETRY_TOTAL_S``       :attr:`Env.retry_total_s`                  120
``UNICKPT_MEMORY_DIR``          :attr:`TierOptions.memory_dir`             ``/dev/shm/unickpt``
``UNICKPT_NODE_ID``             :attr:`TierOptions.node_id`                host name (``:GROUP_RANK``)
``LOCAL_WORLD_SIZE``            ranks per host (set by ``torchrun``)       the group's world size
``GROUP_RANK``                  the node's rank (set by ``torchrun``)      none
==============================  =========================================  =========================

Imports neither torch nor fsspec (the startup hook and the writer process import it).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["SaveOptions", "LoadOptions", "TierOptions", "Env", "env", "check_options", "DEFAULT_MEMORY_DIR"]

DEFAULT_MEMORY_DIR = "/dev/shm/unickpt"  # host shared memory: survives the process, not the node


@dataclass(frozen=True)
class Env:
    """The core's environment variables, read once per process (see the module docstring)."""

    pool_bytes: int | None = None
    check_replicas: str = "sample"
    load_redistribute: bool | None = None
    load_buffer_bytes: int = 512 << 20
    read_threads: int = 4
    collective_timeout_s: float = 1800.0
    retry_total_s: float = 120.0
    local_world_size: int | None = None
    memory_dir: str | None = None
    node_id: str | None = None
    group_rank: str | None = None

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
                   check_replicas=e.get("UNICKPT_CHECK_REPLICAS", "").strip() or "sample",
                   load_redistribute={"0": False, "1": True}.get(redistribute),
                   load_buffer_bytes=number("UNICKPT_LOAD_BUFFER_BYTES", int, 512 << 20),
                   read_threads=number("UNICKPT_READ_THREADS", int, 4),
                   collective_timeout_s=number("UNICKPT_COLLECTIVE_TIMEOUT_S", float, 1800.0),
                   retry_total_s=number("UNICKPT_RETRY_TOTAL_S", float, 120.0),
                   local_world_size=number("LOCAL_WORLD_SIZE", int, None),
                   memory_dir=e.get("UNICKPT_MEMORY_DIR", "").strip() or None,
                   node_id=e.get("UNICKPT_NODE_ID", "").strip() or None,
                   group_rank=e.get("GROUP_RANK", "").strip() or None)


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
        what = {"SaveOptions": "save", "LoadOptions": "load"}.get(kind, "tier")
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
            (:mod:`unickpt.saving.replicas`): ``"sample"`` every save: a sampled digest on the first
            save of each layout, then a rotating sample that digests every byte once in every 128
            saves of the layout (a chunk of at least 4 MiB in part on every save), carried in the
            plan agreement's one collective; ``"first"`` the first save of each layout only;
            ``"always"`` every byte on every save (a debug option); ``"off"`` never. Different
            copies raise ReplicaMismatchError on every rank. Default: ``UNICKPT_CHECK_REPLICAS`` or
            ``"sample"``.
        partial: the state is a part of a job-wide state (a memory-tier copy of one rank's shards,
            saved by that rank alone: :mod:`unickpt.tiers`): tensors need not be covered entirely
            (``layout.partial`` in ``metadata.json``); such a checkpoint loads only into the shards
            it holds.
        in_place: stage straight into the data file (local storage on a tmpfs, such as the memory
            tiers in /dev/shm): the staging ring is the rank's one data file, mapped, so the copy
            of the snapshot is the write and the drain only checksums (no second copy, no separate
            ring). The value is a directory of spare files of the same file system: a save takes one
            (``rename``, recycling its memory pages) when it holds one that nothing else links, else
            it creates the file. Used only where a rank's data fit one file (``segment_bytes``) and
            with ``writer="thread"``; other saves stage as usual. None: off.
        safetensors: an fqn prefix (such as ``"model."``): the tensors under it are written as
            Hugging Face safetensors files in the checkpoint directory, names relative to the prefix:
            ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` (one per writer, each
            tensor whole, replicas balanced over their holders) + ``model.safetensors.index.json``;
            ``from_pretrained`` / ``safetensors.safe_open`` read them, and ``metadata.json`` indexes
            the same bytes (:mod:`unickpt.format.hf_shards`). A tensor under the prefix that no rank
            holds whole (DTensor shards, flat ranges) is gathered whole into one writer's file during the
            save (its shards sent point to point; writers balanced by bytes). In overlap snapshots
            with large tensors no optimizer owns, the snapshot is taken before the call returns.
            None: off.

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
    partial: bool = False
    in_place: str | None = None
    safetensors: str | None = None

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
                            "check_replicas": (str, type(None)), "partial": (bool,),
                            "in_place": (str, type(None)), "safetensors": (str, type(None))})
        opts = self
        if opts.pool_bytes is None and env().pool_bytes is not None:
            opts = replace(opts, pool_bytes=env().pool_bytes)
        if opts.check_replicas is None:
            opts = replace(opts, check_replicas=env().check_replicas)
        choices = {"check_replicas": ("sample", "first", "always", "off"), "flat_ranges": ("store", "merge"),
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
        if opts.safetensors is not None and (not opts.safetensors.endswith(".") or opts.partial):
            raise ValueError(f"safetensors must be an fqn prefix ending with '.' (such as 'model.') of a whole (not "
                             f"partial) state, got {opts.safetensors!r} with partial={opts.partial}")
        return opts

    def plan_key(self) -> tuple:
        """The options every rank must share (they shape the plan or the commit)."""
        return (self.flat_ranges, self.segment_bytes, self.upload_to, self.snapshot, self.check_replicas, self.partial,
                self.safetensors)


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
        assert opts.read_buffer_bytes is not None and opts.read_threads is not None  # env() always gives both
        if opts.read_buffer_bytes < 1:
            raise ValueError(f"read_buffer_bytes must be positive, got {opts.read_buffer_bytes}")
        if opts.read_threads < 1:
            raise ValueError(f"read_threads must be at least 1, got {opts.read_threads}")
        return opts


SIGNAL_NAMES = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")


@dataclass(frozen=True)
class TierOptions:
    """The checkpoint tiers of a :class:`~unickpt.Checkpointer` (docs/tiers.md): tier 0, this rank's
    newest steps in host shared memory; tier 1, a copy of them in the shared memory of a rank on
    another node; tier 2, the persistent checkpoints under the root. With tiers, ``Checkpointer.save``
    is called every step and decides what to save (:mod:`unickpt.tiers`).

    Attributes:
        memory_every: a memory save (tiers 0 and 1) every this many steps (steps divisible by it);
            None: no memory tiers.
        persist_every: a persistent save every this many steps; None: only when asked
            (``save(..., persist=True)``) or on a preemption notice.
        peer: copy each memory save to a rank on another node (tier 1; needs two nodes or more).
        peer_every: copy every this many-th memory save to the peer (1: every one).
        memory_dir: the base directory of the memory tiers on each node (a tmpfs such as
            ``/dev/shm``; each run gets a subdirectory named after its root). Default
            ``UNICKPT_MEMORY_DIR`` or ``/dev/shm/unickpt``.
        memory_keep: committed steps kept per memory tier and rank (1 or 2): each new memory
            save replaces the oldest; the newest step that every rank can restore is kept too while
            it is older (so a rank that is a step ahead never deletes the job's last common step).
        memory_limit_bytes: bound of the shared memory this rank's tiers hold (its own copies and
            the copies it holds for peers), bytes; a memory save or peer copy that would exceed it
            is skipped (with a warning). None: no bound beyond the slots (``memory_keep``).
        node_id: this process's node, the failure domain of tier 1 (peers are on other nodes).
            Default ``UNICKPT_NODE_ID``, else the host name, with ``:<GROUP_RANK>`` when the
            launcher (``torchrun``) sets ``GROUP_RANK``.
        signals: names of the signals that announce a preemption (``"SIGTERM"``, ``"SIGUSR1"``,
            ...): one to any rank makes every rank save the current step persistently at its next
            ``save`` call (the flag is agreed across ranks). ``()``: no handlers.
    """

    memory_every: int | None = None
    persist_every: int | None = None
    peer: bool = True
    peer_every: int = 1
    memory_dir: str | None = None
    memory_keep: int = 1
    memory_limit_bytes: int | None = None
    node_id: str | None = None
    signals: tuple = ("SIGTERM", "SIGUSR1")

    def with_(self, **changes: Any) -> "TierOptions":
        """A validated copy with ``changes``. Raises ValueError for unknown fields or bad values."""
        return _replaced(self, "TierOptions", changes)

    @property
    def enabled(self) -> bool:
        """Whether ``Checkpointer.save`` follows the tier schedule (a memory or persistent cadence is set)."""
        return self.memory_every is not None or self.persist_every is not None

    def validated(self) -> "TierOptions":
        """This, with ``memory_dir`` and ``node_id`` from the environment where None (``memory_dir`` made
        absolute: a path or a string); raises ValueError naming the field for a bad value (TypeError
        naming the field for a value of the wrong type)."""
        _check_types(self, {"memory_every": (int, type(None)), "persist_every": (int, type(None)), "peer": (bool,),
                            "peer_every": (int,), "memory_dir": (str, os.PathLike, type(None)), "memory_keep": (int,),
                            "memory_limit_bytes": (int, type(None)), "node_id": (str, type(None)),
                            "signals": (tuple, list)})
        memory_dir = None if self.memory_dir is None else os.fspath(self.memory_dir)
        if memory_dir is not None and not memory_dir.strip():
            raise ValueError("memory_dir must name a directory (None: UNICKPT_MEMORY_DIR or /dev/shm/unickpt), got ''")
        e = env()
        resolved = os.path.abspath(memory_dir or e.memory_dir or DEFAULT_MEMORY_DIR)
        opts = replace(self, memory_dir=resolved, signals=tuple(self.signals))
        if os.path.exists(resolved) and not os.path.isdir(resolved):
            raise ValueError(f"memory_dir {resolved!r} exists and is not a directory (the memory tiers keep "
                             "a directory per run there)")
        if opts.node_id is None:
            import socket

            host = socket.gethostname()
            opts = replace(opts, node_id=e.node_id or (f"{host}:{e.group_rank}" if e.group_rank else host))
        for name in ("memory_every", "persist_every"):
            value = getattr(opts, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(opts.peer_every, int) or opts.peer_every < 1:
            raise ValueError(f"peer_every must be a positive integer, got {opts.peer_every!r}")
        if opts.memory_keep not in (1, 2):
            raise ValueError(f"memory_keep must be 1 or 2, got {opts.memory_keep!r}")
        if opts.memory_limit_bytes is not None and opts.memory_limit_bytes < 1:
            raise ValueError(f"memory_limit_bytes must be positive or None, got {opts.memory_limit_bytes!r}")
        bad = [s for s in opts.signals if s not in SIGNAL_NAMES]
        if bad:
            raise ValueError(f"signals must be names among {list(SIGNAL_NAMES)}, got {bad}")
        return opts
