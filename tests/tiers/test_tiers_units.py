"""The checkpoint tiers' parts without a process group: placement, retention, the recovery table,
options, partial and in-place saves, preemption notices, and a one-process Checkpointer with
memory tiers (save schedule, bounded memory, fallback to storage, a save on a notice, `unickpt ls`)."""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import tempfile

import pytest
import torch

import unickpt
from unickpt.errors import IntegrityError
from unickpt.options import SaveOptions, TierOptions
from unickpt.tiers.node_dirs import MemoryLayout, recycle_into, retain_steps, run_key
from unickpt.tiers.placement import Placement
from unickpt.tiers.recovery import Source, candidates, plan_sources
from unickpt.tiers.signals import PreemptionNotice
from unickpt.tools.cli import main as cli


@pytest.fixture
def shm():
    d = tempfile.mkdtemp(prefix="unickpt-test-units-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- placement -------------------------------------------------------------------------------------
def test_placement_is_a_ring_over_nodes():
    p = Placement(["a", "a", "b", "b"])
    assert p.holder == {0: 2, 1: 3, 2: 0, 3: 1}
    assert p.senders(2) == [0] and p.leader(3) == 2 and p.node_count == 2
    uneven = Placement(["a", "a", "a", "b", "c", "c"])
    assert uneven.holder == {0: 3, 1: 3, 2: 3, 3: 4, 4: 0, 5: 1}
    assert all(uneven.nodes[r] != uneven.nodes[h] for r, h in uneven.holder.items())  # never on its own node
    assert Placement(["a", "a"]).holder == {0: None, 1: None}


# -- retention -------------------------------------------------------------------------------------
def _fake_copy(rank_dir: str, step: int, committed: bool = True, nbytes: int = 10) -> str:
    path = os.path.join(rank_dir, f"step_{step}")
    os.makedirs(os.path.join(path, "data"))
    with open(os.path.join(path, "data", "0_0.bin"), "wb") as f:
        f.write(bytes(nbytes))
    if committed:
        with open(os.path.join(path, "metadata.json"), "w") as f:
            f.write("{}")
    return path


def test_retention_keeps_the_newest_and_the_job_wide_common_step(tmp_path):
    d = str(tmp_path / "rank")
    for s in (3, 4, 5, 6):
        _fake_copy(d, s)
    _fake_copy(d, 7, committed=False)  # a save in flight
    _fake_copy(d, 2, committed=False)  # a crashed save's leftover
    removed = retain_steps(d, 1, 4, busy=lambda p: p.endswith("step_7"))
    assert sorted(removed) == [2, 3, 5]
    assert sorted(os.listdir(d)) == ["step_4", "step_6", "step_7"]
    assert retain_steps(d, 2, None, busy=lambda p: True) == []  # in flight: never removed


def test_retention_keeps_every_step_a_slower_rank_may_still_finish(tmp_path):
    """Issue #29: a rank ahead keeps its copies newer than the step every rank is known to have
    finished (the slowest rank may finish any of them before a crash: it becomes the last common one),
    that step, and the newest at or below the watermark (restorable after a node loss)."""
    d = str(tmp_path / "rank")
    for s in range(3, 10):
        _fake_copy(d, s)
    assert retain_steps(d, 1, (5, 3), busy=lambda p: False, settled=5, unsettled_max=8) == [4]
    assert sorted(os.listdir(d)) == ["step_3", "step_5", "step_6", "step_7", "step_8", "step_9"]
    assert retain_steps(d, 1, (5, 3), busy=lambda p: False, settled=5, unsettled_max=2) == [6, 7]  # the bound
    assert retain_steps(d, 1, (None, None), busy=lambda p: False, settled=None, unsettled_max=8) == []  # none known
    assert retain_steps(d, 1, (8, 8), busy=lambda p: False, settled=8, unsettled_max=8) == [3, 5]
    assert sorted(os.listdir(d)) == ["step_8", "step_9"]


def test_retention_keeps_a_copy_that_committed_after_the_listing(tmp_path):
    """The kill-loop failure of issue #29's test ('every rank finished step 541, but these ranks' memory
    lost it'): the caller's retention listed step 4 unfinished while its save was in flight; the
    commit thread committed it (and the save stopped being busy) before the removal loop reached it."""
    d = str(tmp_path / "rank")
    for s in (1, 2, 3):
        _fake_copy(d, s)
    in_flight = _fake_copy(d, 4, committed=False)

    def busy(path: str) -> bool:
        if path == in_flight and not os.path.exists(os.path.join(path, "metadata.json")):
            with open(os.path.join(path, "metadata.json"), "w") as f:  # the commit lands now
                f.write("{}")
        return False  # ... and the save is no longer in flight

    assert retain_steps(d, 1, 2, busy=busy) == [1]  # 3 is newest of those listed committed; 2 protected
    assert sorted(os.listdir(d)) == ["step_2", "step_3", "step_4"]
    assert os.path.exists(os.path.join(in_flight, "metadata.json"))
    crashed = _fake_copy(d, 5, committed=False)  # a crashed save's (never commits): removed
    assert retain_steps(d, 1, 2, busy=lambda p: False) == [3, 5] and not os.path.exists(crashed)


def test_retention_recycles_data_files_for_in_place_staging(tmp_path):
    d, spare = str(tmp_path / "rank"), str(tmp_path / "spare")
    for s in (1, 2, 3):
        _fake_copy(d, s)
    retain_steps(d, 1, None, busy=lambda p: False, recycle=recycle_into(spare, 1))
    assert len(os.listdir(spare)) == 1  # one spare file; the other removed copy's pages are freed
    assert os.listdir(d) == ["step_3"]


# -- the recovery table ------------------------------------------------------------------------------
def test_plan_sources_prefers_local_memory_then_peers_and_candidates_need_every_rank():
    p = Placement(["a", "a", "b", "b"])
    files = [["data/0_0.bin", 8], ["metadata.json", 2]]
    inv = {"a": {"own": {"0": {"5": files, "4": files}, "1": {"5": files}}, "peer": {"2": {"5": files}, "3": {"4": files}}},
           "b": {"own": {"2": {"5": files}}, "peer": {"0": {"5": files}, "1": {"5": files}}}}
    table = plan_sources(inv, p)
    assert [s.tier for s in table[5][2]] == ["memory", "peer"]  # its own node first, then node a
    assert table[5][2][1] == Source("peer", "a", "peer", 0, (("data/0_0.bin", 8), ("metadata.json", 2)))
    assert candidates(table, 4, persisted=None) == []  # rank 3 has no copy of step 5
    inv["b"]["own"]["3"] = {"5": files}
    table = plan_sources(inv, p)
    assert candidates(table, 4, persisted=None) == [5]
    assert candidates(table, 4, persisted=6) == []  # storage is newer
    assert candidates(table, 4, persisted=5) == [5]  # at the same step memory is faster
    assert candidates(table, 4, persisted=9, only=5) == [5]


# -- options ----------------------------------------------------------------------------------------
def test_tier_options_validate():
    opts = TierOptions(memory_every=1, node_id="n0", memory_dir="/tmp/x").validated()
    assert opts.enabled and opts.signals == ("SIGTERM", "SIGUSR1")
    for bad in ({"memory_every": 0}, {"persist_every": -1}, {"memory_keep": 3}, {"signals": ("SIGKILL",)},
                {"memory_limit_bytes": 0}, {"peer_every": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TierOptions(**bad).validated()
    with pytest.raises(ValueError, match="memory_dir must name a directory"):
        TierOptions(memory_dir="").validated()  # was silently /dev/shm/unickpt
    import pathlib

    # a Path is accepted and every memory_dir is made absolute (a relative one named the cwd at each use)
    assert TierOptions(memory_dir=pathlib.Path("/tmp/x")).validated().memory_dir == "/tmp/x"
    assert TierOptions(memory_dir="rel").validated().memory_dir == os.path.join(os.getcwd(), "rel")
    with pytest.raises(ValueError, match="unknown tier option"):
        TierOptions().with_(memory_evry=1)
    with tempfile.NamedTemporaryFile() as f:  # was a bare NotADirectoryError at the first memory save
        with pytest.raises(ValueError, match=f"memory_dir {f.name!r} exists and is not a directory"):
            TierOptions(memory_dir=f.name).validated()
    assert not TierOptions().enabled


# -- partial and in-place saves -----------------------------------------------------------------------
def test_partial_save_holds_one_rank_s_shards_and_loads_only_into_them(tmp_path):
    full = torch.arange(40.0).reshape(8, 5)
    part = {"w": unickpt.Shard(full[4:].clone(), (8, 5), offsets=(4, 0))}
    path = str(tmp_path / "p")
    with pytest.raises(ValueError, match="cover 20 of 40"):
        unickpt.save(str(tmp_path / "full"), part)
    unickpt.save(path, part, options=SaveOptions(partial=True))
    assert json.load(open(os.path.join(path, "metadata.json")))["layout"] == {"world_size": 1, "partial": True}
    back = {"w": unickpt.Shard(torch.zeros(4, 5), (8, 5), offsets=(4, 0))}
    unickpt.load(path, back)
    assert torch.equal(back["w"].tensor, full[4:])
    with pytest.raises(IntegrityError, match="cover"):
        unickpt.load(path, {"w": torch.zeros(8, 5)})  # the other rows are not in it: never a silent gap


def test_in_place_save_stages_into_the_data_file_and_reuses_a_spare(shm):
    spare = os.path.join(shm, "spare")
    os.makedirs(spare)
    with open(os.path.join(spare, "old"), "wb") as f:
        f.write(os.urandom(1 << 20))
    inode = os.stat(os.path.join(spare, "old")).st_ino
    state = {"a": torch.randn(300_000), "b": torch.arange(1000, dtype=torch.int64), "step": 3}
    path = os.path.join(shm, "ckpt")
    h = unickpt.save(path, state, options=SaveOptions(in_place=spare, direct_io=False))
    assert os.listdir(spare) == []  # taken
    (data,) = glob.glob(os.path.join(path, "data", "*.bin"))
    assert os.stat(data).st_ino == inode and os.path.getsize(data) == h.stats.bytes_written
    back = {"a": torch.zeros(300_000), "b": torch.zeros(1000, dtype=torch.int64), "step": 0}
    unickpt.load(path, back)
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"]) and back["step"] == 3


# -- preemption notices --------------------------------------------------------------------------------
def test_preemption_notice_sets_the_flag_and_chains_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        notice = PreemptionNotice(("SIGUSR1",))
        assert not notice.flag
        os.kill(os.getpid(), signal.SIGUSR1)
        assert notice.flag and notice.received == "SIGUSR1" and seen == [signal.SIGUSR1]
        notice.close()
        assert signal.getsignal(signal.SIGUSR1) is not notice._handle
    finally:
        signal.signal(signal.SIGUSR1, previous)


# -- a one-process Checkpointer with tiers ---------------------------------------------------------------
def _state(step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "rows": torch.arange(64.0) * step, "step": step}


def _ckpt(tmp_path, shm, **kw) -> unickpt.Checkpointer:
    tiers = TierOptions(memory_dir=shm, signals=(), **{k: kw.pop(k) for k in list(kw) if k in
                                                       ("memory_keep", "memory_limit_bytes", "peer_every")})
    return unickpt.Checkpointer(str(tmp_path / "root"), tiers=tiers, **kw)


def test_memory_saves_every_step_persist_on_schedule_and_stay_bounded(tmp_path, shm):
    ck = _ckpt(tmp_path, shm, memory_every=1, persist_every=4, async_save=False)
    for step in range(1, 10):
        ck.save(step, _state(step))
    ck.wait()
    assert [s for s, ok in unickpt.list_checkpoints(str(tmp_path / "root")) if ok] == [4, 8]
    layout = MemoryLayout(shm, str(tmp_path / "root"))
    assert layout.committed("own", 0, 1)[-1] == 9 and len(layout.committed("own", 0, 1)) <= 2
    used = ck.tiers.memory_bytes()
    copy = sum(os.path.getsize(f) for f in glob.glob(os.path.join(layout.step_dir("own", 0, 1, 9), "**"),
                                                          recursive=True) if os.path.isfile(f))
    assert used["own"] <= 3 * copy and used["staging"] == 0  # two copies and one spare, no ring
    back = _state(0)
    assert ck.load(back) == 9
    assert torch.equal(back["w"], _state(9)["w"]) and back["step"] == 9
    assert ck.last_load_stats.tier == "memory" and set(ck.last_load_stats.bytes_by_tier) == {"memory"}
    older = layout.committed("own", 0, 1)[0]  # the job-wide common step of the last agreement (7 or 8)
    assert ck.load(back, step=older) == older
    assert ck.last_load_stats.tier == "memory" and back["step"] == older
    assert ck.load(back, step=4) == 4  # an older step: only storage has it
    assert ck.last_load_stats.tier == "storage" and back["step"] == 4
    assert layout.committed("own", 0, 1) == []  # the copies of steps after it belong to another future
    ck.close()


def test_a_run_that_did_not_restore_a_step_never_takes_an_earlier_run_s_copy_for_its_save(tmp_path, shm):
    old = _ckpt(tmp_path, shm, memory_every=1, async_save=False)
    for step in (1, 2):
        old.save(step, _state(step + 100))  # an earlier run's future (killed before any persistent save)
    old.close()
    ck = _ckpt(tmp_path, shm, memory_every=1, async_save=False)  # a fresh start: no load
    ck.save(1, _state(1))
    ck.save(2, _state(2))
    ck.wait()
    back = _state(0)
    assert ck.load(back) == 2 and ck.last_load_stats.tier == "memory"
    assert torch.equal(back["w"], _state(2)["w"]) and back["step"] == 2  # this run's step 2, not the old one
    ck.close()


def test_a_corrupt_memory_copy_falls_back_to_storage(tmp_path, shm, caplog):
    ck = _ckpt(tmp_path, shm, memory_every=1, persist_every=2, async_save=False)
    for step in (1, 2):
        ck.save(step, _state(step))
    ck.wait()
    (data,) = glob.glob(os.path.join(MemoryLayout(shm, str(tmp_path / "root")).step_dir("own", 0, 1, 2), "data", "*"))
    with open(data, "r+b") as f:
        f.seek(7)
        b = f.read(1)
        f.seek(7)
        f.write(bytes([b[0] ^ 1]))
    back = _state(0)
    with caplog.at_level(logging.WARNING, logger="unickpt"):
        assert ck.load(back) == 2
    assert ck.last_load_stats.tier == "storage" and torch.equal(back["w"], _state(2)["w"])
    assert "unusable" in caplog.text and "checksum" in caplog.text
    ck.close()


def test_memory_limit_skips_saves_with_a_warning(tmp_path, shm, caplog):
    ck = _ckpt(tmp_path, shm, memory_every=1, memory_limit_bytes=3000)
    with caplog.at_level(logging.WARNING, logger="unickpt"):
        ck.save(1, _state(1))
    ck.wait()
    assert ck.tiers.skipped == 1 and "memory_limit_bytes" in caplog.text
    assert ck.tiers.memory_bytes()["own"] == 0
    ck.close()


def test_a_preemption_notice_saves_the_step_persistently(tmp_path, shm):
    ck = _ckpt(tmp_path, shm, memory_every=1)
    ck.save(1, _state(1))
    assert not ck.preempted
    ck.tiers.notice.notify("SIGTERM")
    ck.save(2, _state(2))
    assert ck.preempted and ck.preempted_step == 2
    assert unickpt.list_checkpoints(str(tmp_path / "root")) == [(2, True)]
    ck.close()


def test_ls_shows_which_tiers_hold_which_steps(tmp_path, shm, capsys):
    ck = _ckpt(tmp_path, shm, memory_every=1, persist_every=2, async_save=False)
    for step in (1, 2, 3):
        ck.save(step, _state(step))
        ck.wait()  # memory saves are asynchronous: step 3's agreement must see step 2's copy committed,
        # so that the watermark (2) keeps it beside the newest (memory_keep=1), and step 1's goes
    ck.close()
    root = str(tmp_path / "root")
    assert cli(["ls", root, "--memory-dir", shm, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[2]["tiers"] == ["storage", "memory"] and rows[2]["memory"] == {"1": [0]}
    assert rows[3]["committed"] is None and rows[3]["tiers"] == ["memory"]
    assert cli(["ls", root, "--memory-dir", shm]) == 0
    out = capsys.readouterr().out
    assert "memory only" in out and "memory (ranks 0)" in out and run_key(root) in out


def test_a_state_that_does_not_fit_is_refused_and_the_memory_copies_stay(tmp_path, shm):
    # break test: a shape mismatch during memory recovery was logged and skipped (load returned None or
    # the older persisted step), and the newer memory copies were deleted before the fallback load
    ck = _ckpt(tmp_path, shm, memory_every=1, persist_every=3, async_save=False)
    for step in range(1, 6):
        ck.save(step, _state(step))
        ck.wait()
    ck.close()
    assert unickpt.list_checkpoints(str(tmp_path / "root")) == [(3, True)]
    again = _ckpt(tmp_path, shm, memory_every=1, persist_every=3, async_save=False)
    wrong = {"w": torch.zeros(999), "rows": torch.zeros(64), "step": -1}
    with pytest.raises(unickpt.StateMismatchError, match=r"restoring step 5 from memory: .*'w'.*999"):
        again.load(wrong)
    state = {"w": torch.zeros(1000), "rows": torch.zeros(64), "step": -1}
    assert again.load(state) == 5  # the newest memory copy survived the refused load
    assert torch.equal(state["w"], _state(5)["w"]) and state["step"] == 5
    assert again.last_load_stats.tier == "memory" and again.last_load_stats.bytes_by_tier == {"memory": 4256}
    again.close()


def test_ls_before_the_first_persistent_save_lists_the_memory_copies(tmp_path, shm, capsys):
    # a tiered run persists every 50 steps: before that its root does not exist, and `unickpt ls` failed
    ck = _ckpt(tmp_path, shm, memory_every=1, persist_every=50, async_save=False)
    ck.save(1, _state(1))
    ck.wait()
    ck.close()
    root = str(tmp_path / "root")
    assert not os.path.exists(root)
    assert cli(["ls", root, "--memory-dir", shm, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["committed"], r["tiers"], r["memory"]) for r in rows] == [(1, None, ["memory"], {"1": [0]})]
    assert cli(["ls", str(tmp_path / "nothing"), "--memory-dir", shm]) == 2
    assert "is not a directory, and this node's memory tiers hold no copies of it" in capsys.readouterr().err
