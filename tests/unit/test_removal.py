"""``shutil.rmtree`` of a folder an async save still writes into waits for that save (unickpt.removal)."""
from __future__ import annotations

import os
import shutil
import threading

import torch

import unickpt
from unickpt import removal


def _big_state() -> dict:
    return {"model": {f"w{i}": torch.randn(1024, 1024) for i in range(48)}}  # 192 MiB: the save outlives the call


def test_rmtree_of_a_watched_save_s_folder_or_its_parent_waits_for_the_commit(tmp_path):
    removal.install()
    assert removal.installed() and hasattr(shutil.rmtree, "avoids_symlink_attacks")  # functools.wraps kept it
    target = tmp_path / "run" / "checkpoint-9"
    handle = unickpt.save(target, _big_state(), async_save=True)
    removal.watch(handle)
    try:
        assert removal.pending() and removal.pending(tmp_path / "run") and removal.pending(target / "data")
        assert not removal.pending(tmp_path / "other")
        shutil.rmtree(tmp_path / "run")  # the parent: waits, then removes a complete, committed checkpoint
        assert handle.done() and handle.outcome() is None
        assert not (tmp_path / "run").exists()
        assert not removal.pending()
    finally:
        handle.wait()


def test_rmtree_of_other_paths_and_unwatched_saves_does_not_wait(tmp_path):
    removal.install()
    target = tmp_path / "watched"
    handle = unickpt.save(target, _big_state(), async_save=True)
    removal.watch(handle)
    try:
        other = tmp_path / "other"
        other.mkdir()
        shutil.rmtree(other)
        assert not handle.done()  # 192 MiB are not written and committed in the time of one rmtree
        assert removal.busy_under(target, but=target) == []  # `but` leaves out the save into that folder
        assert removal.busy_under(target) == [handle]
    finally:
        handle.wait()
    assert removal.busy_under(target) == []


def test_removal_on_a_unickpt_thread_never_waits(tmp_path):
    """A failed save's commit thread removes what it wrote through shutil.rmtree: waiting there would
    wait for the save itself."""
    removal.install()
    target = tmp_path / "ckpt"
    handle = unickpt.save(target, _big_state(), async_save=True)
    removal.watch(handle)
    done_before_removal: list[bool] = []
    (target / "sub").mkdir(parents=True, exist_ok=True)

    def remove() -> None:
        done_before_removal.append(handle.done())
        shutil.rmtree(target / "sub")  # inside the save's folder: a plain thread would wait

    t = threading.Thread(target=remove, name="unickpt-test-remover")
    t.start()
    t.join(timeout=60)
    try:
        assert done_before_removal == [False] and not (target / "sub").exists()
        assert not handle.done(), "the removal on a unickpt- thread waited for the save"
    finally:
        handle.wait()


def test_a_folder_named_through_a_symbolic_link_is_the_same_folder(tmp_path):
    removal.install()
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    handle = unickpt.save(tmp_path / "link" / "ckpt", _big_state(), async_save=True)
    removal.watch(handle)
    try:
        assert removal.busy_under(tmp_path / "real" / "ckpt") == [handle]
        shutil.rmtree(tmp_path / "real" / "ckpt")  # the other spelling: waits all the same
        assert handle.done() and handle.outcome() is None and not (tmp_path / "real" / "ckpt").exists()
    finally:
        handle.wait()
