"""What a load reports: :class:`LoadStats` (bytes read, received and sent, requests, seconds per stage)."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LoadStats", "TIERS"]

TIERS = ("memory", "peer", "storage")  # where a load's bytes came from (docs/tiers.md)


@dataclass
class LoadStats:
    """Per-rank counters (bytes) and timings (seconds) of one load."""

    bytes_read: int = 0  # tensor bytes read from storage by this rank
    storage_bytes_read: int = 0  # everything this rank read, as counted by the storage layer
    index_bytes_read: int = 0  # format v2: records and block checksums of the split parts this rank reads
    reads: int = 0  # ranged read requests
    blocks_verified: int = 0  # small chunks, or blocks of large ones, checked against checksums
    bytes_received: int = 0  # over the process group, read by other ranks
    bytes_sent: int = 0
    plan_cache_hit: bool = False
    redistributed: bool = False  # read once job-wide and redistributed (see loading.loader._should_redistribute)
    rounds: int = 0  # read/exchange rounds (bounded read buffer)
    peak_buffer_bytes: int = 0
    plan_s: float = 0.0
    read_s: float = 0.0  # reads and exchange, overlapped
    copy_s: float = 0.0
    total_s: float = 0.0
    conversion: dict | None = None  # a cross-framework load: what moved and what stayed (interop.view.View)
    conversion_values: dict | None = None  # the checkpoint's canonical plain values (step, scheduler, ...)
    # the checkpoint tiers (Checkpointer.load with tiers; unickpt.tiers): the tier this rank's state
    # came from ("memory": this node's shared memory, "peer": another node's, sent over the group,
    # "storage": the persistent checkpoint), and its tensor bytes per tier
    tier: str | None = None
    bytes_by_tier: dict = field(default_factory=dict)
    peer_bytes_received: int = 0  # bytes of the memory copy received from another node (tier "peer")

    def as_dict(self) -> dict:
        return dict(self.__dict__)
