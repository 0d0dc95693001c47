"""Where the memory tiers live on a node, and the rules of their directories (no torch, no collective).

One node's memory directory (``TierOptions.memory_dir``, a tmpfs such as ``/dev/shm``; each run has
its own subdirectory, named after its persistent root)::

    <memory_dir>/run-<hash of the root>/
        run.json                            {"root": ..., "node": ...}: for people and `unickpt ls`
        own/rank_<r>_of_<W>/step_<N>/       tier 0: rank r's own copy of step N (saved by rank r)
        peer/rank_<q>_of_<W>/step_<N>/      tier 1: the copy of rank q's step N held here for it
        peer/rank_<q>_of_<W>/.incoming-<N>/ a peer copy being received (renamed to step_<N> when whole)
        own/rank_<r>_of_<W>/.restore-<N>/   a copy being received from a peer during recovery
        own/rank_<r>_of_<W>/.spare/         the data file of a removed copy, which the next save reuses
                                            (in-place staging: its memory pages are not allocated anew)
        own/rank_<r>_of_<W>/.sending/       second links of the files a peer copy is reading (a
                                            linked file is never reused while it is being sent)

Every ``step_<N>`` is a unickpt checkpoint directory of one rank's state saved by that rank alone
(``SaveOptions.partial``: ``layout.partial`` in its ``metadata.json``), so the commit rule, the
checksums and the tools (``unickpt verify``) apply unchanged. ``<W>`` (the world size) keeps copies of
another layout apart: they are never loaded into this one.

Who calls what: :class:`~unickpt.tiers.manager.Tiers` (the caller's thread: retention, inventory),
the peer threads (:mod:`.peer`: receive into ``.incoming-<N>``), recovery (:mod:`.recovery`), and
``unickpt ls`` (:func:`scan`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ..lifecycle.directory import CheckpointDir
from ..storage.local import LocalStorage

__all__ = ["MemoryLayout", "run_key", "copy_dir", "copy_files", "retain_steps", "remove_tree", "recycle_into",
           "dir_bytes", "STEP_DIR", "RANK_DIR", "SPARE_DIR", "SENDING_DIR"]

STEP_DIR = re.compile(r"^step_(0|[1-9][0-9]*)$")
RANK_DIR = re.compile(r"^rank_(0|[1-9][0-9]*)_of_([1-9][0-9]*)$")
KINDS = ("own", "peer")
SPARE_DIR = ".spare"  # own/rank_<r>_of_<W>/.spare/: data files of removed copies, for the next save to reuse
SENDING_DIR = ".sending"  # own/rank_<r>_of_<W>/.sending/: second links of files a peer copy is sending


def run_key(root: str) -> str:
    """The name of a run's subdirectory: ``run-`` and 12 hex digits of the persistent root's path
    (an absolute local path, or the URL as given)."""
    if "://" not in root:
        root = os.path.abspath(root)
    return "run-" + hashlib.sha1(root.rstrip("/").encode()).hexdigest()[:12]


def dir_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except FileNotFoundError:  # removed meanwhile
                pass
    return total


_LOCAL = LocalStorage()  # the memory tiers are directories of this node


def copy_dir(path: str) -> CheckpointDir:
    """The :class:`~unickpt.lifecycle.directory.CheckpointDir` of the memory copy ``path`` (this node's)."""
    return CheckpointDir(_LOCAL, path)


def _committed(path: str) -> bool:
    return copy_dir(path).is_committed()


@dataclass(frozen=True)
class MemoryLayout:
    """The memory directory of one run on this node (see the module docstring).

    Args:
        base: ``TierOptions.memory_dir``.
        root: the run's persistent root (names the run's subdirectory).
    """

    base: str
    root: str

    @property
    def run_dir(self) -> str:
        return os.path.join(self.base, run_key(self.root))

    def rank_root(self, kind: str, rank: int, world_size: int) -> str:
        """``own/rank_<r>_of_<W>`` or ``peer/rank_<r>_of_<W>``."""
        assert kind in KINDS, kind
        return os.path.join(self.run_dir, kind, f"rank_{int(rank)}_of_{int(world_size)}")

    def step_dir(self, kind: str, rank: int, world_size: int, step: int) -> str:
        return os.path.join(self.rank_root(kind, rank, world_size), f"step_{int(step)}")

    def ensure(self, node: str) -> None:
        """Create the run directory and its ``run.json`` (idempotent; any rank of the node)."""
        os.makedirs(os.path.join(self.run_dir, "own"), exist_ok=True)
        os.makedirs(os.path.join(self.run_dir, "peer"), exist_ok=True)
        info = os.path.join(self.run_dir, "run.json")
        if not os.path.exists(info):
            tmp = f"{info}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"root": self.root, "node": node}, f)
            os.replace(tmp, info)

    def steps(self, kind: str, rank: int, world_size: int) -> list[tuple[int, bool]]:
        """``[(step, committed)]`` of one rank's copies of one kind, by step."""
        return _steps(self.rank_root(kind, rank, world_size))

    def committed(self, kind: str, rank: int, world_size: int) -> list[int]:
        return [s for s, ok in self.steps(kind, rank, world_size) if ok]

    def inventory(self, world_size: int, with_files: bool = True) -> dict:
        """What this node holds for world size ``world_size``: ``{"own": {rank: {step: files}},
        "peer": {rank: {step: files}}}`` with ``files`` the copy's ``[[relative path, bytes], ...]``
        (``metadata.json`` last) or None without ``with_files``. Committed copies only."""
        out: dict = {}
        for kind in KINDS:
            kind_dir = os.path.join(self.run_dir, kind)
            found: dict = {}
            for name in _listdir(kind_dir):
                m = RANK_DIR.match(name)
                if not m or int(m.group(2)) != world_size:
                    continue
                rank = int(m.group(1))
                for step, ok in _steps(os.path.join(kind_dir, name)):
                    if ok:
                        path = os.path.join(kind_dir, name, f"step_{step}")
                        try:
                            files = copy_files(path) if with_files else None
                        except FileNotFoundError:  # removed meanwhile
                            continue
                        found.setdefault(rank, {})[step] = files
            out[kind] = found
        return out

    def bytes_held(self, rank: int, world_size: int, senders: Iterable[int] = ()) -> int:
        """Shared memory held for this rank: its own copies and the copies it holds for ``senders``."""
        total = dir_bytes(self.rank_root("own", rank, world_size))
        for s in senders:
            total += dir_bytes(self.rank_root("peer", s, world_size))
        return total

    def remove_other_layouts(self, world_size: int) -> list[str]:
        """Remove every copy of another world size (after a recovery into this one). Returns the paths."""
        gone = []
        for kind in KINDS:
            kind_dir = os.path.join(self.run_dir, kind)
            for name in _listdir(kind_dir):
                m = RANK_DIR.match(name)
                if m and int(m.group(2)) != world_size:
                    remove_tree(os.path.join(kind_dir, name))
                    gone.append(os.path.join(kind_dir, name))
        return gone

    def remove_newer(self, world_size: int, step: int) -> list[str]:
        """Remove every copy of world size ``world_size`` newer than ``step``, and the leftovers of
        transfers (they belong to a future the job no longer has, after it restored ``step``)."""
        gone = []
        for kind in KINDS:
            kind_dir = os.path.join(self.run_dir, kind)
            for name in _listdir(kind_dir):
                m = RANK_DIR.match(name)
                if not m or int(m.group(2)) != world_size:
                    continue
                rank_dir = os.path.join(kind_dir, name)
                for entry in _listdir(rank_dir):
                    sm = STEP_DIR.match(entry)
                    if (sm and int(sm.group(1)) > step) or entry.startswith((".incoming-", ".restore-")):
                        remove_tree(os.path.join(rank_dir, entry))
                        gone.append(os.path.join(rank_dir, entry))
        return gone


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _steps(rank_dir: str) -> list[tuple[int, bool]]:
    out = []
    for name in _listdir(rank_dir):
        m = STEP_DIR.match(name)
        if m:
            out.append((int(m.group(1)), _committed(os.path.join(rank_dir, name))))
    return sorted(out)


def copy_files(path: str) -> list[list]:
    """The files of a checkpoint directory as ``[[relative path, bytes], ...]``, ``metadata.json``
    last (so that a receiver that writes them in order has the commit last); the writer record is left out."""
    return [[rel, os.path.getsize(os.path.join(path, rel))] for rel in copy_dir(path).files()]


def remove_tree(path: str, recycle: Callable[[str], None] | None = None) -> None:
    """Uncommit (``metadata.json`` first), then ``recycle(path)`` (which may move data files away for
    reuse), then remove the tree; missing entries are fine."""
    try:
        copy_dir(path).uncommit()
    except NotADirectoryError:
        pass
    if recycle is not None:
        try:
            recycle(path)
        except OSError:  # pragma: no cover - the files go with the tree then
            pass
    shutil.rmtree(path, ignore_errors=True)


def recycle_into(spare_dir: str, max_spares: int) -> Callable[[str], None]:
    """A ``recycle`` for :func:`remove_tree`: move a removed copy's data files into ``spare_dir``
    (while it holds fewer than ``max_spares``), where in-place staging takes them
    (``SaveOptions.in_place``): the next copy reuses their memory pages instead of new ones."""

    def recycle(path: str) -> None:
        os.makedirs(spare_dir, exist_ok=True)
        have = len(os.listdir(spare_dir))
        for name in _listdir(os.path.join(path, "data")):
            if have >= max_spares:
                return
            os.rename(os.path.join(path, "data", name),
                      os.path.join(spare_dir, f"{os.getpid()}-{time.time_ns()}-{name}"))
            have += 1

    return recycle


def retain_steps(rank_dir: str, keep: int, protected: int | None | Iterable[int | None], busy: Callable[[str], bool],
                 recycle: Callable[[str], None] | None = None, settled: int | None = None,
                 unsettled_max: int = 0) -> list[int]:
    """Retention of one rank's copies of one kind. Keeps the committed steps that are

    * among the newest ``keep``;
    * newer than ``settled``, the newest ``unsettled_max`` of them (0: none): ``settled`` is the newest
      step every rank is known to have finished (None: none is), so that any newer step may still
      become the job's last common step when the slowest rank finishes it (a rank ahead keeps them);
    * the newest at or below each step of ``protected`` (an int, or several; None entries are ignored:
      the job's common steps, so that every rank keeps the same one);

    and removes the other committed steps and the unfinished ones (``step_<N>`` without
    ``metadata.json``: a crashed save's) unless ``busy(path)`` (a save in flight). An entry listed
    unfinished is looked at again once it is not busy: a save that committed since the listing (its
    commit thread, concurrently with this one) is kept; ``busy`` holds until the commit has landed,
    so that second look is certain. Transfers in progress live in dot-directories, which their own
    threads clean up. ``recycle``: see :func:`remove_tree` (committed copies only). Returns the steps
    removed."""
    entries = _steps(rank_dir)
    committed = [s for s, ok in entries if ok]
    keep_set = set(committed[-keep:]) if keep > 0 else set()
    if unsettled_max > 0:
        keep_set.update([s for s in committed if settled is None or s > settled][-unsettled_max:])
    for p in [protected] if protected is None or isinstance(protected, int) else protected:
        older = [s for s in committed if p is not None and s <= p]
        if older:
            keep_set.add(max(older))
    removed = []
    for step, ok in entries:
        path = os.path.join(rank_dir, f"step_{step}")
        if step in keep_set or busy(path) or (not ok and _committed(path)):
            continue
        remove_tree(path, recycle if ok else None)
        removed.append(step)
    return removed
