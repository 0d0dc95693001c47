"""Replicas that drift after the first save of a layout: the default check (``check_replicas="sample"``)
digests a rotating sample on every save, in the plan agreement's one collective, so a drift is
refused on every rank, naming the key and the ranks, within the documented rotation period, and the
last committed checkpoint stays intact."""
from __future__ import annotations

import pytest

import replica_workers as rw
from unickpt.saving.replicas import ROTATION, sample_range


def test_a_tensor_that_drifts_after_the_first_save_is_refused_at_the_next_save(pool, tmp_path):
    # a missed all-reduce on rank 1 changes every element of a 4 MiB replicated tensor after the first
    # save: the next save (a plan-cache hit) must not mix the ranks' copies
    out = pool(2).run(rw.drift_after_first_save, str(tmp_path), "all", "big_all", 3)
    for r in out:
        assert (r["caught_at"], r["error"], r["left"], r["first_intact"]) == (1, "ReplicaMismatchError", False, True), r
        assert "'bigall' (ranks [0] hold digest " in r["message"] and "; ranks [1] hold digest " in r["message"], r
        assert "midall" not in r["message"] and "tinyall" not in r["message"], r["message"]
    assert out[0]["message"] == out[1]["message"]


@pytest.mark.parametrize("where", ["big_one", "mid_last", "tiny"])
def test_a_one_element_drift_is_found_within_the_rotation_period(pool, tmp_path, where):
    # one element changed on rank 1 after the first save, where the first save's windows do not look
    # (the middle of a 4 MiB tensor), at the end of a 256 KiB tensor, or in a 24-byte tensor: every
    # byte of every replicated chunk is digested once in every ROTATION saves of a layout
    out = pool(2).run(rw.drift_after_first_save, str(tmp_path), where, where, ROTATION + 1)
    key = {"big_one": "big", "mid_last": "mid", "tiny": "tiny"}[where] + where
    # the save whose sample holds the changed byte: chunk index (sorted keys), size, byte offset
    index, nbytes, byte = {"big_one": (0, 4 << 20, 1_200_000), "mid_last": (1, 256 << 10, (256 << 10) - 1),
                           "tiny": (2, 24, 8)}[where]
    hit = next(c for c in range(ROTATION) if (p := sample_range(nbytes, index, c)) and p[0] <= byte < p[1])
    assert hit + 1 == {"big_one": 37, "mid_last": 7, "tiny": 127}[where]
    for r in out:
        assert r["caught_at"] == hit + 1 <= ROTATION, r
        assert r["error"] == "ReplicaMismatchError" and not r["left"] and r["first_intact"], r
        assert f"'{key}' (ranks [0] hold digest " in r["message"] and "; ranks [1] hold digest " in r["message"], r
        # the saves before it (a hit each) ran one plan collective: the digests travel in the signature exchange
        assert r["plan"] == [1] * (r["caught_at"] - 1), r
    assert out[0]["caught_at"] == out[1]["caught_at"] and out[0]["message"] == out[1]["message"]


def test_a_sample_that_does_not_fit_the_exchange_is_compared_by_its_own_collectives(pool, tmp_path):
    # a rank in more holder sets than the exchange has slots (here: no slots): the same rotating
    # sample is compared by two all_reduces per save, and the drift is found at the same save
    out = pool(2).run(rw.drift_after_first_save, str(tmp_path), "noslot", "mid_last", ROTATION + 1, 0)
    for r in out:
        assert (r["caught_at"], r["error"], r["left"], r["first_intact"]) == (7, "ReplicaMismatchError", False, True), r
        assert "'midnoslot' (ranks [0] hold digest " in r["message"] and "; ranks [1] hold digest " in r["message"], r
        assert r["plan"] == [3] * 6, r  # the signature exchange + 2 all_reduces of the sample


def test_a_drift_among_some_holders_is_refused_naming_them(pool, tmp_path):
    # holder sets (0, 1, 2) and (0, 1): rank 1's copy of a box that ranks 0 and 1 hold drifts; rank 2
    # holds no copy of it (its digest slot is another set's) and raises all the same
    out = pool(3).run(rw.drift_in_a_holder_subset, str(tmp_path), "sub")
    for r in out:
        assert (r["caught_at"], r["error"], r["plan"], r["first_intact"]) == (1, "ReplicaMismatchError", [], True), r
        assert "'pairsub' (ranks [0] hold digest " in r["message"] and "; ranks [1] hold digest " in r["message"], r
        assert "allsub" not in r["message"] and "[2]" not in r["message"], r["message"]
    assert len({r["message"] for r in out}) == 1


@pytest.mark.parametrize("nbytes", [0, 24, 32 << 10, (32 << 10) + 1, 256 << 10, (4 << 20) - 4, 4 << 20, (9 << 20) + 12])
@pytest.mark.parametrize("index", [0, 5, ROTATION + 3])
def test_the_rotating_sample_covers_every_byte_once_per_rotation(nbytes, index):
    # any ROTATION consecutive saves digest every byte of a chunk exactly once; a chunk of at least
    # 4 MiB has a piece digested on every save
    for start in (0, 7):
        pieces = [sample_range(nbytes, index, c) for c in range(start, start + ROTATION)]
        covered = sorted(p for p in pieces if p is not None)
        assert covered[0][0] == 0 and covered[-1][1] == nbytes
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), covered
        assert all(a < b or nbytes == 0 for a, b in covered)
        if nbytes >= 4 << 20:
            assert None not in pieces
