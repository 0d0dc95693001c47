"""A pack that ``torch.load`` reads: ``torch.save``'s zip archive, with unickpt's checkpoint inside.

``torch.save``'s format (``torch/serialization.py`` ``_save``, ``caffe2/serialize/inline_container.h``):
a zip archive of *stored* (uncompressed) records under one folder, here ``archive/``:

- ``data.pkl``: the object, pickled with protocol 2, each tensor a call of
  ``torch._utils._rebuild_tensor_v2(storage, offset, shape, stride, requires_grad, hooks)`` (``_v3`` with
  the dtype for dtypes without a typed storage class, e.g. float8, uint16), each storage a persistent id
  ``("storage", <storage class>, key, location, numel)``;
- ``data/<key>``: the raw bytes of storage ``key``, starting at a multiple of 64 bytes of the file
  (``torch.load(mmap=True)`` maps them in place);
- ``byteorder`` (``little``), ``version`` (``3``), ``.format_version``, ``.storage_alignment``.

unickpt's checkpoint (the members of :mod:`._pack`) rides in the same archive: ``archive/.unickpt/pack``
first (what :func:`is_pack_head` recognises), its ``metadata.json`` and object files as records under
``archive/.unickpt/``, and its data files *not as records*: each is a list of segments of the
``data/<key>`` records (:func:`map_data_files`), so each tensor byte is stored once and read by both
``torch.load`` and unickpt (by byte range). The index of the members is the record
``archive/.unickpt/index.json``; the zip's end record's comment (the last 35 bytes of the file:
``UNICKPT-LPACK-2`` and the index's offset, length and CRC-32) finds it without a scan. The index
gives each member record's CRC-32 too, which the reader checks (:mod:`._pack`): unickpt's own
checksums cover the tensor bytes, these the rest (metadata, objects).

Every function here runs in one thread: :func:`pickle_checkpoint` in the caller's (the save call: the
pickle is the checkpoint as it was then), the others in the commit thread of the save (the pack writer)
or a reader's. No collective.
"""
from __future__ import annotations

import collections
import functools
import io
import json
import pickle
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from ._tree import TENSOR_TAG, TENSORS_KEY, join

__all__ = ["FOLDER", "PACK_RECORD", "PACK_MAGIC", "TAIL_TAG", "TorchPickle", "pickle_checkpoint", "map_data_files",
           "tensor_meta", "write_zip", "Placed", "is_pack_head", "read_tail", "Segments"]

FOLDER = "archive"
PACK_RECORD = f"{FOLDER}/.unickpt/pack"  # the first record (its name identifies a pack)
PACK_MAGIC = b"UNICKPT-LPACK-2\n"  # its content
MEMBERS = f"{FOLDER}/.unickpt/"  # unickpt's members, as records
INDEX_RECORD = f"{FOLDER}/.unickpt/index.json"
TAIL_TAG = b"UNICKPT-LPACK-2"
_TAIL = struct.Struct("<QQI")  # the index record's data offset, length and CRC-32, after TAIL_TAG
ALIGN = 64  # torch.save's storage alignment (``.storage_alignment``)
_ZIP64_AT = 0xFFFFFFFF  # sizes and offsets from here need zip64 fields (a module constant: tests lower it)
_COUNT64_AT = 0xFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_END64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_DOS_DATE = (1 << 5) | 1  # 1980-01-01, as a DOS date; time 0


# -- data.pkl -----------------------------------------------------------------------------------------------
class _Storage:
    """A storage in ``data.pkl``: pickled as torch.save's persistent id."""

    __slots__ = ("key", "dtype", "numel", "location")

    def __init__(self, key: str, dtype: torch.dtype, numel: int, location: str):
        self.key, self.dtype, self.numel, self.location = key, dtype, numel, location


class _Tensor:
    """A tensor in ``data.pkl``: a contiguous tensor over the whole of its storage."""

    __slots__ = ("storage", "shape", "requires_grad", "parameter")

    def __init__(self, storage: _Storage, shape: tuple, requires_grad: bool, parameter: bool):
        self.storage, self.shape, self.requires_grad, self.parameter = storage, shape, requires_grad, parameter


@functools.lru_cache(maxsize=None)
def _typed_storage_class(dtype: torch.dtype) -> Any:
    """torch.save's storage class of ``dtype`` (``torch.FloatStorage``...), or None (``_rebuild_tensor_v3``)."""
    from torch.storage import _dtype_to_storage_type_map

    name = _dtype_to_storage_type_map().get(dtype)
    return getattr(torch, name) if name is not None else None


def _contiguous_stride(shape: tuple) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    """torch.save's pickler (``torch/serialization.py`` ``_save``, ``Tensor.__reduce_ex__``,
    ``Parameter.__reduce_ex__``) over :class:`_Tensor` / :class:`_Storage` stand-ins."""

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _Storage:
            cls = _typed_storage_class(obj.dtype)
            if cls is None:
                nbytes = obj.numel * obj.dtype.itemsize
                return ("storage", torch.UntypedStorage, obj.key, obj.location, nbytes)
            return ("storage", cls, obj.key, obj.location, obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not _Tensor:
            return NotImplemented
        hooks: collections.OrderedDict = collections.OrderedDict()
        if obj.parameter:
            data = _Tensor(obj.storage, obj.shape, False, False)
            return torch._utils._rebuild_parameter, (data, obj.requires_grad, hooks)
        args = (obj.storage, 0, obj.shape, _contiguous_stride(obj.shape), obj.requires_grad, hooks)
        if _typed_storage_class(obj.storage.dtype) is None:
            return torch._utils._rebuild_tensor_v3, (*args, obj.storage.dtype)
        return torch._utils._rebuild_tensor_v2, args


@dataclass
class TorchPickle:
    """``data.pkl`` of a checkpoint and its storages: ``storages[key] = fqn`` (the fqn under
    ``tensors`` of the unickpt state whose bytes are storage ``key``'s)."""

    data_pkl: bytes
    storages: dict[str, str] = field(default_factory=dict)


def pickle_checkpoint(tree: Any, tensors: dict[str, torch.Tensor]) -> TorchPickle:
    """Caller's thread, at the save call: ``data.pkl`` of the checkpoint dict that ``tree`` and
    ``tensors`` (:func:`unickpt.lightning._tree.split`) hold, as ``torch.save`` pickles it. A tensor
    referenced twice (tied) is one storage and one object after ``torch.load``, as with torch.save; views
    of one storage that differ (shape, offset) are separate storages (torch.save would share one).
    Raises ValueError naming the fqn for a tensor unickpt cannot store (sparse, quantized), and what
    pickling raises for an object ``pickle`` cannot store."""
    storages: dict[str, str] = {}
    by_identity: dict[tuple, _Storage] = {}
    stand_ins: dict[tuple, _Tensor] = {}

    def leaf(tag: dict) -> _Tensor:
        fqn = tag[TENSOR_TAG]
        t = tensors[fqn]
        if t.layout != torch.strided or t.is_quantized:
            kind = "quantized" if t.layout == torch.strided else str(t.layout).replace("torch.", "")
            raise ValueError(f"{fqn!r}: a {kind} tensor; unickpt saves dense (strided) tensors only "
                             "(store t.to_dense() / t.dequantize())")
        ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()) \
            if t.numel() and t.data_ptr() else ("own", fqn)
        storage = by_identity.get(ident)
        if storage is None:
            key = str(len(storages))
            storage = by_identity[ident] = _Storage(key, t.dtype, t.numel(), _location(tag.get("device")))
            storages[key] = fqn
        flags = (ident, bool(tag.get("requires_grad")), bool(tag.get("parameter")))
        if flags not in stand_ins:  # the same tensor twice: one object (pickle's memo), as torch.save
            stand_ins[flags] = _Tensor(storage, tuple(t.shape), flags[1], flags[2])
        return stand_ins[flags]

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(join(tree, leaf, raw=True))
    return TorchPickle(buf.getvalue(), storages)


def _location(device: Any) -> str:
    """torch.save's location tag of a saved device: ``str(tensor.device)`` (``cpu``, ``cuda:0``...)."""
    return device if isinstance(device, str) and device not in ("", "meta") else "cpu"


# -- unickpt's data files as segments of the tensor records -----------------------------------------------
@dataclass
class Segments:
    """A data file of unickpt's checkpoint as parts of tensor records: ``parts`` is ``[[file offset,
    length, record key, offset in the record], ...]`` sorted by file offset; bytes of the file in no
    part are zeros (alignment padding)."""

    size: int
    parts: list = field(default_factory=list)


def tensor_meta(metadata: dict, fqn: str) -> dict | None:
    """The ``metadata.json`` entry of the tensor under ``tensors`` named ``fqn`` (through ``aliases``:
    a tied tensor is stored once), or None."""
    name = f"{TENSORS_KEY}.{fqn}"
    return metadata.get("tensors", {}).get(metadata.get("aliases", {}).get(name, name))


def map_data_files(metadata: dict, sizes: dict[str, int], storages: dict[str, str],
                   zero_gaps: Any) -> tuple[dict[str, list], dict[str, Segments]]:
    """Where each storage's bytes are in unickpt's data files, from ``metadata`` (``metadata.json``,
    format version 1; docs/format.md): ``records[key] = [[file, offset, length], ...]`` (the storage's
    bytes, in order) and ``virtual[file] = Segments`` for each data file wholly made of storage bytes
    (and zero padding: ``zero_gaps(file, [[start, end], ...]) -> bool`` checks the uncovered ranges).

    A storage whose tensor is stored as one chunk, or as chunks that tile it in row-major order (slabs
    of its first dim; flat ranges), maps onto those byte ranges. Any other layout (none is written by
    the io route today) maps onto nothing: ``records[key]`` is None (the caller copies the tensor's
    bytes into its record) and its data files stay real records."""
    tensors = metadata.get("tensors", {})
    records: dict[str, Any] = {}
    used: dict[str, list] = {}
    unmapped_files: set[str] = set()
    for key, fqn in storages.items():
        tm = tensor_meta(metadata, fqn)
        ranges = _row_major_ranges(tm) if tm is not None else None
        records[key] = ranges
        if ranges is None:
            unmapped_files.update(c["file"] for c in (tm or {}).get("chunks", []))
            continue
        pos = 0
        for file, off, length in ranges:
            used.setdefault(file, []).append([off, length, key, pos])
            pos += length
    for tm in tensors.values():  # tensors outside any storage (none today): their files stay real
        for c in tm.get("chunks", []):
            if c["file"] not in used:
                unmapped_files.add(c["file"])
    virtual: dict[str, Segments] = {}
    for file, parts in used.items():
        if file in unmapped_files or file not in sizes:
            continue
        parts.sort()
        gaps: list[list[int]] = []
        end, overlap = 0, False
        for off, length, _, _ in parts:
            if off < end:  # two storages over one range (never written): keep the file
                overlap = True
                break
            if off > end:
                gaps.append([end, off])
            end = off + length
        if overlap or end > sizes[file]:
            continue
        if end < sizes[file]:
            gaps.append([end, sizes[file]])
        if zero_gaps(file, gaps):
            virtual[file] = Segments(sizes[file], parts)
    return records, virtual


def _row_major_ranges(tm: dict) -> list | None:
    """The byte ranges ``[[file, offset, length], ...]`` that hold tensor ``tm``'s bytes in row-major
    order, or None (not a tiling of row-major slabs)."""
    shape, chunks = list(tm.get("shape", [])), tm.get("chunks")
    if not isinstance(chunks, list) or "split" in tm:
        return None
    numel = 1
    for n in shape:
        numel *= n
    items = []
    for c in chunks:
        if "flat_start" in c:
            start, count = int(c["flat_start"]), int(c["flat_length"])
        else:
            offsets, lengths = list(c.get("offsets", [])), list(c.get("lengths", []))
            if len(offsets) != len(shape) or offsets[1:] != [0] * (len(shape) - 1) or lengths[1:] != shape[1:]:
                if shape or offsets or lengths:
                    return None
            inner = numel // shape[0] if shape and shape[0] else 0
            start = offsets[0] * inner if shape else 0
            count = lengths[0] * inner if shape else 1
        items.append((start, count, c))
    items.sort(key=lambda x: x[0])
    nxt = 0
    out = []
    for start, count, c in items:
        if start != nxt:
            return None
        nxt = start + count
        if int(c["byte_length"]):
            out.append([c["file"], int(c["byte_offset"]), int(c["byte_length"])])
    return out if nxt == numel else None


def assemble(tm: dict, read: Callable[[str, int, int], Any]) -> bytes:
    """Tensor ``tm``'s bytes in row-major order, assembled from its chunks (``read(file, offset,
    length)`` gives a chunk's bytes): for a layout :func:`map_data_files` cannot map (a copy)."""
    from unickpt.ext import Codec

    dtype, shape = Codec.str_to_dtype(tm["dtype"]), tuple(tm["shape"])
    full = torch.zeros(shape, dtype=dtype)
    flat = full.view(-1)
    for c in tm["chunks"]:
        raw = bytearray(read(c["file"], int(c["byte_offset"]), int(c["byte_length"])))
        if not raw:
            continue
        part = torch.frombuffer(raw, dtype=dtype)
        if "flat_start" in c:
            flat[int(c["flat_start"]):int(c["flat_start"]) + part.numel()] = part
        else:
            box = tuple(slice(o, o + n) for o, n in zip(c["offsets"], c["lengths"]))
            full[box] = part.view(tuple(c["lengths"]))
    return full.reshape(-1).view(torch.uint8).numpy().tobytes() if full.numel() else b""


# -- the zip archive --------------------------------------------------------------------------------------
def _local_extra(offset: int, name: bytes, size: int) -> tuple[bytes, bool]:
    """The local header's extra field: zip64 sizes where needed, then padding ('FB', as torch.save)
    so that the data starts at a multiple of :data:`ALIGN`."""
    zip64 = size >= _ZIP64_AT
    extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    start = offset + _LOCAL.size + len(name) + len(extra) + 4
    pad = (-start) % ALIGN
    return extra + struct.pack("<HH", 0x4246, pad) + b"Z" * pad, zip64


@dataclass(frozen=True)
class Placed:
    """Where a record's data is in the archive: ``offset`` and ``size`` in bytes, ``crc`` its CRC-32."""

    offset: int
    size: int
    crc: int


def write_zip(records: Iterable[tuple[str, list]],
              index: tuple[str, Callable[[dict[str, Placed]], bytes]] | None = None) -> tuple[list, dict[str, Placed]]:
    """The zip archive of ``records`` (``(name, [bytes-like parts])``, stored, each record's data at a
    multiple of 64 bytes), as a list of chunks to write in order (the parts are not copied), and where
    each record's data went (:class:`Placed`). ``index``: ``(name, make)``, a last record whose bytes
    ``make(placed)`` gives from the other records' places; the end record's comment locates it and
    holds its CRC-32 (:func:`read_tail`). zip64 fields where sizes, offsets or the record count need them."""
    chunks: list = []
    central: list = []
    placed: dict[str, Placed] = {}
    pos = 0

    def all_records() -> Iterator[tuple[str, list]]:
        yield from records
        if index is not None:
            yield index[0], [index[1](dict(placed))]

    for name, parts in all_records():
        raw = name.encode()
        size = sum(memoryview(p).nbytes for p in parts)
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        extra, zip64 = _local_extra(pos, raw, size)
        small = 0xFFFFFFFF if zip64 else size
        header = _LOCAL.pack(0x04034B50, 45 if zip64 else 20, 0, 0, 0, _DOS_DATE, crc, small, small, len(raw),
                             len(extra))
        chunks += [header, raw, extra, *parts]
        placed[name] = Placed(pos + len(header) + len(raw) + len(extra), size, crc)
        central.append((raw, crc, size, pos))
        pos = placed[name].offset + size
    cd_start = pos
    for raw, crc, size, offset in central:
        fields = [v for v in (size, size) if size >= _ZIP64_AT] + ([offset] if offset >= _ZIP64_AT else [])
        extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
        big = 0xFFFFFFFF
        entry = _CENTRAL.pack(0x02014B50, 45, 45 if fields else 20, 0, 0, 0, _DOS_DATE, crc,
                              big if size >= _ZIP64_AT else size, big if size >= _ZIP64_AT else size, len(raw),
                              len(extra), 0, 0, 0, 0, big if offset >= _ZIP64_AT else offset)
        chunks += [entry, raw, extra]
        pos += len(entry) + len(raw) + len(extra)
    count, cd_size = len(central), pos - cd_start
    if count >= _COUNT64_AT or cd_size >= _ZIP64_AT or cd_start >= _ZIP64_AT:
        chunks.append(_END64.pack(0x06064B50, _END64.size - 12, 45, 45, 0, 0, count, count, cd_size, cd_start))
        chunks.append(_LOCATOR.pack(0x07064B50, 0, pos, 1))
        count16, size32, start32 = 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF
    else:
        count16, size32, start32 = count, cd_size, cd_start
    comment = b""
    if index is not None:
        where = placed[index[0]]
        comment = TAIL_TAG + _TAIL.pack(where.offset, where.size, where.crc)
    chunks.append(_END.pack(0x06054B50, 0, 0, count16, count16, size32, start32, len(comment)) + comment)
    return chunks, placed


def is_pack_head(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes, at least 4) starts a pack: the first record of every pack
    (:data:`PACK_RECORD` holding :data:`PACK_MAGIC`, at offset 0) is the same bytes, so a pack cut short
    within them is still recognised (and refused as damaged, not read as a ``torch.save`` file)."""
    return len(head) >= 4 and (_first_record().startswith(head) or head.startswith(_first_record()))


@functools.lru_cache(maxsize=1)
def _first_record() -> bytes:
    chunks, _ = write_zip([(PACK_RECORD, [PACK_MAGIC])])
    return b"".join(bytes(c) for c in chunks[:4])  # local header, name, extra, content


TAIL_BYTES = _END.size + len(TAIL_TAG) + _TAIL.size  # the last bytes of a pack: the end record


def read_tail(tail: bytes) -> tuple[int, int, int] | None:
    """The index record's ``(offset, length, CRC-32)`` from a pack's last :data:`TAIL_BYTES` bytes, or
    None (not a pack's end: truncated or another file)."""
    if len(tail) != TAIL_BYTES or tail[:4] != b"PK\x05\x06":
        return None
    if struct.unpack_from("<H", tail, _END.size - 2)[0] != len(TAIL_TAG) + _TAIL.size:
        return None
    comment = tail[_END.size:]
    if comment[:len(TAIL_TAG)] != TAIL_TAG:
        return None
    off, length, crc = _TAIL.unpack(comment[len(TAIL_TAG):])
    return int(off), int(length), int(crc)


def index_json(doc: dict) -> bytes:
    """The index record's bytes."""
    return json.dumps(doc, separators=(",", ":")).encode()
