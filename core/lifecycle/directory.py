"""The rules of one checkpoint directory: when it is committed, who is writing it, when it may be
replaced or removed, and how it is removed.

- Committed: ``metadata.json`` is present (written last, atomically: :mod:`unickpt.saving.commit`).
- Being written: the saving process writes :data:`~unickpt.format.layout.WRITER_FILE` first (host,
  pid, time); :func:`writer_alive` tells a save in progress (pid alive on this host, or started less
  than :data:`WRITER_STALE_S` ago on another) from the leftovers of a crashed one. A save that fails
  marks its record ``"failed": true`` (:func:`mark_failed`): its directory is a leftover although its
  writer lives on.
- Leftover (:func:`leftover_reason`): incomplete, and its writer failed or is gone, whatever its
  step; without a writer record (a crash before it was written, a remote copy) only when older than
  the newest commit, as a newer one may be a save in flight.
- Incomplete: a directory holding nothing but what an unfinished save writes
  (:func:`is_incomplete_checkpoint`); a save may replace it once its writer is gone, retention may
  remove it. A directory holding anything else is never replaced or removed.
- Removal uncommits first (``metadata.json`` goes), then the tree goes (:func:`remove_dir`), so a
  half-removed directory is never loadable.
- A save's target (:func:`prepare_target`): a committed, in-flight or foreign directory is refused;
  a crashed save's leftovers are replaced.

Who calls what: group rank 0's save thread calls :func:`prepare_target` before planning; retention
(:class:`~unickpt.lifecycle.root.CheckpointRoot`) and the tools call the rest. No collective.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any, Callable

from ..errors import CheckpointExistsError, UnickptError
from ..format.layout import METADATA_FILE, SUBDIRS, WRITER_FILE, is_own_entry, is_own_file, is_partial_entry

__all__ = ["WRITER_STALE_S", "is_committed", "is_incomplete_checkpoint", "writer_record", "writer_is_this_process",
           "writer_alive", "writer_failed", "mark_failed", "leftover_reason", "writer_elsewhere_on_host", "pid_alive",
           "foreign_entry", "check_removable", "remove_dir", "prepare_target"]

log = logging.getLogger("unickpt")

WRITER_STALE_S = 3600.0  # a writer on another host that has not committed for this long is presumed dead


def is_committed(storage: Any, path: str) -> bool:
    """Whether ``path`` holds a committed checkpoint (its ``metadata.json``)."""
    return storage.exists(storage.join(path, METADATA_FILE))


def is_incomplete_checkpoint(storage: Any, path: str) -> bool:
    """True if ``path`` is a directory holding nothing but what an unfinished unickpt save writes
    (``data/<rank>_<n>.bin``, ``objects/rank_<r>.json``, a temporary metadata file, the writer
    record). A committed checkpoint, a file, or a directory with anything else is not. Whether its
    writer is still running is :func:`writer_alive`'s question."""
    if not storage.isdir(path) or is_committed(storage, path):
        return False
    for name in storage.listdir(path):
        if not is_partial_entry(name):
            return False
        if name in SUBDIRS:
            sub = storage.join(path, name)
            if not storage.isdir(sub) or not all(is_own_file(name, f) for f in storage.listdir(sub)):
                return False
    return True


def writer_record() -> bytes:
    """The contents of :data:`~unickpt.format.layout.WRITER_FILE` for this process."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()


def _record(storage: Any, path: str) -> dict | None:
    try:
        rec = json.loads(storage.read_bytes(storage.join(path, WRITER_FILE)))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def writer_failed(storage: Any, path: str) -> bool:
    """Whether the writer record of ``path`` says its save failed (:func:`mark_failed`)."""
    rec = _record(storage, path)
    return rec is not None and rec.get("failed") is True


def mark_failed(storage: Any, path: str) -> bytes | None:
    """Mark the writer record of ``path`` ``"failed": true`` when it names this process (group rank
    0, after its save into ``path`` failed). Best effort: storage that fails (full, read-only) leaves
    the record as it is (logged). Returns the record's bytes as they are now, None when unreadable."""
    name = storage.join(path, WRITER_FILE)
    try:
        data = storage.read_bytes(name)
        rec = json.loads(data)
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or not writer_is_this_process(storage, path):
        return data
    marked = json.dumps({**rec, "failed": True}).encode()
    try:
        storage.write_small(name, marked)
    except OSError as e:
        log.warning("unickpt: could not mark %s as a failed save's: %s", path, e)
        return data
    return marked


def writer_is_this_process(storage: Any, path: str) -> bool:
    """Whether the writer record of ``path`` names this process (host and pid)."""
    rec = _record(storage, path)
    return rec is not None and rec.get("host") == socket.gethostname() and rec.get("pid") == os.getpid()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a process of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def writer_alive(storage: Any, path: str) -> bool:
    """Whether the process that started the save into ``path`` may still be running: its pid is
    alive (same host), or it is on another host and started less than ``WRITER_STALE_S`` ago.
    False when there is no (readable) writer record, or it says the save failed."""
    rec = _record(storage, path)
    if rec is None or rec.get("failed") is True:
        return False
    if rec.get("host") != socket.gethostname():
        try:
            return time.time() - float(rec.get("time", 0)) < WRITER_STALE_S
        except (TypeError, ValueError):
            return True
    try:
        pid = int(rec["pid"])
    except (KeyError, ValueError, TypeError):
        return True
    return pid_alive(pid)


def writer_elsewhere_on_host(storage: Any, path: str) -> bool:
    """Whether the writer record of ``path`` names another live process of this host (not this
    process, whose own saves its engines wait for; a writer on another host is not checked)."""
    rec = _record(storage, path)
    if rec is None or rec.get("host") != socket.gethostname():
        return False
    try:
        pid = int(rec["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    return pid != os.getpid() and pid_alive(pid)


def leftover_reason(storage: Any, path: str, older: bool, in_flight: Callable[[str], bool] | None = None) -> str | None:
    """Why ``path`` is a leftover that retention and ``unickpt prune`` remove, or None: it is incomplete
    (:func:`is_incomplete_checkpoint`), not ``in_flight`` here, and its save failed (its record says
    so) or its writer is gone; without a writer record, only when ``older`` than the newest commit
    (a newer one may be a save in flight that has not written its record, or a remote copy)."""
    if (in_flight is not None and in_flight(path)) or not is_incomplete_checkpoint(storage, path):
        return None
    rec = _record(storage, path)
    if rec is None:
        return "incomplete (crashed save)" if older else None
    if rec.get("failed") is True:
        return "incomplete (failed save)"
    return None if writer_alive(storage, path) else "incomplete (its writer is gone)"


def foreign_entry(storage: Any, path: str) -> str | None:
    """The first entry of ``path`` a unickpt save does not write, or None."""
    for name in sorted(storage.listdir(path)):
        if not is_own_entry(name):
            return name
        if name in SUBDIRS:
            sub = storage.join(path, name)
            if not storage.isdir(sub):
                return name
            bad = [f for f in storage.listdir(sub) if not is_own_file(name, f)]
            if bad:
                return f"{name}/{sorted(bad)[0]}"
    return None


def check_removable(storage: Any, path: str) -> bool:
    """Raise UnickptError unless ``path`` is a unickpt checkpoint directory nobody is writing (not a
    symbolic link: its target may be another run's; nothing foreign inside). Returns whether it is
    committed."""
    if storage.islink(path):
        raise UnickptError(f"{path!r} is a symbolic link to {os.readlink(storage.strip(path))!r}; "
                           "not removing it or its target")
    if not storage.isdir(path):
        raise UnickptError(f"{path!r} is not a directory")
    foreign = foreign_entry(storage, path)
    if foreign is not None:
        raise UnickptError(f"{path!r} holds {foreign!r}, which no unickpt save writes; not removing it")
    committed = is_committed(storage, path)
    if not committed and writer_alive(storage, path):
        raise UnickptError(f"{path!r} is being written by a live process (see its {WRITER_FILE}); not removing it")
    return committed


def remove_dir(storage: Any, path: str) -> None:
    """Uncommit ``path`` (remove ``metadata.json``), then remove its tree. Entries that vanish
    meanwhile (another removal, or a retention, removing it too) are fine."""
    storage.rm(storage.join(path, METADATA_FILE))  # uncommit first
    storage.rm(path)


def prepare_target(storage: Any, path: str, *, in_flight: Callable[[str], bool],
                   ours_in_flight: Callable[[str], bool] | None = None, writer: bool = True) -> None:
    """Make ``path`` ready for a new save (group rank 0, before planning): refuse a committed, in-flight
    or foreign target; clear a crashed save's leftovers; create ``path/data`` and (``writer``) the
    writer record.

    Args:
        in_flight: ``in_flight(path)``: another save into ``path`` is still running in this engine.
        ours_in_flight: ``ours_in_flight(path)``: any save into ``path`` is running in this process (any
            engine). A leftover whose writer record names this process is replaced only when none is.

    Raises:
        CheckpointExistsError: a committed checkpoint, a save in flight (this process or a live writer),
            or a directory holding other files.
    """
    if in_flight(path):
        raise CheckpointExistsError(f"{path!r}: a save to this path is still in flight; wait for it first")
    if is_committed(storage, path):
        raise CheckpointExistsError(
            f"{path!r} already holds a committed checkpoint; committed checkpoints are never "
            "overwritten (choose a new path or step, or delete it first)"
        )
    if storage.exists(path):
        if not is_incomplete_checkpoint(storage, path):
            raise CheckpointExistsError(
                f"{path!r} exists and is not a unickpt checkpoint directory (it holds other files); "
                "refusing to delete it: choose another path"
            )
        # this process's own earlier save that failed (none of its engines has it in flight) is a leftover
        ours = writer_is_this_process(storage, path) and not (ours_in_flight or in_flight)(path)
        if writer_alive(storage, path) and not ours:
            raise CheckpointExistsError(
                f"{path!r}: another process is saving into it (see {WRITER_FILE}); wait for it or "
                "choose another step"
            )
        log.warning("unickpt: removing incomplete checkpoint directory %s (no %s)", path, METADATA_FILE)
        storage.rm(path)
    storage.makedirs(storage.join(path, "data"))
    if writer:
        try:
            storage.write_small(storage.join(path, WRITER_FILE), writer_record())
        except BaseException:  # a directory without a writer record would be nobody's: remove it now
            try:
                storage.rm(path)
            except OSError:
                log.warning("unickpt: could not remove %s after its writer record failed", path, exc_info=True)
            raise
