"""Per-writer index files of format v2: where each part of a split tensor is, and its checksums.

A tensor stored as the parts of an :class:`~unickpt.geometry.EvenSplit` has one line in
``metadata.json`` (its rule and its *slot*); part ``k`` is written by rank ``k``, whose index file
``index/<k>.idx`` holds the part's record at that slot. Records have a fixed size, so a loading rank
reads the records (and then the block checksums) of only the parts it needs, with ranged reads, from
only the writers it needs. All integers little-endian::

    header   32 bytes   magic b"UNICKIDX", u32 index version (1), u32 record size (48),
                        u64 number of records (slots), u64 writer rank
    record   48 bytes   at 32 + 48 * slot: u32 data file number n (``data/<writer>_<n>.bin``),
                        u32 number of block checksums (0: one checksum for the whole part),
                        u64 byte offset in that file, u64 byte length (0: the part is empty),
                        u64 checksum, u64 block bytes, u64 file offset of the block checksums
    blocks   8 bytes each, after the records: the parts' block checksums, in slot order

A checksum is the 64-bit xxh3 value that ``metadata.json`` writes as ``xxh3_64:<16 hex digits>``; a
part's checksum over its blocks is, as in format v1, the xxh3-64 of those strings joined by ``,``.
Imports no torch.
"""
from __future__ import annotations

import posixpath
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import IntegrityError
from ..storage.base import StorageBackend
from .files import data_file, index_file

__all__ = ["INDEX_MAGIC", "HEADER", "RECORD", "IndexRecord", "encode_index", "IndexReader"]

INDEX_MAGIC = b"UNICKIDX"
INDEX_VERSION = 1
HEADER = struct.Struct("<8sIIQQ")
RECORD = struct.Struct("<IIQQQQQ")
_EMPTY = b"\0" * RECORD.size


def _hex(value: int) -> str:
    return f"xxh3_64:{value:016x}"


def _value(text: str) -> int:
    if not text.startswith("xxh3_64:") or len(text) != 24:
        raise ValueError(f"not an xxh3-64 checksum: {text!r}")
    return int(text[8:], 16)


@dataclass(frozen=True)
class IndexRecord:
    """One part as its writer stored it (``segment``: the writer's data file number)."""

    segment: int
    byte_offset: int
    byte_length: int
    checksum: str
    block_checksums: tuple[str, ...] = ()
    block_bytes: int = 0

    def file(self, writer: int, prefix: str = "") -> str:
        """The data file (relative to the checkpoint) holding the part's bytes."""
        return posixpath.join(prefix, data_file(writer, self.segment)) if prefix else data_file(writer, self.segment)


def encode_index(writer: int, slots: int, records: dict[int, IndexRecord]) -> bytes:
    """The index file of ``writer``: ``slots`` records, ``records[slot]`` where given (an absent slot:
    an empty part). Raises ValueError for a slot out of range or a malformed checksum."""
    if any(not 0 <= s < slots for s in records):
        raise ValueError(f"index of rank {writer}: slots {sorted(records)} not all below {slots}")
    head = HEADER.pack(INDEX_MAGIC, INDEX_VERSION, RECORD.size, slots, writer)
    table, blocks = bytearray(), bytearray()
    blocks_at = HEADER.size + slots * RECORD.size
    for s in range(slots):
        r = records.get(s)
        if r is None or r.byte_length == 0:
            table += _EMPTY
            continue
        table += RECORD.pack(r.segment, len(r.block_checksums), r.byte_offset, r.byte_length, _value(r.checksum),
                             r.block_bytes, blocks_at + len(blocks))
        blocks += b"".join(_value(b).to_bytes(8, "little") for b in r.block_checksums)
    return head + bytes(table) + bytes(blocks)


class IndexReader:
    """Records of the index files of one checkpoint (``storage``, ``path``).

    Args:
        whole_files: read each index file whole once and keep it (the tools, which read every part);
            otherwise (a load) each :meth:`records` call makes two ranged reads per writer: the
            records of the slots asked for, then their block checksums.
        prefix: the directory (relative to the checkpoint) holding ``index/`` (metadata's
            ``index.prefix``; "" for the checkpoint itself).
        slots: the number of records every index file holds (metadata's ``index.slots``); a header
            that says otherwise is an IntegrityError. None: not checked.
    """

    def __init__(self, storage: StorageBackend, path: str, *, whole_files: bool = False, prefix: str = "",
                 slots: int | None = None):
        self.storage, self.path, self.whole_files, self.prefix = storage, path, whole_files, prefix
        self.slots = slots
        self._files: dict[int, bytes] = {}

    def rel(self, writer: int) -> str:
        """The index file of ``writer``, relative to the checkpoint."""
        return posixpath.join(self.prefix, index_file(writer)) if self.prefix else index_file(writer)

    def _read(self, writer: int, start: int, length: int) -> bytes:
        rel = self.rel(writer)
        if self.whole_files:
            data = self._files.get(writer)
            if data is None:
                data = self._files[writer] = self._read_whole(rel)
            if start + length > len(data):
                raise IntegrityError(f"{rel}: {len(data)} bytes, a record needs bytes up to {start + length} "
                                     "(the index file is truncated)")
            return data[start : start + length]
        buf = bytearray(length)
        try:
            self.storage.read_into(self.storage.join(self.path, rel), [(start, length)], memoryview(buf), base=start)
        except FileNotFoundError as e:
            raise IntegrityError(f"index file {rel!r} is missing (the checkpoint is damaged)") from e
        except EOFError as e:
            raise IntegrityError(f"{rel}: truncated index file ({e})") from e
        return bytes(buf)

    def _read_whole(self, rel: str) -> bytes:
        try:
            return self.storage.read_bytes(self.storage.join(self.path, rel))
        except FileNotFoundError as e:
            raise IntegrityError(f"index file {rel!r} is missing (the checkpoint is damaged)") from e

    def records(self, writer: int, slots: list[int]) -> dict[int, IndexRecord]:
        """``{slot: record}`` of rank ``writer``'s parts at ``slots`` (sorted or not). Raises
        IntegrityError for a missing, truncated or malformed index file."""
        if not slots:
            return {}
        rel = self.rel(writer)
        head = self._read(writer, 0, HEADER.size)
        magic, version, rsize, count, who = HEADER.unpack(head)
        if magic != INDEX_MAGIC or version != INDEX_VERSION or rsize != RECORD.size or who != writer:
            raise IntegrityError(f"{rel}: not a unickpt index file of rank {writer} (magic {magic!r}, version "
                                 f"{version}, record size {rsize}, rank {who})")
        if self.slots is not None and count != self.slots:
            raise IntegrityError(f"{rel}: its header says {count} records, metadata.json's index.slots "
                                 f"{self.slots} (the index file is damaged)")
        lo, hi = min(slots), max(slots)
        if hi >= count:
            raise IntegrityError(f"{rel}: has {count} records, metadata.json names slot {hi}")
        table = self._read(writer, HEADER.size + lo * RECORD.size, (hi - lo + 1) * RECORD.size)
        raw = {s: RECORD.unpack_from(table, (s - lo) * RECORD.size) for s in set(slots)}
        with_blocks = [r for r in raw.values() if r[1]]
        blocks = b""
        first = 0
        if with_blocks:
            first = min(r[6] for r in with_blocks)
            end = max(r[6] + 8 * r[1] for r in with_blocks)
            blocks = self._read(writer, first, end - first)
        out = {}
        for s, (segment, nblocks, offset, length, digest, block_bytes, at) in raw.items():
            if nblocks and (block_bytes <= 0 or nblocks != -(-length // block_bytes)):
                raise IntegrityError(f"{rel}: slot {s} has {nblocks} block checksums for {length} bytes in blocks "
                                     f"of {block_bytes}")
            sums = tuple(_hex(int.from_bytes(blocks[at - first + 8 * i : at - first + 8 * i + 8], "little"))
                         for i in range(nblocks))
            out[s] = IndexRecord(segment, offset, length, _hex(digest), sums, block_bytes if nblocks else 0)
        return out
