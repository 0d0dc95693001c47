"""``metadata.json``: the checkpoint's index, written last (its presence is the commit).

Format version 1 (docs/format.md; the directory around it: :mod:`unickpt.format.files`)::

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

Format version 2 adds *split* tensors, written when a save has any (an FSDP2 / ``Shard(dim)``
layout over the whole group: :class:`~unickpt.geometry.EvenSplit`): one line per tensor instead of
one chunk per rank, their parts' files, offsets and checksums in per-writer index files
(:mod:`unickpt.format.index`), so ``metadata.json`` grows with the tensors, not ranks x tensors::

     "tensors": {fqn: {"dtype": "float32", "shape": [53248, 16384],
                       "split": {"dim": 0, "parts": 2048, "slot": 17}}},   # or "chunks" as in v1
     "index": {"writers": 2048, "slots": 3411, "block_bytes": 1048576, "max_blocks": 32}
     # optional "prefix": the directory (relative) holding these data/ and index/ files

Part ``k`` of a split tensor is written by rank ``k``; its record is slot ``slot`` of
``index/<k>.idx``; a part of more than ``block_bytes`` bytes has checksum blocks of
:func:`~unickpt.format.integrity.block_size` bytes (``block_bytes`` doubled until at most
``max_blocks``), so a load knows which blocks it needs before it reads any record.

Chunk bytes are raw row-major data of the chunk's elements (a flat chunk: its range of the
flattened tensor) in the tensor's dtype, native little-endian. No pickle anywhere.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .._util import gc_paused
from ..errors import CheckpointNotFoundError, FormatVersionError, IntegrityError, StorageError
from ..geometry import Box, ChunkSpec, EvenSplit, check_exact_cover, spec_from_json, spec_to_json
from ..storage.base import StorageBackend
from .dtypes import str_to_dtype
from .files import METADATA_FILE
from .index import IndexReader
from .integrity import CHECKSUM_BLOCK_BYTES, MAX_BLOCKS_PER_CHUNK

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "VERSIONS", "ChunkMeta", "TensorMeta", "CheckpointMetadata", "read_extra",
           "read_metadata", "spec_order", "split_block_bytes"]

FORMAT_NAME = "unickpt"
FORMAT_VERSION = 2
"""The newest version this unickpt writes (only when a save has split tensors; otherwise 1)."""
VERSIONS = (1, 2)
"""The versions it reads."""


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


def split_block_bytes(nbytes: int, min_bytes: int = CHECKSUM_BLOCK_BYTES, max_blocks: int = MAX_BLOCKS_PER_CHUNK) -> int:
    """The checksum block size of a split tensor's part of ``nbytes`` under a v2 ``index`` policy:
    0 (one checksum) up to ``min_bytes``, else ``min_bytes`` doubled until at most ``max_blocks``."""
    if nbytes <= min_bytes:
        return 0
    b = min_bytes
    while -(-nbytes // b) > max_blocks:
        b *= 2
    return b


@dataclass(frozen=True)
class TensorMeta:
    """A stored tensor: ``dtype``, global ``shape``, and either its ``explicit`` chunks (each with
    file, offset and checksums), or (format v2) an even ``split`` whose part ``k`` rank ``k`` wrote,
    with its record at ``slot`` of that rank's index file. :attr:`chunks` lists the chunks either way
    (for a split tensor it reads the index files, through the ``resolver`` that
    :func:`read_metadata` attaches); :meth:`specs` gives the geometry without any read."""

    dtype: str
    shape: tuple[int, ...]
    explicit: tuple[ChunkMeta, ...] = ()
    split: EvenSplit | None = None
    slot: int = -1
    resolver: Callable[["TensorMeta"], tuple[ChunkMeta, ...]] | None = field(default=None, compare=False,
                                                                                 repr=False)

    @property
    def chunks(self) -> tuple[ChunkMeta, ...]:
        """Every stored (non-empty) chunk with its file, offset and checksums. Raises IntegrityError
        for a split tensor whose metadata was parsed without the checkpoint's storage (no resolver)."""
        if self.split is None:
            return self.explicit
        if self.resolver is None:
            raise IntegrityError("a split tensor's parts are listed in the checkpoint's index files: read the "
                                 "metadata with read_metadata(storage, path) to list its chunks")
        return self.resolver(self)

    def specs(self) -> list[ChunkSpec]:
        """The stored chunks' geometry (boxes or flat ranges), without reading anything."""
        if self.split is None:
            return [c.spec for c in self.explicit]
        parts = (self.split.part(self.shape, k) for k in range(self.split.nonempty(self.shape)))
        return [p for p in parts if p is not None]  # the first nonempty() parts are never empty

    @property
    def nbytes(self) -> int:
        if self.split is not None:
            return math.prod(self.shape) * str_to_dtype(self.dtype).itemsize
        return sum(c.byte_length for c in self.explicit)


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
    format_version: int = 1
    index: dict = field(default_factory=dict)  # v2: {"writers", "slots", "block_bytes", "max_blocks"}

    def to_json(self) -> str:
        """The ``metadata.json`` text (compact). Version 2 when a tensor is split, else version 1."""
        split = any(t.split is not None for t in self.tensors.values())
        doc = {
            "format": FORMAT_NAME,
            "format_version": 2 if split else 1,
            "step": self.step,
            "framework": self.framework,
            "run_id": self.run_id,
            "created_unix_s": self.created_unix_s,
            "layout": self.layout,
            "tensors": {fqn: _tensor_json(t) for fqn, t in self.tensors.items()},
            "aliases": self.aliases,
            "state_tree": self.state_tree,
            "per_rank": self.per_rank,
            "extra": self.extra,
        }
        if split:
            doc["index"] = self.index
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "metadata.json") -> "CheckpointMetadata":
        """Parse and validate. Raises FormatVersionError for another format or an unknown version."""
        with gc_paused():
            return cls._parse(text, source)

    @classmethod
    def _parse(cls, text: str | bytes, source: str) -> "CheckpointMetadata":
        doc, version = _checked_doc(text, source)
        try:
            return cls._from_doc(doc, version, source)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise IntegrityError(f"{source}: malformed metadata ({type(e).__name__}: {e}); the file is corrupt") from e

    @staticmethod
    def extra_from_json(text: str | bytes, *, source: str = "metadata.json") -> dict:
        """Only the ``extra`` dict (what a plugin recorded with the save), without building the tensor
        table: a third of the cost of :meth:`from_json` (2000 tensors: ~30 ms against ~100 ms). Raises
        as :meth:`from_json` for another format, an unknown version or invalid JSON, and IntegrityError
        when ``extra`` is not a JSON object."""
        doc, _ = _checked_doc(text, source)
        return _extra(doc, source)

    @classmethod
    def _from_doc(cls, doc: dict, version: int, source: str) -> "CheckpointMetadata":
        tensors = {}
        index = doc.get("index", {}) if version >= 2 else {}
        if index:
            writers, slots = int(index["writers"]), int(index["slots"])
            if writers < 1 or slots < 1 or int(index["block_bytes"]) <= 0 or int(index["max_blocks"]) < 1:
                raise ValueError(f"index {index} is not valid")
            if index.get("prefix"):
                _check_relpath(index["prefix"], source)
        for fqn, t in doc["tensors"].items():
            shape = tuple(int(n) for n in t["shape"])
            itemsize = str_to_dtype(t["dtype"]).itemsize
            if "split" in t:
                sp = t["split"]
                split, slot = EvenSplit(int(sp["dim"]), int(sp["parts"])), int(sp["slot"])
                if not index or not 0 <= split.dim < len(shape) or not 2 <= split.parts <= writers \
                        or not 0 <= slot < slots or 0 in shape:
                    raise ValueError(f"{fqn!r}: split {sp} does not fit shape {list(shape)} and index {index}")
                tensors[fqn] = TensorMeta(t["dtype"], shape, split=split, slot=slot)
                continue
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
            extra=_extra(doc, source),
            format_version=version,
            index=index,
        )

    def attach(self, storage: StorageBackend, path: str, *, whole_files: bool = True) -> "CheckpointMetadata":
        """Let split tensors list their chunks (:attr:`TensorMeta.chunks`) by reading the index files of
        the checkpoint at ``path`` (each read whole once: the tools' access pattern). Returns self."""
        reader = IndexReader(storage, path, whole_files=whole_files, prefix=self.index.get("prefix", ""),
                             slots=self.index.get("slots"))

        def resolve(t: TensorMeta) -> tuple[ChunkMeta, ...]:
            assert t.split is not None, "resolve is set only on split tensors"
            return tuple(split_chunk(t, k, reader.records(k, [t.slot])[t.slot], self.index)
                         for k in range(t.split.nonempty(t.shape)))

        for fqn, t in self.tensors.items():
            if t.split is not None:
                self.tensors[fqn] = TensorMeta(t.dtype, t.shape, split=t.split, slot=t.slot, resolver=resolve)
        return self


def split_chunk(t: TensorMeta, k: int, record: Any, index: dict) -> ChunkMeta:
    """Part ``k`` of split tensor ``t`` as a :class:`ChunkMeta`, from its index record (an
    :class:`~unickpt.format.index.IndexRecord`). Raises IntegrityError when the record does not
    describe the part: another length, or another checksum block size than ``index`` implies."""
    assert t.split is not None
    spec = t.split.part(t.shape, k)
    want = 0 if spec is None else spec.numel * str_to_dtype(t.dtype).itemsize
    blocks = split_block_bytes(want, int(index["block_bytes"]), int(index["max_blocks"]))
    if spec is None or record.byte_length != want or record.block_bytes != blocks:
        raise IntegrityError(f"index/{k}.idx slot {t.slot}: part {k} of {list(t.shape)} {t.dtype} has "
                             f"{record.byte_length} bytes in checksum blocks of {record.block_bytes}, expected "
                             f"{want} in blocks of {blocks} (the index file is corrupt)")
    return ChunkMeta(spec, record.file(k, index.get("prefix", "")), record.byte_offset, record.byte_length,
                     record.checksum, record.block_checksums, record.block_bytes)


def _tensor_json(t: TensorMeta) -> dict:
    if t.split is not None:
        return {"dtype": t.dtype, "shape": list(t.shape),
                "split": {"dim": t.split.dim, "parts": t.split.parts, "slot": t.slot}}
    return {"dtype": t.dtype, "shape": list(t.shape), "chunks": [c.to_json() for c in t.explicit]}


def spec_order(spec: ChunkSpec) -> tuple:
    """Sort key of a tensor's chunks in ``metadata.json``: boxes by offsets, then flat ranges by start."""
    return (0, spec.offsets, spec.lengths) if isinstance(spec, Box) else (1, (spec.start,), (spec.length,))


def _extra(doc: dict, source: str) -> dict:
    """``doc["extra"]`` (``{}`` when absent); IntegrityError naming ``source`` when it is not an object."""
    extra = doc.get("extra", {})
    if not isinstance(extra, dict):
        raise IntegrityError(f"{source}: malformed metadata ('extra' is a {type(extra).__name__}, expected "
                             "an object); the file is corrupt")
    return extra


def _checked_doc(text: str | bytes, source: str) -> tuple[dict, int]:
    """The JSON document of a ``metadata.json`` and its format version, checked: IntegrityError for
    invalid JSON, FormatVersionError for another format or an unknown version."""
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
    if version not in VERSIONS:
        raise FormatVersionError(
            f"{source}: format_version {version!r} is not supported by this unickpt "
            f"(it reads versions {', '.join(map(str, VERSIONS))}); upgrade unickpt to load it"
        )
    return doc, version


def read_metadata(storage: StorageBackend, path: str) -> CheckpointMetadata:
    """Read ``<path>/metadata.json`` (version 1 or 2; split tensors list their chunks by reading the
    index files on demand, :meth:`CheckpointMetadata.attach`). Raises CheckpointNotFoundError when it
    is absent (uncommitted), FormatVersionError, IntegrityError (malformed), NotADirectoryError (a
    file), StorageError when the read fails otherwise (I/O error, permission): never "not committed"."""
    meta_path, text = _read_text(storage, path)
    return CheckpointMetadata.from_json(text, source=meta_path).attach(storage, path)


def read_extra(storage: StorageBackend, path: str) -> dict:
    """Only the ``extra`` dict of ``<path>/metadata.json`` (:meth:`CheckpointMetadata.extra_from_json`).
    Raises as :func:`read_metadata`."""
    meta_path, text = _read_text(storage, path)
    return CheckpointMetadata.extra_from_json(text, source=meta_path)


def _read_text(storage: StorageBackend, path: str) -> tuple[str, bytes]:
    meta_path = storage.join(path, METADATA_FILE)
    try:
        text = storage.read_bytes(meta_path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {path!r}: {METADATA_FILE} is missing "
            "(the save never finished, or the path is wrong)"
        ) from None
    except (NotADirectoryError, IsADirectoryError, StorageError, IntegrityError):
        raise
    except OSError as e:
        raise StorageError(f"cannot read {meta_path!r}: {e}", meta_path, e) from e
    return meta_path, text
