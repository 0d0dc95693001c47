"""``metadata.json``: the checkpoint's index, written last (its presence is the commit).

Format version 1 (docs/format.md; the directory around it: :mod:`unickpt.format.layout`)::

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
import time
from dataclasses import dataclass, field
from typing import Any

from .._util import gc_paused
from ..errors import CheckpointNotFoundError, FormatVersionError, IntegrityError
from ..geometry import Box, ChunkSpec, check_exact_cover, spec_from_json, spec_to_json
from .dtypes import str_to_dtype
from .layout import METADATA_FILE

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "ChunkMeta", "TensorMeta", "CheckpointMetadata", "read_metadata",
           "spec_order"]

FORMAT_NAME = "unickpt"
FORMAT_VERSION = 1


def _check_relpath(rel: Any, source: str) -> str:
    """``rel`` if it is a relative path inside the checkpoint directory; IntegrityError otherwise."""
    parts = str(rel).replace("\\", "/").split("/")
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in parts or ":" in rel:
        raise IntegrityError(f"{source}: names the file {rel!r}, which is outside the checkpoint directory")
    return rel


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
            check_exact_cover(fqn, shape, [c.spec for c in chunks], partial=bool(doc.get("layout", {}).get("partial")))
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


def spec_order(spec: ChunkSpec) -> tuple:
    """Sort key of a tensor's chunks in ``metadata.json``: boxes by offsets, then flat ranges by start."""
    return (0, spec.offsets, spec.lengths) if isinstance(spec, Box) else (1, (spec.start,), (spec.length,))


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
