"""Worker functions for test_dcp_storage.py (run on every rank of a DistPool: gloo, CPU): DCP's
``dcp.save`` / ``dcp.load`` through unickpt's StorageWriter / StorageReader, compared with DCP's own
FileSystemWriter / FileSystemReader where that is the contract."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import unickpt
import unickpt.fsdp


def _error(fn) -> str | None:
    """The last line of what ``fn()`` raises (DCP wraps every rank's error in a CheckpointException), or None."""
    try:
        fn()
    except BaseException as e:
        return f"{type(e).__name__}: " + str(e).strip().splitlines()[-1]
    return None


def _bits(t: torch.Tensor) -> list:
    return t.detach().reshape(-1).view(torch.uint8).tolist()


# --------------------------------------------------------------------------------------------- #
# overwrite: replace at commit, other files kept, a failed save leaves the old checkpoint
# --------------------------------------------------------------------------------------------- #
def overwrite_run(path: str) -> dict:
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "notes.txt"), "w") as f:
            f.write("not a checkpoint file")
    dist.barrier()

    def state(v: float) -> dict:
        return {"w": torch.full((6, 3), v), "rep": torch.arange(5.0) * v, "step": int(v)}

    def load() -> dict:
        t = {"w": torch.zeros(6, 3), "rep": torch.zeros(5), "step": -1}
        dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(path))
        return {"w": _bits(t["w"]), "rep": _bits(t["rep"]), "step": t["step"]}

    dcp.save(state(1.0), storage_writer=unickpt.fsdp.StorageWriter(path))
    first = load()
    dcp.save(state(2.0), storage_writer=unickpt.fsdp.StorageWriter(path))  # replaces the first
    second = load()
    gens_after_two = sorted(os.listdir(os.path.join(path, unickpt.fsdp.dcp.GENERATIONS_DIR)))
    # a save that fails on rank 1 (a value that cannot be pickled) never touches the committed one
    bad = state(3.0)
    if rank == 1:
        bad["fn"] = lambda: 1
    else:
        bad["fn"] = 3
    failed = _error(lambda: dcp.save(bad, storage_writer=unickpt.fsdp.StorageWriter(path)))
    after_failure = load()
    refused = _error(lambda: dcp.save(state(4.0), storage_writer=unickpt.fsdp.StorageWriter(path, overwrite=False)))
    after_refused = load()
    ref1, ref2 = state(1.0), state(2.0)
    return {"first": first, "second": second, "after_failure": after_failure, "after_refused": after_refused,
            "want1": {"w": _bits(ref1["w"]), "rep": _bits(ref1["rep"]), "step": 1},
            "want2": {"w": _bits(ref2["w"]), "rep": _bits(ref2["rep"]), "step": 2},
            "failed": failed, "refused": refused, "gens_after_two": gens_after_two,
            "files": sorted(os.listdir(path)),
            "notes": open(os.path.join(path, "notes.txt")).read()}


def overwrite_dcp_dir_run(path: str) -> dict:
    """A directory that holds a checkpoint of DCP's own FileSystemWriter, saved over by StorageWriter:
    DCP's files stay (DCP would leave unrelated files too), unickpt's checkpoint is the one read."""
    rank = dist.get_rank()
    dcp.save({"w": torch.full((4,), 1.0) + rank * 0}, checkpoint_id=path)
    dcp.save({"w": torch.full((4,), 7.0)}, storage_writer=unickpt.fsdp.StorageWriter(path))
    t = {"w": torch.zeros(4)}
    dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(path))
    return {"w": t["w"].tolist(), "files": sorted(os.listdir(path))}


# --------------------------------------------------------------------------------------------- #
# ShardedTensor with several shards on one rank
# --------------------------------------------------------------------------------------------- #
def _spec(kind: str):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

    if kind == "interleaved":  # two shards on each of 2 ranks: rows 0-2, 9-11 on rank 0; 3-5, 6-8 on rank 1
        return ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"])
    if kind == "rows":
        return ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"])
    if kind == "uneven3":  # three shards on rank 1, one on rank 0
        return EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 5], placement="rank:1"),
            ShardMetadata(shard_offsets=[2, 0], shard_sizes=[5, 5], placement="rank:0"),
            ShardMetadata(shard_offsets=[7, 0], shard_sizes=[1, 5], placement="rank:1"),
            ShardMetadata(shard_offsets=[8, 0], shard_sizes=[4, 5], placement="rank:1")])
    raise ValueError(kind)


def multi_shard_run(path: str, save_kind: str, load_kind: str) -> dict:
    from torch.distributed._shard import sharded_tensor

    torch.manual_seed(5)
    whole = torch.randn(12, 5)
    st = sharded_tensor.zeros(_spec(save_kind), 12, 5)
    for s in st.local_shards():
        o, n = s.metadata.shard_offsets, s.metadata.shard_sizes
        s.tensor.copy_(whole[o[0]:o[0] + n[0], o[1]:o[1] + n[1]])
    dcp.save({"st": st, "plain": whole.clone()}, storage_writer=unickpt.fsdp.StorageWriter(path))
    into = sharded_tensor.zeros(_spec(load_kind), 12, 5)
    target = {"st": into, "plain": torch.zeros(12, 5)}
    dcp.load(target, storage_reader=unickpt.fsdp.StorageReader(path))
    bad = []
    for s in into.local_shards():
        o, n = s.metadata.shard_offsets, s.metadata.shard_sizes
        if not torch.equal(s.tensor.view(torch.uint8), whole[o[0]:o[0] + n[0], o[1]:o[1] + n[1]].contiguous().view(torch.uint8)):
            bad.append(list(o))
    # and a plain tensor loaded from the ShardedTensor's chunks
    flat = {"st": torch.zeros(12, 5), "plain": torch.zeros(12, 5)}
    dcp.load(flat, storage_reader=unickpt.fsdp.StorageReader(path))
    return {"local_shards_saved": len(st.local_shards()), "bad_shards": bad,
            "as_tensor_equal": torch.equal(flat["st"].view(torch.uint8), whole.view(torch.uint8)),
            "plain_equal": torch.equal(target["plain"], whole)}


# --------------------------------------------------------------------------------------------- #
# process groups and modes DCP uses
# --------------------------------------------------------------------------------------------- #
def no_dist_run(root: str) -> dict:
    """Each rank saves and loads alone (``no_dist=True``) while a world process group exists."""
    rank = dist.get_rank()
    path = os.path.join(root, f"r{rank}")
    w = torch.arange(8.0) + 10 * rank
    dcp.save({"w": w, "step": rank}, storage_writer=unickpt.fsdp.StorageWriter(path), no_dist=True)
    t = {"w": torch.zeros(8), "step": -1}
    dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(path), no_dist=True)
    return {"equal": torch.equal(t["w"], w), "step": t["step"]}


def no_collectives_run(path: str) -> dict:
    """``dcp.save(use_collectives=False)``: every rank saves its own checkpoint under one path, and
    ``dcp.load`` reads each rank's own (its global metadata is absent, so DCP asks for the rank's)."""
    rank = dist.get_rank()
    w = torch.arange(6.0) * (rank + 1)
    dcp.save({"w": w}, storage_writer=unickpt.fsdp.StorageWriter(path), use_collectives=False)
    t = {"w": torch.zeros(6)}
    dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(path))
    return {"equal": torch.equal(t["w"], w), "files": sorted(os.listdir(path))}


def subgroup_run(path: str) -> dict:
    """A group of ranks 0 and 1 of 3, passed to dcp.save / dcp.load only (not to the writer / reader):
    rank 2 takes no part."""
    group = dist.new_group([0, 1], backend="gloo")
    rank = dist.get_rank()
    if rank == 2:
        return {"skipped": True}
    w = torch.arange(4.0) + 100
    dcp.save({"w": w, "step": 5}, storage_writer=unickpt.fsdp.StorageWriter(path), process_group=group)
    t = {"w": torch.zeros(4), "step": 0}
    dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(path), process_group=group)
    return {"w": t["w"].tolist(), "step": t["step"]}


def this_process_run(path: str) -> dict:
    """Rank 0 alone saves and loads through a writer / reader of ``process_group=THIS_PROCESS``."""
    from unickpt.dist.comm import THIS_PROCESS

    out = {}
    if dist.get_rank() == 0:
        sd = {"w": torch.arange(5.0), "step": 7, "cfg": {"lr": 0.5, "name": "x"}}
        dcp.save(sd, storage_writer=unickpt.fsdp.StorageWriter(path, process_group=THIS_PROCESS), no_dist=True)
        t = {"w": torch.zeros(5), "step": 0, "cfg": {"lr": 0.0, "name": ""}}
        dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(path, process_group=THIS_PROCESS), no_dist=True)
        out = {"w": t["w"].tolist(), "step": t["step"], "cfg": t["cfg"]}
    dist.barrier()
    return out


# --------------------------------------------------------------------------------------------- #
# FSDP1 model + optimizer (get_state_dict) saved on 2 ranks, loaded on 3
# --------------------------------------------------------------------------------------------- #
def fsdp1_save(path: str, native: bool) -> dict:
    import fsdp_workers as w
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = w.build("fsdp1")
    w.train(model, optim, 2, seed=1)
    ref = w.full_state(model, optim)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    if native:
        dcp.save(sd, checkpoint_id=path)
    else:
        dcp.save(sd, storage_writer=unickpt.fsdp.StorageWriter(path))
    return {"saved": ref}


def fsdp1_load(path: str, native: bool) -> dict:
    import fsdp_workers as w
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = w.build("fsdp1", seed=123)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    reader = dcp.FileSystemReader(path) if native else unickpt.fsdp.StorageReader(path)
    err = _error(lambda: dcp.load(sd, storage_reader=reader))
    if err is not None:
        return {"error": err}
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return {"error": None, "loaded": w.full_state(model, optim)}


def async_group_run(path: str) -> dict:
    """dcp.async_save with a process group given to async_save only: the writer's engine for that
    group is created on the caller's thread (staging), not first in DCP's save thread."""
    from unickpt.engine import _ENGINES

    group = dist.new_group(backend="gloo")
    w = torch.arange(6.0) + 1
    writer = unickpt.fsdp.StorageWriter(path)
    fut = dcp.async_save({"w": w, "step": 2}, storage_writer=writer, process_group=group)
    created_on_caller = group in _ENGINES
    w.add_(100)  # after staging: must not reach the checkpoint
    (getattr(fut, "upload_completion", None) or fut).result()
    writer.close()
    t = {"w": torch.zeros(6), "step": 0}
    dcp.load(t, storage_reader=unickpt.fsdp.StorageReader(path), process_group=group)
    return {"created_on_caller": created_on_caller, "w": t["w"].tolist(), "step": t["step"]}
