"""Typed errors that reach every rank: a rank's failure is gathered and raised on all of them.

A collective operation (a load, a DCP migration) must not leave some ranks waiting on a peer that
has failed: every rank joins one gather of its outcome (:func:`gather_load_outcomes`), and where any rank failed
every rank raises. The failing rank raises its own exception; the others raise the same typed
unickpt error when the failing ranks agree on one (``StateMismatchError`` stays a
``StateMismatchError`` everywhere), else :class:`~unickpt.errors.LoadFailedError` naming every
failed rank with its traceback. Cost: one ``all_gather_object`` (2 collectives) per :func:`gather_load_outcomes`.

A rank that dies (or leaves the process group) cannot take part: the survivors' collective breaks
(gloo: "Connection reset by peer"), and each survivor raises :func:`lost_contact`'s error, which names
the ranks it lost (a broken collective does not say which peer died: with two ranks, exactly the other
one; else every other rank, "one or more of"), never the survivor as the rank that failed.
"""
from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any

from ..errors import (CheckpointNotFoundError, FormatVersionError, IntegrityError, LoadFailedError,
                      PerRankReshardError, RankFailuresError, StateMismatchError, StorageError, UnsafeObjectError)

if TYPE_CHECKING:
    from .comm import Comm

__all__ = ["describe", "raise_failures", "gather_load_outcomes", "lost_contact"]

_SAME_TYPE_ERRORS = {cls.__name__: cls for cls in (StateMismatchError, IntegrityError, CheckpointNotFoundError,
                                                     FormatVersionError, PerRankReshardError, UnsafeObjectError,
                                                     StorageError)}
# bad arguments of the call (options), tagged by the caller: raised with the built-in type on every rank
_ARGUMENT_ERRORS = {"options:ValueError": ValueError, "options:TypeError": TypeError}


def describe(e: BaseException | None, tag: str | None = None) -> tuple[str, str, str] | None:
    """``(type name, message, traceback text)`` of a failure, or None: what a rank contributes to the
    gather. ``tag`` prefixes the type name (``"options"``: a bad argument of the call)."""
    if e is None:
        return None
    kind = type(e).__name__ if tag is None else f"{tag}:{type(e).__name__}"
    return kind, str(e), "".join(traceback.format_exception(type(e), e, e.__traceback__))


def raise_failures(path: str, failures: list, local_error: BaseException | None) -> None:
    """Raise the same error on every rank when any rank failed (``failures``: every rank's
    :func:`describe`, in group-rank order): the local exception where this rank failed; elsewhere
    the failing ranks' error type if they agree on one of unickpt's, else LoadFailedError."""
    failed = {r: f for r, f in enumerate(failures) if f is not None}
    if not failed:
        return
    if local_error is not None:
        raise local_error
    kinds = {f[0] for f in failed.values()}
    first = min(failed)
    same = {**_SAME_TYPE_ERRORS, **_ARGUMENT_ERRORS}
    if len(kinds) == 1 and failed[first][0] in same:
        raise same[failed[first][0]](f"rank {first}: {failed[first][1]}")
    raise LoadFailedError(path, {r: f[2] for r, f in failed.items()})


def gather_load_outcomes(comm: Comm, path: str, local_error: BaseException | None, extra: Any = None, tag: str | None = None) -> list:
    """Gather every rank's outcome (and ``extra``) on ``comm``'s plan group and raise on every rank if
    any failed (:func:`raise_failures`; ``tag``: see :func:`describe`). Returns every rank's ``extra``,
    in group-rank order."""
    try:
        gathered = comm.all_gather((describe(local_error, tag), extra), comm.plan_group)
    except RuntimeError as e:  # a peer died or left (gloo; DistBackendError): the others' outcomes are lost
        raise lost_contact(LoadFailedError, path, comm.rank, comm.world_size, "while the ranks compared their "
                           "needs", e) from (local_error or e)
    raise_failures(path, [g[0] for g in gathered], local_error)
    return [g[1] for g in gathered]


def lost_contact(kind: type[RankFailuresError], path: str, rank: int, world_size: int, when: str,
                 error: BaseException, **kwargs: Any) -> RankFailuresError:
    """The error a surviving ``rank`` raises when a collective of the operation on ``path`` broke
    (``error``: the backend's, e.g. gloo's "Connection reset by peer"): a ``kind``
    (:class:`~unickpt.errors.SaveFailedError`, :class:`~unickpt.errors.LoadFailedError`; ``kwargs`` go to
    it) whose failed ranks are the ranks it lost contact with, each described from this rank's side
    with ``when`` (what was going on). With two ranks that is exactly the other rank; with more, every
    other rank (the collective does not say which one died)."""
    others = [r for r in range(world_size) if r != rank]
    who = f"rank {others[0]}" if len(others) == 1 else f"one or more of ranks {others}"
    text = (f"rank {rank} lost contact with {who} {when}: it died, stopped answering, or left the process group "
            f"before the operation finished ({type(error).__name__}: {' '.join(str(error).split())})")
    return kind(path, {r: text for r in others}, **kwargs)
