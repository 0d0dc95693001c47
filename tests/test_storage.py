"""Storage through fsspec (the in-memory filesystem stands in for an object store here)."""
from __future__ import annotations

import fsspec
import pytest
import torch

import unickpt


def test_fsspec_memory_round_trip_with_partial_reads():
    root = "memory://unickpt-test/run"
    ckpt = unickpt.Checkpointer(root, keep_last=1, async_save=True)
    w = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    ckpt.save(1, {"w": w, "meta": {"lr": 0.5}})
    ckpt.save(2, {"w": w * 2, "meta": {"lr": 0.25}}).wait()
    fs = fsspec.filesystem("memory")
    assert fs.cat_file("/unickpt-test/run/latest") == b"step_2"
    assert not fs.exists("/unickpt-test/run/step_1")  # retention through fsspec
    out = {"w": torch.zeros(6, 10), "meta": None}
    assert ckpt.load(out) == 2 and torch.equal(out["w"], w * 2) and out["meta"] == {"lr": 0.25}
    # a ranged read of two rows only
    part = torch.zeros(2, 10)
    stats = unickpt.load(f"{root}/step_2", {"w": unickpt.Shard(part, (6, 10), offsets=(3, 0))}, strict=False,
                         verify=False)
    assert torch.equal(part, (w * 2)[3:5]) and stats.bytes_read == 2 * 10 * 4
    fs.rm("/unickpt-test", recursive=True)


def test_missing_remote_checkpoint_is_clear():
    with pytest.raises(unickpt.CheckpointNotFoundError, match="metadata.json is missing"):
        unickpt.load("memory://nothing-here/step_1", {"w": torch.zeros(1)})
