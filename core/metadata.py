"""``metadata.json``: the checkpoint's index, written last (its presence is the commit).

Format version 1 (see DESIGN.md, "On-disk format")::

    {"format": "unickpt", "format_version": 1, "step": 100, "framework": null,
     "run_id": "...", "created_unix_s": 1.7e9,
     "layout": {"world_size": 4, ...},
     "tensors": {fqn: {"dtype": "bfloat16", "shape": [4096, 4096],
                       "chunks": [{"offsets": [0, 0], "lengths": [1024, 4096]   # or flat_start/flat_length
                                   "file": "data/0_0.bin", "byte_offset": 0, "byte_length": 8388608,
                                   "checksum": "xxh3_64:9f0c..."}]}},
     "aliases": {fqn: fqn_it_shares_storage_with},
     "state_tree": <tagged JSON of the state's structure and plain values>,
     "per_rank": {"world_size": 4, "fqns": [...], "files": ["objects/rank_0.json", ...]},
     "extra": {}}

Chunk bytes are raw row-major data of the chunk's elements (a flat chunk: its range of the
flattened tensor) in the tensor's dtype, native little-endian. No pickle anywhere.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .errors import CheckpointNotFoundError, FormatVersionError
from .resharding import ChunkSpec, check_exact_cover, spec_from_json, spec_to_json

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "ChunkMeta",
    "TensorMeta",
    "CheckpointMetadata",
    "checksum",
    "read_metadata",
]

FORMAT_NAME = "unickpt"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"


def checksum(buf: Any) -> str:
    """``"xxh3_64:<16 hex digits>"`` of a bytes-like object."""
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(buf)


@dataclass(frozen=True)
class ChunkMeta:
    """A stored chunk: which elements (``spec``) and where their bytes are."""

    spec: ChunkSpec
    file: str  # relative to the checkpoint directory
    byte_offset: int
    byte_length: int
    checksum: str

    def to_json(self) -> dict:
        return {**spec_to_json(self.spec), "file": self.file, "byte_offset": self.byte_offset,
                "byte_length": self.byte_length, "checksum": self.checksum}

    @classmethod
    def from_json(cls, d: dict) -> "ChunkMeta":
        return cls(spec_from_json(d), d["file"], int(d["byte_offset"]), int(d["byte_length"]), d["checksum"])


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
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise FormatVersionError(f"{source}: not valid JSON ({e}); the file is corrupt") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise FormatVersionError(f"{source}: format is {got!r}, expected {FORMAT_NAME!r}")
        version = doc.get("format_version")
        if version != FORMAT_VERSION:
            raise FormatVersionError(
                f"{source}: format_version {version!r} is not supported by this unickpt "
                f"(it reads version {FORMAT_VERSION}); upgrade unickpt to load it"
            )
        tensors = {}
        for fqn, t in doc["tensors"].items():
            shape = tuple(int(n) for n in t["shape"])
            chunks = tuple(ChunkMeta.from_json(c) for c in t["chunks"])
            check_exact_cover(fqn, shape, [c.spec for c in chunks])
            tensors[fqn] = TensorMeta(t["dtype"], shape, chunks)
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
