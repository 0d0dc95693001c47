"""The rules of one checkpoint directory: when it is committed, who is writing it, when it may be
replaced or removed, and how it is removed.

- Committed: ``metadata.json`` is present (written last, atomically: :mod:`unickpt.saving.commit`).
- Being written: the saving process writes :data:`~unickpt.format.files.WRITER_FILE` first (host,
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

:class:`CheckpointDir` is the one owner of a checkpoint directory: core, tiers, tools and plugins ask
it (claim, commit, is-committed, remove) rather than looking for ``metadata.json`` themselves; the
module functions below are its rules, kept as functions for the callers inside ``lifecycle``.

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
from ..format.files import (METADATA_FILE, SUBDIRS, WRITER_FILE, is_own_entry, is_own_file, is_partial_entry,
                            is_safetensors_entry)
from ..format.metadata import FORMAT_NAME, CheckpointMetadata, read_extra, read_metadata
from ..storage.base import StorageBackend

__all__ = ["CheckpointDir", "WRITER_STALE_S", "is_committed", "is_incomplete_checkpoint", "writer_record",
           "writer_is_this_process", "writer_alive", "writer_failed", "mark_failed", "leftover_reason", "writer_elsewhere_on_host", "pid_alive",
           "foreign_entry", "check_removable", "remove_dir", "prepare_target"]

log = logging.getLogger("unickpt")

WRITER_STALE_S = 3600.0  # a writer on another host that has not committed for this long is presumed dead


def is_committed(storage: StorageBackend, path: str) -> bool:
    """Whether ``path`` holds a committed checkpoint (its ``metadata.json``)."""
    return storage.exists(storage.join(path, METADATA_FILE))


def is_incomplete_checkpoint(storage: StorageBackend, path: str) -> bool:
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
    """The contents of :data:`~unickpt.format.files.WRITER_FILE` for this process."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()


def _record(storage: StorageBackend, path: str) -> dict | None:
    try:
        rec = json.loads(storage.read_bytes(storage.join(path, WRITER_FILE)))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def writer_failed(storage: StorageBackend, path: str) -> bool:
    """Whether the writer record of ``path`` says its save failed (:func:`mark_failed`)."""
    rec = _record(storage, path)
    return rec is not None and rec.get("failed") is True


def mark_failed(storage: StorageBackend, path: str) -> bytes | None:
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


def writer_is_this_process(storage: StorageBackend, path: str) -> bool:
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


def writer_alive(storage: StorageBackend, path: str) -> bool:
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


def writer_elsewhere_on_host(storage: StorageBackend, path: str) -> bool:
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


def leftover_reason(storage: StorageBackend, path: str, older: bool, in_flight: Callable[[str], bool] | None = None) -> str | None:
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


def foreign_entry(storage: StorageBackend, path: str) -> str | None:
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


def check_removable(storage: StorageBackend, path: str) -> bool:
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


def remove_dir(storage: StorageBackend, path: str) -> None:
    """Uncommit ``path`` (remove ``metadata.json``), then remove its tree. Entries that vanish
    meanwhile (another removal, or a retention, removing it too) are fine."""
    storage.rm(storage.join(path, METADATA_FILE))  # uncommit first
    storage.rm(path)


def prepare_target(storage: StorageBackend, path: str, *, in_flight: Callable[[str], bool],
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


class CheckpointDir:
    """One checkpoint directory ``path`` on ``storage``: the one owner of its commit marker
    (``metadata.json``) and writer record. Holds no state besides the two; every call asks storage.

    Call order of a save (group rank 0; every other rank only writes its data files)::

        d = CheckpointDir(storage, path)
        d.prepare(in_flight=...)   # or d.claim() on a directory known to be new: the writer record
        ...                        # the data, object and index files
        d.commit(metadata)         # THE commit point: metadata.json, atomically, last

    and of its removal: :meth:`uncommit` (``metadata.json`` goes, so it no longer loads), then the
    tree (:meth:`remove` does both). Readers ask :meth:`is_committed` / :meth:`read_metadata`;
    retention and the tools ask :meth:`is_incomplete`, :meth:`writer_alive`, :meth:`leftover_reason`.
    No call is collective. Storage errors other than "not found" raise OSError (StorageError).

    Args:
        storage: the backend ``path`` lives on (:func:`~unickpt.storage.open_storage`).
        path: the checkpoint directory (a local path or a URL of ``storage``).
    """

    MARKER_NAME = METADATA_FILE  #: the commit marker's file name, written last (a copy of a checkpoint writes it last too)
    WRITER_NAME = WRITER_FILE  #: the writer record's file name (not part of a committed checkpoint's content)

    def __init__(self, storage: StorageBackend, path: str) -> None:
        self.storage, self.path = storage, path

    @classmethod
    def open(cls, path: str, storage_options: dict | None = None) -> CheckpointDir:
        """The directory ``path`` on the storage its URL names (:func:`~unickpt.storage.open_storage`)."""
        from ..storage import open_storage

        return cls(open_storage(path, storage_options), path)

    @staticmethod
    def pid_alive(pid: int) -> bool:
        """Whether process ``pid`` of this host is alive (a writer record's or a plugin's own)."""
        return pid_alive(pid)

    def __repr__(self) -> str:
        return f"CheckpointDir({self.path!r})"

    @property
    def metadata_path(self) -> str:
        """The full path of the commit marker, ``<path>/metadata.json``."""
        return self.storage.join(self.path, METADATA_FILE)

    @property
    def writer_path(self) -> str:
        """The full path of the writer record (:data:`~unickpt.format.files.WRITER_FILE`)."""
        return self.storage.join(self.path, WRITER_FILE)

    # -- a save --------------------------------------------------------------------------------------
    def prepare(self, *, in_flight: Callable[[str], bool], ours_in_flight: Callable[[str], bool] | None = None,
                writer: bool = True) -> None:
        """Make the directory ready for a new save, then :meth:`claim` it (``writer``): see
        :func:`prepare_target` (raises CheckpointExistsError for a committed, in-flight or foreign one)."""
        prepare_target(self.storage, self.path, in_flight=in_flight, ours_in_flight=ours_in_flight, writer=writer)

    def claim(self) -> None:
        """Write the writer record naming this process (host, pid, time): the directory is being
        written. Raises OSError when storage fails."""
        self.storage.write_small(self.writer_path, writer_record())

    def commit(self, metadata: CheckpointMetadata | bytes) -> None:
        """Write ``metadata.json`` atomically: the commit point (from here on the checkpoint loads).
        ``metadata`` is the checkpoint's :class:`~unickpt.format.metadata.CheckpointMetadata` or its
        serialized bytes (``to_json().encode()``). Storage may report an error after the replace took
        effect (a lost reply, a failing directory sync): the file is read back, and if it holds exactly
        these bytes the commit stands (logged as a warning); any other outcome raises the write's
        error (OSError)."""
        data = metadata if isinstance(metadata, bytes) else metadata.to_json().encode()
        try:
            self.storage.write_atomic(self.metadata_path, data)
        except Exception as e:
            try:
                landed = self.storage.read_bytes(self.metadata_path) == data
            except Exception:  # noqa: BLE001 - cannot tell: the write's own error stands
                landed = False
            if not landed:
                raise
            log.warning("unickpt: the storage reported an error writing %s (%r), but it holds this commit: "
                        "the save is committed", self.metadata_path, e)

    def mark_failed(self) -> bytes | None:
        """Mark the writer record failed when it names this process: :func:`mark_failed`."""
        return mark_failed(self.storage, self.path)

    # -- questions -----------------------------------------------------------------------------------
    def is_committed(self) -> bool:
        """Whether ``metadata.json`` is present (whoever's format; :meth:`is_unickpt` checks it)."""
        return is_committed(self.storage, self.path)

    def is_unickpt(self) -> bool:
        """Whether ``metadata.json`` is present and unickpt's (its ``format``), not another
        framework's file of that name (megatron-core's). False when it is missing or unreadable."""
        try:
            doc = json.loads(self.storage.read_bytes(self.metadata_path))
        except (OSError, ValueError):
            return False
        return isinstance(doc, dict) and doc.get("format") == FORMAT_NAME

    def is_incomplete(self) -> bool:
        """Whether it holds nothing but what an unfinished save writes: :func:`is_incomplete_checkpoint`."""
        return is_incomplete_checkpoint(self.storage, self.path)

    def read_metadata(self) -> CheckpointMetadata:
        """The parsed ``metadata.json``. Raises CheckpointNotFoundError (uncommitted), FormatVersionError,
        IntegrityError (malformed), StorageError: :func:`~unickpt.format.metadata.read_metadata`."""
        return read_metadata(self.storage, self.path)

    def read_extra(self) -> dict:
        """Only the ``extra`` dict of ``metadata.json`` (what a plugin recorded with the save), about a
        third of the cost of :meth:`read_metadata`. Raises as :meth:`read_metadata`
        (:func:`~unickpt.format.metadata.read_extra`)."""
        return read_extra(self.storage, self.path)

    def metadata_bytes(self) -> bytes:
        """``metadata.json`` as stored (to commit a copy elsewhere byte for byte). Raises
        FileNotFoundError when uncommitted, OSError when the read fails."""
        return self.storage.read_bytes(self.metadata_path)

    def files(self, *, with_marker: bool = True) -> list[str]:
        """The files of a committed checkpoint as ``/``-separated paths relative to it, sorted, with
        the commit marker last (``with_marker``; a copy written in this order commits last); the writer
        record and temporaries (``.tmp-`` in the name) are left out. Raises FileNotFoundError when it is
        not committed, OSError when a listing fails."""
        def walk(rel: str) -> list[str]:
            out = []
            for name in self.storage.listdir(self.storage.join(self.path, rel) if rel else self.path):
                sub = f"{rel}/{name}" if rel else name
                if ".tmp-" in name or sub in (METADATA_FILE, WRITER_FILE):
                    continue
                out += walk(sub) if self.storage.isdir(self.storage.join(self.path, sub)) else [sub]
            return out

        if not self.is_committed():
            raise FileNotFoundError(f"{self.path}: not a committed checkpoint")
        return sorted(walk("")) + ([METADATA_FILE] if with_marker else [])

    def writer_alive(self) -> bool:
        """Whether its writer may still be running: :func:`writer_alive`."""
        return writer_alive(self.storage, self.path)

    def writer_elsewhere_on_host(self) -> bool:
        """Whether its writer is another live process of this host: :func:`writer_elsewhere_on_host`."""
        return writer_elsewhere_on_host(self.storage, self.path)

    def writer_is_this_process(self) -> bool:
        """Whether its writer record names this process (host and pid)."""
        return writer_is_this_process(self.storage, self.path)

    def leftover_reason(self, older: bool, in_flight: Callable[[str], bool] | None = None) -> str | None:
        """Why it is a leftover retention removes, or None: :func:`leftover_reason`."""
        return leftover_reason(self.storage, self.path, older, in_flight)

    def link_safetensors(self, dest: str) -> list[str]:
        """Hard-link this committed checkpoint's Hugging Face safetensors files (``SaveOptions.safetensors``:
        ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``)
        into the local folder ``dest``, so that tools reading a framework's folder (``from_pretrained``,
        ``safetensors.torch.load_file(dest + "/model.safetensors")``) read them: no byte is copied, and
        the names stay valid when this checkpoint is removed later. Every file is first linked under a
        temporary name; only when all links exist does each replace its name in ``dest`` (``os.replace``,
        atomic per name), the index last; then the names of that pattern in ``dest`` that this checkpoint
        lacks (an earlier save with another number of writers) are removed. A failing link replaces
        nothing (its temporaries are removed, and the error raised), so ``dest`` never mixes two saves'
        files that way; a process killed between the replacements can leave such a mix (a directory's
        names cannot be swapped at once). Returns the linked names, sorted (empty when the save wrote none).

        Raises FileNotFoundError when the checkpoint is not committed, ValueError when it or ``dest`` is
        not on the local file system, OSError when the file system refuses hard links (another device,
        too many links).
        """
        if not self.storage.is_local:
            raise ValueError(f"{self.path}: linking safetensors files needs a local checkpoint")
        if "://" in dest and not dest.startswith("file://"):
            raise ValueError(f"{dest}: linking safetensors files needs a local folder")
        source = self.storage.strip(self.path)
        dest = self.storage.strip(dest)
        names = sorted(n for n in self.files(with_marker=False) if is_safetensors_entry(n))
        names.sort(key=lambda n: n.endswith(".json"))  # the index after the files it names
        staged: list[tuple[str, str]] = []
        try:
            for name in names:
                tmp = os.path.join(dest, f".{name}.tmp-{os.getpid()}")
                if os.path.lexists(tmp):
                    os.remove(tmp)
                os.link(os.path.join(source, name), tmp)
                staged.append((tmp, name))
        except BaseException:
            for tmp, _ in staged:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
            raise
        for tmp, name in staged:
            os.replace(tmp, os.path.join(dest, name))
        self.remove_safetensors(dest, keep=names)
        return sorted(names)

    @staticmethod
    def remove_safetensors(dest: str, keep: list[str] | tuple[str, ...] = ()) -> list[str]:
        """Remove the Hugging Face safetensors names (those :meth:`link_safetensors` makes) from the local
        folder ``dest``, except ``keep``. Names vanishing meanwhile are fine. Returns the removed names.
        Raises OSError when a removal fails otherwise."""
        removed = []
        for name in os.listdir(dest):
            if is_safetensors_entry(name) and name not in keep:
                try:
                    os.remove(os.path.join(dest, name))
                except FileNotFoundError:
                    continue
                removed.append(name)
        return removed

    # -- removal -------------------------------------------------------------------------------------
    def uncommit(self) -> None:
        """Remove ``metadata.json`` (a missing one is fine): from now on it does not load."""
        self.storage.rm(self.metadata_path)

    def remove(self) -> None:
        """:meth:`uncommit`, then remove the tree (entries vanishing meanwhile are fine). Checks nothing:
        :func:`check_removable` says whether it may be removed."""
        remove_dir(self.storage, self.path)
