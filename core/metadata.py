"""``metadata.json``: the checkpoint's index, written last (its presence is the commit).

Format version 1 (see DESIGN.md, "On-disk format")::

    {"format": "unickpt", "format_version": 1, "step": 100, "framework": null,
     "run_id": "...", "created_unix_s": 1.7e9,
     "layout": {"world_size": 4, ...},
     "tensors": {fqn: {"dtype": "bfloat16", "shape": [4096, 4096],
                       "chunks": [{"offsets": [0, 0], "lengths": [1024, 4096]   # or flat_start/flat_length
                                   "file": "data/0_0.bin", "byte_offset": 0, "byte_length": 8388608,
                                   "checksum": "xxh3_64:9f0c...",
                                   # chunks > 1 MiB also: "block_bytes": 1048576, "block_checksums": [...]
                                   }]}},
     "aliases": {fqn: fqn_it_shares_storage_with},
     "state_tree": <tagged JSON of the state's structure and plain values>,
     "per_rank": {"world_size": 4, "fqns": [...], "files": ["objects/rank_0.json", ...]},
     "extra": {}}

Chunk bytes are raw row-major data of the chunk's elements (a flat chunk: its range of the
flattened tensor) in the tensor's dtype, native little-endian. No pickle anywhere.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .codec import str_to_dtype
from .errors import CheckpointNotFoundError, FormatVersionError, IntegrityError
from .resharding import Box, ChunkSpec, check_exact_cover, gc_paused, spec_from_json, spec_to_json

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "ChunkMeta",
    "TensorMeta",
    "CheckpointMetadata",
    "checksum",
    "chunk_checksums",
    "CHECKSUM_BLOCK_BYTES",
    "read_metadata",
    "build_metadata",
    "is_incomplete_checkpoint",
    "WRITER_FILE",
    "writer_record",
    "writer_alive",
]

FORMAT_NAME = "unickpt"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
CHECKSUM_BLOCK_BYTES = 1 << 20
"""Chunks larger than this get one checksum per block (at least this many bytes, and large enough that
a chunk has at most ``MAX_BLOCKS_PER_CHUNK`` blocks), so that a partial read (resharding) is verified
by reading only the blocks it touches, while metadata stays small."""
MAX_BLOCKS_PER_CHUNK = 32
"""32, not 64: at 10,000 ranks of a 405B model with AdamW, block checksums were 84 % of a 55-64 MB
metadata.json (benchmarks/plan_sim.py); 32 brings it to 34-37 MB, and a partial read still reads at
most two blocks (1/16 of a chunk) beyond what it needs. Readers use each chunk's stored block size."""


def _check_relpath(rel: Any, source: str) -> str:
    """``rel`` if it is a relative path inside the checkpoint directory; IntegrityError otherwise."""
    parts = str(rel).replace("\\", "/").split("/")
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in parts or ":" in rel:
        raise IntegrityError(f"{source}: names the file {rel!r}, which is outside the checkpoint directory")
    return rel


def checksum(buf: Any) -> str:
    """``"xxh3_64:<16 hex digits>"`` of a bytes-like object."""
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(buf)


def block_size(nbytes: int) -> int:
    """Checksum block size for a chunk of ``nbytes``: ``CHECKSUM_BLOCK_BYTES``, doubled until the
    chunk has at most ``MAX_BLOCKS_PER_CHUNK`` blocks."""
    b = CHECKSUM_BLOCK_BYTES
    while -(-nbytes // b) > MAX_BLOCKS_PER_CHUNK:
        b *= 2
    return b


def chunk_checksums(buf: memoryview, block_bytes: int | None = None) -> tuple[str, tuple[str, ...], int]:
    """``(checksum, block checksums, block size)`` of a chunk's bytes (xxh3-64).

    A chunk of at most ``CHECKSUM_BLOCK_BYTES`` has one checksum over its bytes and no blocks. A
    larger chunk has one checksum per block of ``block_size(nbytes)`` bytes (the last may be short),
    and its chunk checksum is the checksum of the block checksums joined by commas.
    """
    if block_bytes is None:
        block_bytes = block_size(buf.nbytes)
    if buf.nbytes <= CHECKSUM_BLOCK_BYTES:
        return checksum(buf), (), 0
    blocks = tuple(checksum(buf[i : i + block_bytes]) for i in range(0, buf.nbytes, block_bytes))
    return checksum(",".join(blocks).encode()), blocks, block_bytes


@dataclass(frozen=True)
class ChunkMeta:
    """A stored chunk: which elements (``spec``) and where their bytes are."""

    spec: ChunkSpec
    file: str  # relative to the checkpoint directory
    byte_offset: int
    byte_length: int
    checksum: str
    block_checksums: tuple[str, ...] = ()  # see chunk_checksums()
    block_bytes: int = 0

    def to_json(self) -> dict:
        d = {**spec_to_json(self.spec), "file": self.file, "byte_offset": self.byte_offset,
             "byte_length": self.byte_length, "checksum": self.checksum}
        if self.block_checksums:
            d["block_bytes"], d["block_checksums"] = self.block_bytes, list(self.block_checksums)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ChunkMeta":
        blocks = tuple(d.get("block_checksums", ()))
        block_bytes = int(d.get("block_bytes", 0))
        length = int(d["byte_length"])
        if blocks and (block_bytes <= 0 or len(blocks) != -(-length // block_bytes)):
            raise ValueError(f"chunk at {d['file']}@{d['byte_offset']}: {len(blocks)} block checksums do not fit "
                             f"{length} bytes in blocks of {block_bytes}")
        return cls(spec_from_json(d), d["file"], int(d["byte_offset"]), length, d["checksum"], blocks, block_bytes)


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.byte_length for c in self.chunks)


@dataclass
class CheckpointMetadata:
    """Everything needed to find any stored byte of a checkpoint."""

    tensors: dict[str, TensorMeta]
    state_tree: Any
    layout: dict = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    per_rank: dict = field(default_factory=dict)
    step: int | None = None
    framework: str | None = None
    run_id: str | None = None
    created_unix_s: float = field(default_factory=time.time)
    extra: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "framework": self.framework,
            "run_id": self.run_id,
            "created_unix_s": self.created_unix_s,
            "layout": self.layout,
            "tensors": {
                fqn: {"dtype": t.dtype, "shape": list(t.shape), "chunks": [c.to_json() for c in t.chunks]}
                for fqn, t in self.tensors.items()
            },
            "aliases": self.aliases,
            "state_tree": self.state_tree,
            "per_rank": self.per_rank,
            "extra": self.extra,
        }
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "metadata.json") -> "CheckpointMetadata":
        """Parse and validate. Raises FormatVersionError for another format or an unknown version."""
        with gc_paused():
            return cls._parse(text, source)

    @classmethod
    def _parse(cls, text: str | bytes, source: str) -> "CheckpointMetadata":
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IntegrityError(f"{source}: not valid JSON ({e}); the file is corrupt") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            hint = ""
            if isinstance(doc, dict) and "sharded_backend" in doc:  # megatron-core's own metadata.json
                hint = (f"; this is a megatron-core checkpoint (sharded_backend {doc['sharded_backend']!r})"
                        + (", its unickpt part is the 'unickpt' subdirectory" if doc["sharded_backend"] == "unickpt"
                           else ""))
            raise FormatVersionError(f"{source}: format is {got!r}, expected {FORMAT_NAME!r}{hint}")
        version = doc.get("format_version")
        if version != FORMAT_VERSION:
            raise FormatVersionError(
                f"{source}: format_version {version!r} is not supported by this unickpt "
                f"(it reads version {FORMAT_VERSION}); upgrade unickpt to load it"
            )
        try:
            return cls._from_doc(doc, version, source)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise IntegrityError(f"{source}: malformed metadata ({type(e).__name__}: {e}); the file is corrupt") from e

    @classmethod
    def _from_doc(cls, doc: dict, version: int, source: str) -> "CheckpointMetadata":
        tensors = {}
        for fqn, t in doc["tensors"].items():
            shape = tuple(int(n) for n in t["shape"])
            itemsize = str_to_dtype(t["dtype"]).itemsize
            chunks = tuple(ChunkMeta.from_json(c) for c in t["chunks"])
            for c in chunks:
                _check_relpath(c.file, source)
                if c.byte_offset < 0 or c.byte_length != c.spec.numel * itemsize:
                    raise ValueError(f"{fqn!r}: chunk {c.spec} at {c.file}@{c.byte_offset} has byte_length "
                                     f"{c.byte_length}, expected {c.spec.numel * itemsize} at a non-negative offset")
            check_exact_cover(fqn, shape, [c.spec for c in chunks])
            tensors[fqn] = TensorMeta(t["dtype"], shape, chunks)
        for rel in doc.get("per_rank", {}).get("files", []):
            if rel is not None:
                _check_relpath(rel, source)
        if "state_tree" not in doc:
            raise KeyError("state_tree")
        return cls(
            tensors=tensors,
            state_tree=doc.get("state_tree"),
            layout=doc.get("layout", {}),
            aliases=doc.get("aliases", {}),
            per_rank=doc.get("per_rank", {}),
            step=doc.get("step"),
            framework=doc.get("framework"),
            run_id=doc.get("run_id"),
            created_unix_s=doc.get("created_unix_s", 0.0),
            extra=doc.get("extra", {}),
            format_version=version,
        )


def build_metadata(plan: Any, results: list[dict], *, world_size: int, skeleton: Any, step: int | None = None,
                   framework: str | None = None, run_id: str | None = None, extra: dict | None = None) -> CheckpointMetadata:
    """The metadata a save commits: every chunk of ``plan`` (a :class:`unickpt.planner.SavePlan`)
    with its file, offset and checksums, tensors' chunks in spec order.

    Args:
        results: per rank, ``{"digests": [(checksum, block checksums, block bytes)] in the order of
            plan.writes[rank], "per_rank_file": relative path or None}``.
        world_size: the saving world (``layout.world_size``; also ``per_rank.world_size``).

    Linear in the number of chunks (one sort per tensor).
    """
    chunks: dict[str, list[ChunkMeta]] = {fqn: [] for fqn in plan.tensors}
    for r, writes in enumerate(plan.writes):
        for c, (digest, blocks, block_bytes) in zip(writes, results[r]["digests"]):
            chunks[c.fqn].append(ChunkMeta(c.spec, c.file, c.offset, c.nbytes, digest, tuple(blocks), block_bytes))
    tensors = {
        fqn: TensorMeta(dtype, shape, tuple(sorted(chunks[fqn], key=lambda c: _spec_order(c.spec))))
        for fqn, (dtype, shape) in plan.tensors.items()
    }
    per_rank = {}
    if plan.per_rank_fqns:
        per_rank = {"world_size": world_size, "fqns": list(plan.per_rank_fqns),
                    "files": [r["per_rank_file"] for r in results]}
    return CheckpointMetadata(tensors=tensors, state_tree=skeleton, layout={"world_size": world_size},
                              aliases=plan.aliases, per_rank=per_rank, step=step, framework=framework,
                              run_id=run_id, extra=extra or {})


def _spec_order(spec: ChunkSpec) -> tuple:
    return (0, spec.offsets, spec.lengths) if isinstance(spec, Box) else (1, (spec.start,), (spec.length,))


WRITER_FILE = ".unickpt-writer"
"""Written first into a checkpoint directory by the saving process: ``{"host", "pid", "time"}``, so
that another process can tell a save in progress from the leftovers of a crashed one."""
WRITER_STALE_S = 3600.0  # a writer on another host that has not committed for this long is presumed dead

_PARTIAL_ENTRIES = re.compile(r"^(data|objects|metadata\.json\.tmp-[0-9a-f]+|\.unickpt-writer)$")
_PARTIAL_FILES = {"data": re.compile(r"^\d+_\d+\.bin$"), "objects": re.compile(r"^rank_\d+\.json$")}


def is_incomplete_checkpoint(storage: Any, path: str) -> bool:
    """True if ``path`` is a directory holding nothing but what an unfinished unickpt save writes
    (``data/<rank>_<n>.bin``, ``objects/rank_<r>.json``, a temporary metadata file, the writer
    record). A committed checkpoint, a file, or a directory with anything else is not. Whether its
    writer is still running is :func:`writer_alive`'s question."""
    if not storage.isdir(path) or storage.exists(storage.join(path, METADATA_FILE)):
        return False
    for name in storage.listdir(path):
        if not _PARTIAL_ENTRIES.match(name):
            return False
        if name in _PARTIAL_FILES:
            sub = storage.join(path, name)
            if not storage.isdir(sub) or not all(_PARTIAL_FILES[name].match(f) for f in storage.listdir(sub)):
                return False
    return True


def writer_record() -> bytes:
    """The contents of :data:`WRITER_FILE` for this process."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()


def writer_is_this_process(storage: Any, path: str) -> bool:
    """Whether the writer record of ``path`` names this process (host and pid)."""
    try:
        rec = json.loads(storage.read_bytes(storage.join(path, WRITER_FILE)))
    except (OSError, ValueError):
        return False
    return rec.get("host") == socket.gethostname() and rec.get("pid") == os.getpid()


def writer_alive(storage: Any, path: str) -> bool:
    """Whether the process that started the save into ``path`` may still be running: its pid is
    alive (same host), or it is on another host and started less than ``WRITER_STALE_S`` ago.
    False when there is no (readable) writer record."""
    try:
        rec = json.loads(storage.read_bytes(storage.join(path, WRITER_FILE)))
    except (OSError, ValueError):
        return False
    if rec.get("host") != socket.gethostname():
        return time.time() - float(rec.get("time", 0)) < WRITER_STALE_S
    try:
        os.kill(int(rec["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True


def read_metadata(storage: Any, path: str) -> CheckpointMetadata:
    """Read ``<path>/metadata.json``. Raises CheckpointNotFoundError when it is absent (uncommitted)."""
    meta_path = storage.join(path, METADATA_FILE)
    try:
        text = storage.read_bytes(meta_path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {path!r}: {METADATA_FILE} is missing "
            "(the save never finished, or the path is wrong)"
        ) from None
    return CheckpointMetadata.from_json(text, source=meta_path)
