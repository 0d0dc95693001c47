"""The reads of a load, round by round within the read-buffer budget, and their redistribution.

Who does what (every rank of the load's group, on the caller's thread plus a pool of read threads):
each rank runs the segments it reads or needs (its part of the read plan), in chunk order, in rounds
of at most ``read_buffer_bytes`` of chunks; rounds differ between ranks, and cannot deadlock: a rank
waits only on ranks whose rounds end at a lower chunk id. Per round, it posts the receives of the
segments others read for it (point-to-point on the private *plan* gloo group; the tag of a transfer
is its ordinal among the transfers between the two ranks, which both sides number alike),
reads the segments the read plan gives it (ranged reads,
touching segments of one chunk coalesced into one request, ``read_threads`` in flight), verifies them,
sends each to the other ranks that need it, then copies everything into the caller's tensors (or has
read it straight into them). Before its first read a rank checks the length of every file it reads
(one ``size`` per file): a truncated file fails the load before any of this rank's bytes land. A
failed read does not stop the rank from serving its peers; the
failure is raised on every rank after the last round (one ``all_gather_object``, 2 collectives).
With redistribution off every rank reads its own needs and nothing is sent.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import torch
import torch.distributed as dist

from ..dist import failures
from ..dist.comm import Comm
from ..dist.p2p import wait_all
from ..errors import IntegrityError
from ..options import LoadOptions
from ..plan.needs import ChunkTable
from ..plan.read_plan import Segment, batches
from ..storage.base import StorageBackend
from .reads import copy_overlaps, read_ranges, verify_ranges
from .stats import LoadStats
from .targets import TargetReads

__all__ = ["read_and_exchange"]


def _tags(me: int, segments: list[Segment]) -> dict[tuple[int, int], int]:
    """``(segment index, peer) -> tag`` of every transfer of ``segments`` (this rank's, in chunk
    order): the ordinal of the transfer among those between this rank and the peer in that direction.
    The peer lists the same transfers in the same order, so both sides agree without a global id."""
    sent: dict[int, int] = {}
    got: dict[int, int] = {}
    tags = {}
    for i, seg in enumerate(segments):
        if seg.reader == me:
            for dst in seg.needers:
                if dst != me:
                    tags[(i, dst)] = sent[dst] = sent.get(dst, -1) + 1
        else:
            tags[(i, seg.reader)] = got[seg.reader] = got.get(seg.reader, -1) + 1
    return tags


def read_and_exchange(comm: Comm, storage: StorageBackend, path: str, table: ChunkTable, need: TargetReads,
                       segments: list[Segment], options: LoadOptions, stats: LoadStats) -> dict[str, int]:
    """Run this rank's segments (each read by this rank or needed by it, sorted by chunk id and
    start) round by round; returns elements copied per fqn."""
    me = comm.rank
    filled: dict[str, int] = {}
    budget, verify = options.read_buffer_bytes, options.verify
    assert budget is not None, "LoadOptions.validated() sets read_buffer_bytes"
    sizes = {cid: table.byte_length(cid) for cid in {s.chunk_id for s in segments}}
    tags = _tags(me, segments)
    index_of = {id(s): i for i, s in enumerate(segments)}
    threads = options.read_threads
    error: BaseException | None = _check_file_lengths(storage, path, table, [s for s in segments if s.reader == me])
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="unickpt-read") as pool:
        for round_segments in batches(segments, sizes, budget):
            stats.rounds += 1
            buffers: dict[int, tuple[torch.Tensor, int]] = {}
            for cid in dict.fromkeys(s.chunk_id for s in round_segments):
                if cid in need.direct and error is not None:  # failed already: only serve the peers
                    buffers[cid] = (torch.empty(sizes[cid], dtype=torch.uint8), 0)
                elif cid in need.direct:
                    buffers[cid] = (need.direct[cid], 0)
                elif cid in need.ranges:
                    rs = need.ranges[cid]
                    buffers[cid] = (torch.empty(rs[-1][0] + rs[-1][1] - rs[0][0], dtype=torch.uint8), rs[0][0])
            stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, sum(
                b.numel() for cid, (b, _) in buffers.items() if cid not in need.direct))

            def view(seg: Segment) -> torch.Tensor:
                buf, lo = buffers[seg.chunk_id]
                return buf[seg.start - lo : seg.start - lo + seg.length]

            works: list[dist.Work | None] = []  # None: never (every rank here is in the group)
            for seg in round_segments:
                if seg.reader != me and me in seg.needers:
                    works.append(dist.irecv(view(seg), src=comm.ranks[seg.reader], group=comm.plan_group,
                                            tag=tags[(index_of[id(seg)], seg.reader)]))
                    stats.bytes_received += seg.length

            def read(job: list[Segment]) -> tuple[int, int]:
                """Worker thread: one ranged read of touching segments; (bytes read, blocks verified)."""
                chunk = table.chunk(job[0].chunk_id)
                buf, lo = buffers[job[0].chunk_id]
                span = [(job[0].start, job[-1].start + job[-1].length - job[0].start)]
                file = storage.join(path, chunk.file)
                nbytes = read_ranges(storage, file, chunk, span, buf, lo)
                label = f"{file} ({table.locate(job[0].chunk_id)[0]!r})"  # a checksum error names the key too
                return nbytes, (verify_ranges(buf, lo, span, chunk, label) if verify else 0)

            mine = {pool.submit(read, job): job for job in _coalesce([s for s in round_segments if s.reader == me])}
            for fut in as_completed(mine):
                try:
                    nbytes, blocks = fut.result()
                    stats.bytes_read, stats.reads = stats.bytes_read + nbytes, stats.reads + 1
                    stats.blocks_verified += blocks
                except Exception as e:  # keep serving the peers (they are waiting), fail after the round
                    error = error or e
                for seg in mine[fut]:
                    for dst in seg.needers:
                        if dst != me:
                            works.append(dist.isend(view(seg), dst=comm.ranks[dst], group=comm.plan_group,
                                                    tag=tags[(index_of[id(seg)], dst)]))
                            stats.bytes_sent += seg.length
            wait_all(works)
            if error is not None:  # keep serving the peers in later rounds; copy nothing; report at the end
                continue
            t_copy = time.perf_counter()
            for cid, (buf, lo) in buffers.items():
                if cid in need.direct:  # already in place
                    o = need.overlaps[cid][0]
                    filled[o.fqn] = filled.get(o.fqn, 0) + o.inter.numel
                    continue
                for fqn, n in _copy(buf, lo, need.overlaps.get(cid, []), table.dtype(cid)).items():
                    filled[fqn] = filled.get(fqn, 0) + n
            stats.copy_s += time.perf_counter() - t_copy
    if comm.world_size > 1 or error is not None:
        failures.gather_load_outcomes(comm, path, error)
    return filled


def _check_file_lengths(storage: StorageBackend, path: str, table: ChunkTable, mine: list[Segment]) -> BaseException | None:
    """Before this rank's first read: every file it reads holds the bytes its segments need (one
    ``size`` per file). A truncated file is then an IntegrityError naming the file, its length and the
    length needed, and this rank copies nothing into the caller's tensors (its peers are still served
    and the error reaches every rank at the end, as any failed read's), instead of a load that fails
    half-way with the bytes before the cut already in place. A file that cannot be looked at is left
    to its read."""
    need: dict[str, int] = {}
    for seg in mine:
        chunk = table.chunk(seg.chunk_id)
        file = storage.join(path, chunk.file)
        need[file] = max(need.get(file, 0), chunk.byte_offset + seg.start + seg.length)
    for file, nbytes in need.items():
        try:
            held = storage.size(file)
        except OSError:
            continue
        if held < nbytes:
            return IntegrityError(f"truncated checkpoint file: {file}: the file holds {held} bytes, the checkpoint "
                                  f"needs {nbytes} (the file is truncated)")
    return None


def _coalesce(segments: list[Segment]) -> list[list[Segment]]:
    """Group one reader's segments into read requests: touching segments of one chunk go together."""
    jobs: list[list[Segment]] = []
    for seg in sorted(segments, key=lambda s: (s.chunk_id, s.start)):
        last = jobs[-1][-1] if jobs else None
        if last is not None and last.chunk_id == seg.chunk_id and last.start + last.length == seg.start:
            jobs[-1].append(seg)
        else:
            jobs.append([seg])
    return jobs


def _copy(buf: torch.Tensor, lo: int, overlaps: list, dtype: torch.dtype) -> dict[str, int]:
    by_fqn: dict[str, list] = {}
    for o in overlaps:
        by_fqn.setdefault(o.fqn, []).append(o)
    return {fqn: copy_overlaps(buf, lo, os_, dtype) for fqn, os_ in by_fqn.items()}



