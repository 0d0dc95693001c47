"""Where unickpt puts its checkpoint inside the folders Accelerate asks for, and ``total_limit`` rotation.

Layout (Accelerate's own naming is kept, so users and tools that know ``checkpoint_<N>`` still work)::

    <output_dir>/                      the folder given to (or chosen by) ``save_state``
      unickpt/                         a unickpt checkpoint root (``unickpt ls`` lists it)
        step_<K>/metadata.json ...     one save into this folder (K = 0, 1, ... for repeated saves)
        step_<K>/model*.safetensors    the first model's weights as Hugging Face safetensors files
        latest                         "step_<K>", the newest committed save in this folder
      model.safetensors                hard links to step_<K>'s, made when it commits (several writers:
                                       model-0000k-of-0000n.safetensors + model.safetensors.index.json)
      <files the user's save hooks wrote>

With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the folders are
``<project_dir>/checkpoints/checkpoint_<N>``. Accelerate deletes the oldest folders beyond
``total_limit`` *before* a save (so a failing save can leave no checkpoint at all); here rotation runs
on group rank 0 when ``save_state`` returns (the previous checkpoint has committed by then and is kept;
with ``total_limit=1`` that save waits for its own commit first) and again after each commit, and
never deletes the folder being saved nor one that a save still in flight (this process or a live
writer) is writing into.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time

from unickpt import ext

__all__ = ["STORE_DIR", "store_root", "is_unickpt_folder", "folder_kind", "committed", "checkpoint_folders",
           "newest_number", "newest_loadable", "rotate", "remove_failed", "next_step", "wait_for_writer", "link_weights"]

log = logging.getLogger("unickpt.accelerate")

STORE_DIR = "unickpt"
_FOLDER = re.compile(r"^checkpoint_(\d+)$")


def store_root(output_dir: str) -> str:
    """The unickpt checkpoint root inside Accelerate's folder ``output_dir``."""
    return os.path.join(os.fspath(output_dir), STORE_DIR)


def is_unickpt_folder(output_dir: str) -> bool:
    """True when ``output_dir`` holds a unickpt root (committed or not)."""
    return os.path.isdir(store_root(output_dir))


_NATIVE_PREFIXES = ("random_states", "model", "pytorch_model", "optimizer", "scheduler", "sampler", "scaler",
                    "custom_checkpoint", "dl_state_dict")


def folder_kind(output_dir: str) -> str:
    """``"unickpt"`` (a unickpt root inside, committed or not), ``"accelerate"`` (files Accelerate's own
    ``save_state`` writes: it always writes ``random_states_<r>.pkl``) or ``"none"``."""
    if is_unickpt_folder(output_dir):
        return "unickpt"
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return "accelerate" if any(n.startswith(_NATIVE_PREFIXES) for n in names) else "none"


def _root(output_dir: str) -> ext.CheckpointRoot | None:
    """The unickpt root inside ``output_dir`` (None when there is none)."""
    root = store_root(output_dir)
    return ext.CheckpointRoot(root) if os.path.isdir(root) else None


def committed(output_dir: str) -> bool:
    """True when ``output_dir``'s unickpt root holds at least one committed save."""
    root = _root(output_dir)
    return root is not None and bool(root.committed_steps())


def next_step(output_dir: str) -> int:
    """The step number for the next save into ``output_dir``: one past every existing ``step_<K>``."""
    root = _root(output_dir)
    steps = [s for s, _ in root.list()] if root is not None else []
    return max(steps) + 1 if steps else 0


def checkpoint_folders(checkpoints_dir: str) -> list[tuple[int, str]]:
    """``[(N, path), ...]`` of the ``checkpoint_<N>`` folders in ``checkpoints_dir``, by N."""
    if not os.path.isdir(checkpoints_dir):
        return []
    out = []
    for name in os.listdir(checkpoints_dir):
        m = _FOLDER.match(name)
        path = os.path.join(checkpoints_dir, name)
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path))
    return sorted(out)


def newest_number(checkpoints_dir: str) -> int | None:
    """The largest ``N`` of the ``checkpoint_<N>`` folders in ``checkpoints_dir`` (loadable or not), or None."""
    folders = checkpoint_folders(checkpoints_dir)
    return folders[-1][0] if folders else None


def _writer_on_this_host(output_dir: str) -> bool:
    """True when another live process of this host is saving into ``output_dir``'s unickpt root (per
    the writer record of an uncommitted ``step_<K>``)."""
    root = _root(output_dir)
    if root is None:
        return False
    return any(not ok and root.dir(step).writer_elsewhere_on_host() for step, ok in root.list())


def wait_for_writer(output_dir: str, timeout_s: float = 1800.0) -> bool:
    """Wait while another process on this host is still saving into ``output_dir`` and nothing there
    has committed yet (with Accelerate a checkpoint is on disk when the saving process's ``save_state``
    returns; here that process may still be writing it). Returns whether ``output_dir`` now holds a
    committed save. A writer on another host is not waited for (its liveness cannot be checked)."""
    deadline = time.monotonic() + timeout_s
    while not committed(output_dir) and _writer_on_this_host(output_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    return committed(output_dir)


def newest_loadable(checkpoints_dir: str) -> str | None:
    """The newest ``checkpoint_<N>`` folder that can be loaded: its unickpt root has a committed
    save, or it holds a checkpoint Accelerate wrote itself. A save that another process of this host
    is still writing is waited for (:func:`wait_for_writer`). Folders whose unickpt save never
    committed (a crash, or a save still running on another host) and folders holding neither (a save
    killed before it started writing) are skipped with a warning."""
    for _, path in reversed(checkpoint_folders(checkpoints_dir)):
        kind = folder_kind(path)
        if kind == "accelerate" or (kind == "unickpt" and wait_for_writer(path)):
            return path
        log.warning("unickpt.accelerate: skipping %s: %s", path,
                    "its unickpt checkpoint is not committed" if kind == "unickpt" else "it holds no checkpoint")
    return None


def remove_failed(output_dir: str) -> bool:
    """Remove the folder of a save that failed before anything committed in it, if it holds nothing
    but that save's unickpt root (nothing of the user's). Returns whether it was removed."""
    if not os.path.isdir(output_dir) or committed(output_dir):
        return False
    if any(name != STORE_DIR for name in os.listdir(output_dir)):
        return False
    shutil.rmtree(output_dir)
    log.info("unickpt.accelerate: removed %s, the folder of a failed save", output_dir)
    return True


def link_weights(root: str, step: int, output_dir: str) -> list[str]:
    """Group rank 0's commit thread, after save ``step`` of the unickpt root ``root`` committed: hard-link
    its ``model.safetensors`` files (``model-0000k-of-0000n.safetensors`` + index with several writers)
    into the Accelerate folder ``output_dir``, where Accelerate's own ``save_state`` puts
    ``model.safetensors`` (``ext.CheckpointDir.link_safetensors``). A failure is logged, not raised: the
    checkpoint itself is committed and loads; the folder's names of an earlier save are then removed, so
    that they never show other weights than the committed save's. Returns the linked names."""
    try:
        return ext.CheckpointRoot(root).dir(step).link_safetensors(output_dir)
    except (OSError, ValueError) as e:
        log.warning("unickpt.accelerate: could not link the model.safetensors files of %s into %s (%s); the "
                    "folder holds no model.safetensors now (the checkpoint itself is committed: load_state "
                    "reads it)", root, output_dir, e)
        try:
            ext.CheckpointDir.remove_safetensors(output_dir)
        except OSError:
            log.exception("unickpt.accelerate: could not remove the model.safetensors files of %s", output_dir)
        return []


def _busy(path: str, in_flight) -> bool:
    """True when a unickpt save may still be writing inside the Accelerate folder ``path``."""
    root = _root(path)
    if root is None:
        return False
    return root.writing(in_flight)


def rotate(checkpoints_dir: str, total_limit: int, keep: str, in_flight) -> list[str]:
    """Delete the oldest ``checkpoint_<N>`` folders so that at most ``total_limit`` remain.

    Args:
        checkpoints_dir: ``<project_dir>/checkpoints``.
        total_limit: how many folders to keep (``ProjectConfiguration.total_limit``, >= 1).
        keep: the folder whose save just committed; never deleted.
        in_flight: ``in_flight(path) -> bool``, whether this process still saves into ``path``.

    Folders of saves that died before committing are deleted first, then the oldest. A folder a save
    is still writing into is kept (and counts towards the limit). unickpt saves are uncommitted first
    (``metadata.json`` removed), so a half-deleted folder is never loadable. Returns the deleted
    paths, by ``N``.
    """
    with _rotation_lock:  # one rotation at a time (at save_state's return, and after the commit)
        return _rotate(checkpoints_dir, total_limit, keep, in_flight)


_rotation_lock = threading.Lock()


def _rotate(checkpoints_dir: str, total_limit: int, keep: str, in_flight) -> list[str]:
    folders = checkpoint_folders(checkpoints_dir)
    keep = os.path.abspath(keep)
    excess = len(folders) - total_limit
    # leftovers of saves that died (a unickpt root with nothing committed, no writer left) go first,
    # so that the limit keeps as many loadable checkpoints as it can; then the oldest
    dead = [(n, p) for n, p in folders if is_unickpt_folder(p) and not committed(p)]
    order = dead + [(n, p) for n, p in folders if (n, p) not in dead]
    deleted: list[tuple[int, str]] = []
    for n, path in order:
        if excess <= 0:
            break
        if os.path.abspath(path) == keep or _busy(path, in_flight):
            continue
        root = _root(path)
        try:
            if root is not None:  # every save in it is uncommitted first, so a half-deleted folder never loads
                for step, _ in root.list():
                    root.dir(step).remove()
            shutil.rmtree(path)
        except FileNotFoundError:  # removed meanwhile by someone else: gone all the same
            if os.path.exists(path):
                raise
        deleted.append((n, path))
        excess -= 1
    paths = [p for _, p in sorted(deleted)]
    if paths:
        log.info("unickpt.accelerate: total_limit=%d: deleted %s", total_limit, paths)
    return paths
