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
    "IntegrityError",
    "PerRankReshardError",
    "UnsafeObjectError",
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


class IntegrityError(UnickptError, OSError):
    """Stored bytes do not match their recorded checksum or length (corrupt or truncated file)."""


class PerRankReshardError(UnickptError, ValueError):
    """Per-rank state was saved at another world size and the object gives no ``reshard`` rule."""


class UnsafeObjectError(UnickptError, ValueError):
    """A stored object needs arbitrary unpickling, which is off unless ``allow_pickle=True``."""


class SaveFailedError(UnickptError, RuntimeError):
    """A save failed on one or more ranks; nothing was committed.

    Attributes:
        failures: ``{rank: "ExceptionType: message\\n<traceback>"}`` for every rank that failed.
    """

    def __init__(self, path: str, failures: dict[int, str]):
        self.path = path
        self.failures = dict(failures)
        lines = [f"save to {path!r} failed on rank(s) {sorted(failures)}; nothing was committed"]
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
        super().__init__("\n".join(lines))


class LoadFailedError(UnickptError, RuntimeError):
    """A load failed on one or more ranks with different errors.

    Attributes:
        failures: ``{rank: "<formatted traceback>"}`` for every rank that failed.
    """

    def __init__(self, path: str, failures: dict[int, str]):
        self.path = path
        self.failures = dict(failures)
        lines = [f"load of {path!r} failed on rank(s) {sorted(failures)}"]
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
        super().__init__("\n".join(lines))
