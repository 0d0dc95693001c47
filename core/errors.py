"""Typed errors raised by unickpt.

Every error subclasses :class:`UnickptError` *and* the nearest built-in exception, so callers can
catch either (``except ValueError`` still catches a shape mismatch).
"""
from __future__ import annotations

__all__ = [
    "UnickptError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "FormatVersionError",
    "StateMismatchError",
    "ReplicaMismatchError",
    "IntegrityError",
    "PerRankReshardError",
    "UnsafeObjectError",
    "RankFailuresError",
    "SaveFailedError",
    "LoadFailedError",
]


class UnickptError(Exception):
    """Base class of every error unickpt raises on purpose."""


class CheckpointNotFoundError(UnickptError, FileNotFoundError):
    """The path holds no committed checkpoint (no ``metadata.json``)."""


class CheckpointExistsError(UnickptError, FileExistsError):
    """A save would overwrite a committed checkpoint; committed checkpoints are never modified."""


class FormatVersionError(UnickptError, ValueError):
    """``metadata.json`` has a format name or version this release cannot read."""


class StateMismatchError(UnickptError, ValueError):
    """The state to load into does not match the checkpoint (missing/unexpected key, shape, dtype)."""


class ReplicaMismatchError(StateMismatchError):
    """Ranks hold different values under the name of a tensor saved as replicated (a plain tensor, a
    ``Replicate`` DTensor dim, the same shard box on several ranks), so writing it once would lose all
    but one rank's copy (:mod:`unickpt.replicas`). Raised on every rank of the save."""


class IntegrityError(UnickptError, OSError):
    """Stored bytes do not match their recorded checksum or length (corrupt or truncated file)."""


class PerRankReshardError(UnickptError, ValueError):
    """Per-rank state was saved at another world size and the object gives no ``reshard`` rule."""


class UnsafeObjectError(UnickptError, ValueError):
    """A stored object needs arbitrary unpickling, which is off unless ``allow_pickle=True``."""


class RankFailuresError(UnickptError, RuntimeError):
    """Base of the errors that report several ranks' failures of one collective operation.

    Attributes:
        path: the checkpoint path.
        failures: ``{rank: "ExceptionType: message\\n<traceback>"}`` for every rank that failed.
    """

    headline = "{op} of {path!r} failed on rank(s) {ranks}"
    op = "operation"

    def __init__(self, path: str, failures: dict[int, str]):
        self.path = path
        self.failures = dict(failures)
        lines = [self.headline.format(op=self.op, path=path, ranks=sorted(failures))]
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
        super().__init__("\n".join(lines))


class SaveFailedError(RankFailuresError):
    """A save failed on one or more ranks; nothing was committed (see :class:`RankFailuresError`).

    ``committed`` is None when this rank cannot know (it lost contact with group rank 0 during the
    commit: ``metadata.json`` may have been written), else False."""

    headline = "save to {path!r} failed on rank(s) {ranks}; nothing was committed"

    def __init__(self, path: str, failures: dict[int, str], committed: bool | None = False):
        self.committed = committed
        if committed is None:
            self.headline = ("save to {path!r} failed on rank(s) {ranks}; whether it committed is unknown "
                             "(look for its metadata.json)")
        super().__init__(path, failures)


class LoadFailedError(RankFailuresError):
    """A load failed on one or more ranks with different errors (see :class:`RankFailuresError`)."""

    op = "load"
