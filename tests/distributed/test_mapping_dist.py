"""Mapping rules compose with resharding (docs/cross-framework.md): megatron's fused, head-interleaved
``linear_qkv`` (grouped-query attention) saved as row shards on 2 ranks loads as Hugging Face's ``q``,
``k``, ``v`` row shards on 3 ranks (Permute + Split), and back (Fuse + Permute), on real gloo groups.
Every element is checked, and without checksum verification (which widens reads to whole checksum
blocks) each rank reads exactly its shards' bytes: no rank assembles a whole tensor."""
from __future__ import annotations

import pytest

import mapping_workers as w


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("mapping")
    pool(2).run(w.save_megatron, str(root / "megatron"))
    pool(2).run(w.save_hf, str(root / "hf"))
    return root


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("direction", ["to_hf", "to_megatron"])
def test_rules_and_resharding_compose(pool, saved, world, direction):
    path, fn = (saved / "megatron", w.load_as_hf) if direction == "to_hf" else (saved / "hf", w.load_as_megatron)
    for res in pool(world).run(fn, str(path), True):
        assert res["ok"]
    exact = pool(world).run(fn, str(path), False)
    assert all(r["ok"] for r in exact)
    assert [r["bytes_read"] for r in exact] == [4 * r["elements"] for r in exact]
    assert sum(r["elements"] for r in exact) == w.ROWS * w.HIDDEN
