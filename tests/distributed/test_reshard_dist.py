"""Round trips N -> M ranks across layouts (replicated, DTensor Shard(0)/Shard(1)/Replicate, 2-D
mesh, flat irregular shards, row boxes), bitwise, on real gloo process groups."""
from __future__ import annotations

import os

import pytest
import torch

import unickpt
from unickpt.tools.reader import CheckpointReader
from layouts import LAYOUTS, TENSORS, bits, empty_like_layout, expected_local, layout_leaf, local_of

WORLD_SIZES = [1, 2, 3, 4]
# load each saved layout into a different one (and, separately, into the same one)
ROTATE = {l: LAYOUTS[(i + 3) % len(LAYOUTS)] for i, l in enumerate(LAYOUTS)}


def _save_all(path: str) -> dict:
    state = {layout: {name: layout_leaf(name, layout) for name in TENSORS} for layout in LAYOUTS}
    state["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    h = unickpt.save(path, state)
    return h.stats.as_dict()


def _load_check(path: str, mapping: dict[str, str]) -> dict:
    """Load saved layout L into layout mapping[L]; return {key: bitwise equal?} and bytes read."""
    state = {saved: {name: empty_like_layout(name, target) for name in TENSORS} for saved, target in mapping.items()}
    state["scalar"] = torch.tensor(0.0, dtype=torch.float64)
    stats = unickpt.load(path, state)
    ok = {}
    for saved, target in mapping.items():
        for name in TENSORS:
            got = local_of(state[saved][name])
            want = expected_local(name, target)
            ok[f"{saved}->{target}/{name}"] = got.dtype == want.dtype and torch.equal(bits(got), bits(want))
    ok["scalar"] = state["scalar"].item() == 2.5
    return {"ok": ok, "bytes_read": stats.bytes_read}


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    paths = {}
    for n in WORLD_SIZES:
        paths[n] = str(root / f"saved_ws{n}")
        pool(n).run(_save_all, paths[n])
    return paths


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("m", WORLD_SIZES)
@pytest.mark.parametrize("rotate", [False, True], ids=["same-layout", "other-layout"])
def test_roundtrip_n_to_m(pool, saved, n, m, rotate):
    mapping = ROTATE if rotate else {l: l for l in LAYOUTS}
    results = pool(m).run(_load_check, saved[n], mapping)
    for rank, res in enumerate(results):
        bad = [k for k, v in res["ok"].items() if not v]
        assert not bad, f"saved on {n}, loaded on {m}: rank {rank} got wrong values for {bad}"


def test_replicated_written_once_and_balanced(saved):
    """Each unique chunk is stored exactly once; total stored bytes equal the tensors' bytes."""
    path = saved[4]
    meta = CheckpointReader(path).meta  # format v2: split tensors' chunks come from the index files
    per_key = {name: torch.tensor([], dtype=dtype).element_size() * torch.Size(shape).numel()
               for name, (shape, dtype) in TENSORS.items()}
    for layout in LAYOUTS:
        for name in TENSORS:
            stored = sum(c.byte_length for c in meta.tensors[f"{layout}.{name}"].chunks)
            assert stored == per_key[name], (layout, name, stored)
    data_bytes = sum(os.path.getsize(os.path.join(path, "data", f)) for f in os.listdir(os.path.join(path, "data")))
    assert data_bytes == sum(per_key.values()) * len(LAYOUTS) + 8  # + the float64 scalar
    # replicated tensors are spread over ranks, not all on rank 0
    writers = {c.file for name in TENSORS for c in meta.tensors[f"replicated.{name}"].chunks}
    assert len(writers) > 1, writers
    # DTensor Shard(0) over the 4 ranks: each rank's part of an even split (format v2)
    assert meta.format_version == 2 and any(t.split is not None for t in meta.tensors.values())


def _load_partial(path: str, verify: bool) -> int:
    """Load only a 1-row box of 'a' from a checkpoint whose 'a' is stored as one whole chunk."""
    target = torch.zeros(1, 6)
    state = {"replicated": {"a": unickpt.Shard(target, (7, 6), offsets=(3, 0))}}
    stats = unickpt.load(path, state, strict=False, verify=verify)
    assert torch.equal(target, layout_leaf("a", "replicated")[3:4])
    return stats.bytes_read


def test_partial_read_reads_only_needed_bytes(pool, saved):
    """Without verification a target needing one row reads exactly that row's bytes; with it, the
    small (< 1 MiB) chunk is read whole so that its checksum can be checked."""
    assert pool(1).run(_load_partial, saved[1], False) == [6 * 4]
    assert pool(1).run(_load_partial, saved[1], True) == [7 * 6 * 4]
