"""One save's run on one rank, as the save pipeline (:mod:`.pipeline`) drives it, split by who writes
what: :class:`Run` is set up once by the save thread (:meth:`~.pipeline.SavePipeline.begin`) and never
changed; what changes lives in the part of the one thread that writes it: :class:`StagingGate`
(the save thread: pieces held back from the drain, CUDA begun), :class:`~.transfers.TransferLog` (the
save thread: merge transfers posted), :class:`DrainPart` (the drain threads and the uploader:
digests, stage times, bytes; merged into the save's stats once, by the commit thread), and
:class:`RunEvents`, the drain's callbacks, writes only those parts. No collective here.
"""
from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, NamedTuple

import torch

from ..plan.save_plan import SavePlan, WriteChunk
from .drain import DrainEvents, ThreadDrain
from .request import SaveProgress, SaveStats, SaveTask
from .staging import StagingPool
from .transfers import TransferLog
from .upload import Uploader
from .writer_process import ProcessDrain

__all__ = ["DrainResult", "StagedPiece", "StagingGate", "DrainPart", "Run", "RunEvents", "failure_text"]


def failure_text(stage: str, e: BaseException) -> str:
    """A stage failure as the save reports it: the stage's name, then the traceback."""
    return f"{stage}: " + "".join(traceback.format_exception(type(e), e, e.__traceback__))


@dataclass(frozen=True)
class DrainResult:
    """What the drain of one save produced on this rank: per chunk of ``plan.writes[rank]``,
    ``(checksum, block checksums, block bytes)`` (None where a chunk was not written), and whether
    the drain ran at all."""

    digests: list
    started: bool


class StagedPiece(NamedTuple):
    """Ring bytes ``[start, end)`` of chunk ``ci`` (of this rank's), staged; ``wait``: what the hasher
    runs first (a merge receive, a CUDA copy's event), or None."""

    start: int
    end: int
    ci: int
    wait: Callable[[], object] | None


class StagingGate:
    """The save thread's own part of a run: the gate that holds staged pieces back from the drain
    until it may start (``overlap_drain`` off: the end of the snapshot, or a full ring), and whether
    the run's CUDA copies have begun. The lock is taken once per piece, as the drain's queue does."""

    def __init__(self, open_: bool):
        self.lock = threading.Lock()
        self.open = open_
        self.held: list[StagedPiece] = []
        self.cuda_begun = False


@dataclass
class DrainPart:
    """The drain threads' (and the uploader's) part of a run, merged into the stats once by the
    commit thread (:meth:`SavePipeline.wait_drained`): per-chunk digests, stage times, bytes."""

    digests: list
    timings: dict = field(default_factory=lambda: {"checksum_s": 0.0, "merge_wait_s": 0.0, "write_s": 0.0,
                                                   "upload_s": 0.0})
    bytes_written: int = 0
    bytes_uploaded: int = 0
    backend_done: threading.Event = field(default_factory=threading.Event)
    uploads_done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Run:
    """One save's staging and drain on this rank, as :meth:`SavePipeline.begin` set it up (never
    changed after): ``mine`` (this rank's chunks), the ``leaves`` it reads, the ring (``pool``; None
    when preparing failed), the drain (``backend``; None when it was not started), each chunk's
    stream position. What changes is in the parts each thread owns: ``staging`` (save thread),
    ``transfers`` (save thread, read by the commit thread after staging), ``drained`` (drain threads)."""

    task: SaveTask
    progress: SaveProgress
    stats: SaveStats
    plan: SavePlan
    mine: list[WriteChunk]
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)
    guarded: frozenset = frozenset()
    cuda_ready: dict = field(default_factory=dict)
    pool: StagingPool | None = None
    backend: ThreadDrain | ProcessDrain | None = None
    in_place: bool = False  # the ring is the data file (SaveOptions.in_place)
    stream_pos: list[int] = field(default_factory=list)  # stream position of each of this rank's chunks
    staging: StagingGate = field(default_factory=lambda: StagingGate(False))
    transfers: TransferLog = field(default_factory=TransferLog)
    drained: DrainPart = field(default_factory=lambda: DrainPart([]))

    @property
    def seq(self) -> int:
        return self.task.seq

    def fail(self, text: str) -> None:
        self.progress.fail(text)


class RunEvents(DrainEvents):
    """The drain's callbacks (drain threads, uploader thread): they write only the runs' ``drained``
    parts and report failures."""

    def __init__(self, rank: int, uploader: Uploader):
        self.rank, self.uploader = rank, uploader
        self.active: dict[int, Run] = {}  # registered with the drain, not yet done

    def on_freed(self, seq: int, pos: int) -> None:
        run = self.active.get(seq)
        if run is not None and run.pool is not None:
            run.pool.freed(pos)

    def on_chunk(self, seq: int, c: int, digest: str, blocks: tuple, block_bytes: int) -> None:
        self.active[seq].drained.digests[c] = (digest, tuple(blocks), block_bytes)

    def on_segment(self, seq: int, i: int) -> None:
        run = self.active[seq]
        if run.task.options.upload_to is not None:
            rel = run.plan.segments[self.rank][i][0]
            self.uploader.upload_later(run.task, run.progress, rel, partial(self._uploaded, run))

    @staticmethod
    def _uploaded(run: Run, nbytes: int, seconds: float, error: BaseException | None) -> None:
        run.drained.bytes_uploaded += nbytes
        run.drained.timings["upload_s"] += seconds
        if error is not None:
            run.fail(failure_text("upload stage", error))

    def on_failed(self, seq: int, text: str) -> None:
        run = self.active.get(seq)
        if run is not None:
            run.fail(text)

    def on_done(self, seq: int, error: str | None, timings: dict) -> None:
        run = self.active.pop(seq, None)
        if run is None:
            return
        if error is not None:
            run.fail(error)
        for k in ("checksum_s", "merge_wait_s", "write_s"):
            run.drained.timings[k] = timings.get(k, 0.0)
        run.drained.bytes_written += timings.get("bytes_written", 0)
        run.drained.backend_done.set()
        if run.task.options.upload_to is not None:
            self.uploader.after_uploads(run.drained.uploads_done.set)
        else:
            run.drained.uploads_done.set()

    def on_died(self, text: str) -> None:
        for seq in list(self.active):
            self.on_failed(seq, text)
            self.on_done(seq, text, {})
