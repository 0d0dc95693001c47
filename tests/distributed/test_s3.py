"""S3 through s3fs against a real S3-compatible server (moto, on 127.0.0.1): commit by metadata.json
written last, ranged reads, multipart uploads, listing that ignores uncommitted checkpoints, and
multi-rank saves and resharding loads with zero-redundancy reads."""
from __future__ import annotations

import pytest
import torch

import unickpt

import s3_workers as sw


def test_s3_checkpointer_round_trip_retention_and_partial_reads(s3):
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    root = "s3://unickpt/single"
    opts = {**s3, "default_block_size": 5 << 20}  # 5 MiB parts: the 12 MB data file is a multipart upload
    ckpt = unickpt.Checkpointer(root, keep_last=2, storage_options=opts)
    w = torch.randn(3 << 20)  # 12 MiB
    for step in range(3):
        ckpt.save(step, {"w": w + step, "step": step, "rng": unickpt.RNGState()})
    ckpt.wait()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("unickpt/single")) == ["latest", "step_1", "step_2"]
    assert fs.cat_file("unickpt/single/latest") == b"step_2"
    fs.pipe_file("unickpt/single/step_3/data/0_0.bin", b"partial")  # an upload that never committed
    assert ckpt.latest_step() == 2
    assert unickpt.list_checkpoints(root, opts) == [(1, True), (2, True), (3, False)]
    out = {"w": torch.zeros(3 << 20), "step": -1, "rng": unickpt.RNGState()}
    assert ckpt.load(out) == 2 and torch.equal(out["w"], w + 2) and out["step"] == 2
    part = torch.zeros(1000)
    stats = unickpt.load(f"{root}/step_1", {"w": unickpt.Shard(part, (3 << 20,), offsets=(5000,))}, strict=False,
                         storage_options=opts)
    assert torch.equal(part, w[5000:6000] + 1)
    assert stats.bytes_read == 1 << 20  # one verified 1 MiB block of the 12 MiB chunk, by a ranged GET
    with pytest.raises(unickpt.CheckpointNotFoundError):
        unickpt.load(f"{root}/step_3", {"w": torch.zeros(1)}, storage_options=opts)


def test_s3_multi_rank_save_and_resharded_load(pool, s3):
    path = "s3://unickpt/multi/ckpt"
    pool(2).run(sw.save_sharded, path, s3)
    for m in (1, 3):
        results = pool(m).run(sw.load_sharded, path, s3)
        assert all(r["ok"] and r["redistributed"] for r in results)  # remote storage: read once job-wide
        assert sum(r["bytes_read"] for r in results) == sw.TOTAL_BYTES
