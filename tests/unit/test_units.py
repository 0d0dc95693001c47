"""Pure functions: chunk geometry, tagged-JSON codec, global save planning."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from unickpt.state import codec
from unickpt.errors import StateMismatchError, UnsafeObjectError
from unickpt.plan.save_plan import LocalPlan, make_global_plan
from unickpt.geometry import Box, FlatRange, byte_runs, check_exact_cover, chunk_pieces, intersect


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 1, 3, 2)])
def test_flat_range_pieces_cover_exactly_that_range(shape):
    total = math.prod(shape)
    idx = torch.arange(total).reshape(shape)
    for start, end in itertools.combinations(range(total + 1), 2):
        pieces = chunk_pieces(FlatRange(start, end - start), shape)
        assert len(pieces) <= 2 * len(shape) - 1
        got = []
        for p in pieces:
            view = idx
            for d, (o, l) in enumerate(zip(p.box.offsets, p.box.lengths)):
                view = view.narrow(d, o, l)
            assert p.elem_offset == len(got)
            got += view.reshape(-1).tolist()
        assert got == list(range(start, end))


def test_intersect_and_byte_runs():
    a, b = Box((0, 0), (4, 6)), Box((1, 2), (5, 2))
    inter = intersect(a, b)
    assert inter == Box((1, 2), (3, 2))
    assert intersect(Box((0,), (2,)), Box((2,), (3,))) is None
    # rows 1..3, cols 2..3 of a 4x6 float32 box: three 8-byte runs, 24 bytes apart
    assert byte_runs(a, inter, 4) == [(32, 8), (56, 8), (80, 8)]
    # full trailing dims merge into one run
    assert byte_runs(a, Box((1, 0), (2, 6)), 2) == [(12, 24)]
    assert byte_runs(Box((), ()), Box((), ()), 8) == [(0, 8)]


def test_exact_cover_rejects_gaps_and_overlaps():
    check_exact_cover("w", (4, 4), [Box((0, 0), (2, 4)), FlatRange(8, 8)])
    with pytest.raises(ValueError, match="cover 12 of 16"):
        check_exact_cover("w", (4, 4), [Box((0, 0), (2, 4)), FlatRange(8, 4)])
    with pytest.raises(ValueError, match="overlap"):
        check_exact_cover("w", (4, 4), [Box((0, 0), (3, 4)), FlatRange(8, 8)])
    with pytest.raises(ValueError, match="outside"):
        check_exact_cover("w", (4, 4), [Box((3, 0), (2, 4))])


def test_codec_round_trip_keeps_types():
    value = {
        "ints": {1: "a", (2, 3): [4.5, float("inf")]},
        "tuple": (1, (2, None), [True]),
        "bytes": b"\x00\xff",
        "set": {1, 2},
        "frozen": frozenset({"x"}),
        "complex": 1 + 2j,
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "tensor": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        "empty": torch.empty(0, 3),
        "array": np.arange(5, dtype=np.uint32),
        "np_scalar": np.float64(2.5),
        "odict": __import__("collections").OrderedDict([("b", 1), ("a", 2)]),
        "__tuple__": "a key that looks like a tag",
    }
    import json

    back = codec.decode(json.loads(json.dumps(codec.encode(value))))
    assert back.keys() == value.keys()
    for k in value:
        v, b = value[k], back[k]
        if isinstance(v, torch.Tensor):
            assert b.dtype == v.dtype and torch.equal(b, v)
        elif isinstance(v, np.ndarray):
            assert b.dtype == v.dtype and (b == v).all()
        else:
            assert b == v and type(b) is type(v), k


class _Custom:
    def __init__(self, x):
        self.x = x


def test_codec_pickle_only_with_opt_in():
    enc = codec.encode({"obj": _Custom(3)})
    with pytest.raises(UnsafeObjectError, match=r"'cfg.obj'.*_Custom.*allow_pickle=True"):
        codec.decode(enc, key="cfg")
    assert codec.decode(enc, allow_pickle=True)["obj"].x == 3


def _plan(rank, tensors, aliases=None):
    return LocalPlan(rank=rank, tensors=tensors, aliases=aliases or {})


def test_global_plan_dedups_replicas_and_balances():
    full = Box((0, 0), (8, 8))
    plans = [_plan(r, {f"w{i}": ("float32", (8, 8), full) for i in range(4)}) for r in range(4)]
    plan = make_global_plan(plans)
    assert len(plan.chunks) == 4  # each replicated tensor written once
    assert plan.bytes_per_rank(4) == [256, 256, 256, 256]  # one tensor per rank


def test_global_plan_rejects_disagreeing_ranks():
    plans = [_plan(0, {"w": ("float32", (4,), Box((0,), (4,)))}), _plan(1, {"w": ("bfloat16", (4,), Box((0,), (4,)))})]
    with pytest.raises(StateMismatchError, match=r"'w': rank 0 has dtype float32 shape \[4\], rank 1 has dtype bfloat16"):
        make_global_plan(plans)
    gap = [_plan(0, {"w": ("float32", (4,), Box((0,), (2,)))}), _plan(1, {"w": ("float32", (4,), None)})]
    with pytest.raises(ValueError, match="cover 2 of 4"):
        make_global_plan(gap)


def test_large_replicated_tensor_is_split_across_holders():
    big = Box((0, 0), (1024, 512))  # 2 MiB of float32, held by all 4 ranks
    plan = make_global_plan([_plan(r, {"big": ("float32", (1024, 512), big)}) for r in range(4)])
    assert sorted(c.writer for c in plan.chunks) == [0, 1, 2, 3]
    assert sorted(c.spec.offsets[0] for c in plan.chunks) == [0, 256, 512, 768]
    assert plan.bytes_per_rank(4) == [512 * 1024] * 4
    check_exact_cover("big", (1024, 512), [c.spec for c in plan.chunks])


def test_replicas_go_to_ranks_with_less_unshared_data():
    own = {0: ("float32", (64,), Box((0,), (64,)))}  # only rank 0 holds "own"
    plans = [_plan(0, {"own": own[0], "rep": ("float32", (8,), Box((0,), (8,)))}),
             _plan(1, {"own": ("float32", (64,), None), "rep": ("float32", (8,), Box((0,), (8,)))})]
    plan = make_global_plan(plans)
    assert {c.fqn: c.writer for c in plan.chunks} == {"own": 0, "rep": 1}


def test_read_plan_splits_shared_ranges_and_balances_readers():
    from unickpt.plan.read_plan import batches, make_read_plan

    # chunk 0 (100 B): rank 0 needs [0, 60), rank 1 needs [40, 100); chunk 1: both need all 80 B
    needs = [{0: [(0, 60)], 1: [(0, 80)]}, {0: [(40, 60)], 1: [(0, 80)]}]
    segs = make_read_plan(needs)
    got = [(s.chunk_id, s.start, s.length, s.needers) for s in segs]
    assert got == [(0, 0, 40, (0,)), (0, 40, 20, (0, 1)), (0, 60, 40, (1,)), (1, 0, 80, (0, 1))]
    assert segs[0].reader == 0 and segs[2].reader == 1  # sole needers read their own bytes
    load = {0: 0, 1: 0}
    for s in segs:
        load[s.reader] += s.length
    assert sum(load.values()) == 100 + 80 and sorted(load.values()) == [60, 120]  # once each; 120 is optimal here
    assert [len(b) for b in batches(segs, {0: 100, 1: 80}, budget_bytes=120)] == [3, 1]
    assert [len(b) for b in batches(segs, {0: 100, 1: 80}, budget_bytes=1000)] == [4]


def test_checksum_block_size_bounds_blocks_per_chunk():
    from unickpt.format.integrity import block_size

    mib = 1 << 20
    assert block_size(5 * mib) == mib and block_size(32 * mib) == mib
    assert block_size(32 * mib + 1) == 2 * mib and block_size(1 << 30) == 32 * mib


def test_megatron_metadata_json_gets_a_hint():
    from unickpt.errors import FormatVersionError
    from unickpt.format.metadata import CheckpointMetadata

    with pytest.raises(FormatVersionError, match=r"format is None, expected 'unickpt'; this is a megatron-core "
                                                 r"checkpoint \(sharded_backend 'unickpt'\), its unickpt part is "
                                                 r"the 'unickpt' subdirectory"):
        CheckpointMetadata.from_json('{"sharded_backend": "unickpt", "sharded_backend_version": 1}')


def test_numpy_scalars_keep_their_type_through_flatten():
    """Regression: ``np.float64`` is a float subclass; the walk's fast path for plain leaves must not
    take it (it would come back as a python float), it goes through the codec's tagged form."""
    from unickpt.state.flat import flatten

    import json

    flat = flatten({"lr": np.float64(0.25), "n": np.int64(3), "x": 1.5, "s": "a", "t": torch.ones(2)}, for_load=False)
    stored = json.loads(json.dumps(flat.skeleton))  # as metadata.json holds it
    assert stored["x"] == 1.5 and stored["s"] == "a"
    for key, value in (("lr", np.float64(0.25)), ("n", np.int64(3))):
        back = codec.decode(stored[key])
        assert type(back) is type(value) and back == value, (key, back)


def test_codec_errors_name_the_nested_key_path():
    """UnsafeObjectError names the value's path below the key (dict keys, list and tuple indices),
    on save (encode) and on load (decode), not only the top-level key."""
    bad = {"opt": {"groups": [1, {"sched": _Custom(1)}]}, "pair": (0, _Custom(2))}
    with pytest.raises(UnsafeObjectError, match=r"^'hparams\.opt\.groups\.1\.sched': a value of class .*_Custom"):
        codec.encode(bad, allow_pickle=False, key="hparams")
    with pytest.raises(UnsafeObjectError, match=r"^'hparams\.pair\.1': a value of class .*_Custom"):
        codec.encode({"pair": (0, _Custom(2))}, allow_pickle=False, key="hparams")
    enc = codec.encode(bad)
    with pytest.raises(UnsafeObjectError, match=r"^'hparams\.opt\.groups\.1\.sched': stored object of class .*_Custom"):
        codec.decode(enc, key="hparams")
    enc = codec.encode({3: [_Custom(3)]})  # a non-string key: stored as __dict__ pairs
    with pytest.raises(UnsafeObjectError, match=r"^'cfg\.3\.0': stored object"):
        codec.decode(enc, key="cfg")


def test_rank_failure_errors_survive_pickling():
    """DCP (and any framework gathering exceptions across ranks) pickles them: each unickpt error comes
    back with its type, message and attributes (SaveFailedError did not unpickle: TypeError)."""
    import pickle

    from unickpt.errors import EarlierSaveFailedError, LoadFailedError, SaveFailedError, StorageError

    save = SaveFailedError("/ckpt/step_2", {1: "OSError: [Errno 5] Input/output error"})
    unknown = SaveFailedError("/ckpt/step_3", {0: "lost contact"}, committed=None)
    earlier = EarlierSaveFailedError([(2, "/ckpt/step_2", save)])
    for e in (save, unknown, earlier, LoadFailedError("/ckpt/step_2", {0: "x", 1: "y"}),
              StorageError("cannot list '/ckpt'", "/ckpt", OSError(5, "Input/output error"))):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e)
        assert getattr(back, "failures", None) == getattr(e, "failures", None)
        assert getattr(back, "path", None) == getattr(e, "path", None)
    assert pickle.loads(pickle.dumps(unknown)).committed is None
    assert pickle.loads(pickle.dumps(earlier)).steps == [2]
