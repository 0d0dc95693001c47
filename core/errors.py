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
    "StorageError",
    "PerRankReshardError",
    "UnsafeObjectError",
    "RankFailuresError",
    "SaveFailedError",
    "EarlierSaveFailedError",
    "LoadFailedError",
    "SyncError",
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
    but one rank's copy (:mod:`unickpt.saving.replicas`). Raised on every rank of the save."""


class IntegrityError(UnickptError, OSError):
    """Stored bytes do not match their recorded checksum or length (corrupt or truncated file)."""


class StorageError(UnickptError, OSError):
    """A storage operation that decides what a checkpoint holds (a listing, a look at
    ``metadata.json``) failed for a reason other than "not found" (I/O error, permission, throttling
    past the retries): never read as "no checkpoint" or "uncommitted".

    ``errno`` is the cause's (when it has one); ``path`` the path it failed on; ``__cause__`` the error."""

    def __init__(self, message: str, path: str | None = None, cause: BaseException | None = None):
        super().__init__(getattr(cause, "errno", None), message)
        self.path = path
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # picklable (sent to the other ranks), errno kept
        return (type(self), (self.message, self.path, None if self.errno is None else OSError(self.errno, "")))


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

    def __reduce__(self):  # picklable (DCP gathers a rank's exception to the coordinator by pickling it)
        return (type(self), (self.path, self.failures))


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

    def __reduce__(self):
        return (type(self), (self.path, self.failures, self.committed))


class EarlierSaveFailedError(SaveFailedError):
    """One or more earlier saves failed after their call had returned (asynchronous saves); raised by the
    next ``save()``, ``wait()`` or ``close()`` (docs/design.md, "Failures of asynchronous saves"), on
    every rank, once. The message names each failed save by its step (or its path, for a save given no
    step) with its error.

    Attributes:
        errors: ``[(step or None, path, error)]``: each failed save, oldest first; ``error`` is its own
            exception (a :class:`SaveFailedError` naming the failed ranks, or the planning error).
        steps: the failed saves' steps (None for a save given none), oldest first.
        path: the oldest failed save's path; ``failures``: ``{rank: text}`` of every failed save, by rank.

    ``__cause__`` is the oldest failed save's error.
    """

    def __init__(self, errors: list[tuple[int | None, str, BaseException]]):
        if not errors:
            raise ValueError("EarlierSaveFailedError needs at least one failed save")
        self.errors = list(errors)
        self.steps = [step for step, _, _ in errors]
        self.path = errors[0][1]
        self.committed = None if any(getattr(e, "committed", False) is None for _, _, e in errors) else False
        failures: dict[int, list[str]] = {}
        for step, _, e in errors:
            for rank, text in getattr(e, "failures", {}).items():
                failures.setdefault(rank, []).append(f"step {step}: {text}" if step is not None else text)
        self.failures = {r: "\n".join(t) for r, t in failures.items()}
        names = ", ".join(_save_name(step, path) for step, path, _ in errors)
        lines = [f"{len(errors)} earlier asynchronous save(s) failed: {names}"]
        lines += [f"--- {_save_name(step, path)}: {type(e).__name__}: {e}" for step, path, e in errors]
        UnickptError.__init__(self, "\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.errors,))


def _save_name(step: int | None, path: str) -> str:
    return f"step {step} ({path!r})" if step is not None else f"the save to {path!r}"


class LoadFailedError(RankFailuresError):
    """A load failed on one or more ranks with different errors (see :class:`RankFailuresError`)."""

    op = "load"


class SyncError(UnickptError, RuntimeError):
    """A live weight sync (:mod:`unickpt.sync`) did not deliver a version: a peer died or left mid-version,
    a message failed its checksum twice, or the trainer's layout changed under its plan. The inference
    side keeps the last version it applied."""
