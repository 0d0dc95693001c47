"""A failed asynchronous save on two gloo ranks where only one rank's write fails: every rank raises
(or warns) at the same call, naming the step, once; the following saves commit. One process:
tests/unit/test_save_errors.py."""
from __future__ import annotations

import os

import pytest

import save_error_workers as w


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_one_rank_failing_raises_on_every_rank_at_the_next_save(pool, tmp_path, fail_rank):
    root = str(tmp_path / "run")
    results = pool(2).run(w.one_rank_fails, root, fail_rank)
    head = f"1 earlier asynchronous save(s) failed: step 1 ({os.path.join(root, 'step_1')!r})"
    for r in results:
        assert r["second"] == ["EarlierSaveFailedError", [1], "SaveFailedError", head, True], r
        assert r["last"] == ["ok"] and r["warnings"] == [] and r["failed_saves"] == 1
        assert r["loaded"] == 3 and r["step"] == 3 and r["bitwise"]
        assert [s for s, ok in r["listing"] if ok] == [2, 3]


def test_on_error_warn_warns_on_every_rank(pool, tmp_path):
    root = str(tmp_path / "run")
    results = pool(2).run(w.one_rank_fails, root, 1, "warn")
    for r in results:
        assert r["second"] == ["ok"] and r["last"] == ["ok"] and r["failed_saves"] == 1
        assert r["warnings"] == [f"unickpt: the asynchronous save of step 1 ({os.path.join(root, 'step_1')!r}) failed"]
        assert r["loaded"] == 3 and r["bitwise"] and [s for s, ok in r["listing"] if ok] == [2, 3]


@pytest.mark.parametrize("lag_rank", [0, 1])
def test_a_lagging_rank_raises_at_the_same_call(pool, tmp_path, lag_rank):
    root = str(tmp_path / "run")
    a, b = pool(2).run(w.lagging_rank, root, lag_rank)
    assert a["calls"] == b["calls"], (a, b)
    raised = [c for c in a["calls"] if c[0] != "ok"]
    assert len(raised) == 1 and raised[0][:3] == ["EarlierSaveFailedError", [1], "SaveFailedError"] and raised[0][4]
    assert a["committed"] == b["committed"] == ([2] if a["calls"][0] == ["ok"] else [])


def test_a_wait_on_one_rank_does_not_split_the_next_save(pool, tmp_path):
    assert pool(2).run(w.wait_on_one_rank, str(tmp_path / "run")) == [[1, 2, 3], [1, 2, 3]]


def test_a_failure_raised_by_one_rank_s_handle_is_raised_again_on_every_rank(pool, tmp_path):
    root = str(tmp_path / "run")
    a, b = pool(2).run(w.handle_wait_on_rank_0_only, root)
    assert a["first"][0] == "SaveFailedError" and b["first"] == ["not waited"]
    assert a["calls"] == b["calls"], (a, b)
    assert a["calls"][0][:3] == ["EarlierSaveFailedError", [1], "SaveFailedError"] and a["calls"][0][4]
    assert a["calls"][1:] == [["ok"], ["ok"], ["ok"]]
    assert a["committed"] == b["committed"] == [3, 4]


def test_a_failure_raised_by_every_rank_s_handle_is_not_raised_again(pool, tmp_path):
    a, b = pool(2).run(w.handle_wait_on_every_rank, str(tmp_path / "run"))
    assert a["first"][0] == b["first"][0] == "SaveFailedError"
    assert a["calls"] == b["calls"] == [["ok"], ["ok"], ["ok"]]
    assert a["committed"] == b["committed"] == [2, 3]
