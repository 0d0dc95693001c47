"""Worker functions for test_pipeline.py (run on every rank of a DistPool)."""
from __future__ import annotations

import json
import os
import signal
import time
import zlib
from dataclasses import fields

import torch
import torch.distributed as dist

import unickpt
from unickpt.engine import get_engine
from unickpt.options import SaveOptions
from unickpt.testing import writer_pid

DEFAULTS = {f.name: getattr(SaveOptions(), f.name) for f in fields(SaveOptions)}  # reset between tests


def _configure(**kw) -> None:
    get_engine().configure(**{**DEFAULTS, **kw})


def reset_options() -> None:
    """The default save options on this rank's engine (conftest runs it after each pool test)."""
    _configure()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------------- #
# plan cache
# ---------------------------------------------------------------------------------------------- #
def plan_cache_collectives(root: str) -> list[dict]:
    """Saves of one layout, then rank 1 alone changes its layout, then the first layout again."""
    _configure()
    rank, ws = dist.get_rank(), dist.get_world_size()
    w = unickpt.Shard(torch.full((4,), float(rank)), (4 * ws,), offsets=(4 * rank,))
    tag = zlib.crc32(root.encode())  # a layout no earlier test in this pool has planned (same on all ranks)
    states = [{f"w{tag}": w}, {f"w{tag}": w},
              {f"w{tag}": w, **({"extra": torch.arange(3.0)} if rank == 1 else {})},
              {f"w{tag}": w}]
    out = []
    for i, st in enumerate(states):
        s = unickpt.save(os.path.join(root, f"s{i}"), st).stats
        out.append({"hit": s.plan_cache_hit, "plan": s.collectives_plan, "commit": s.collectives_commit,
                    "total": s.collectives})
    return out


# ---------------------------------------------------------------------------------------------- #
# balance
# ---------------------------------------------------------------------------------------------- #
def skewed_replicated(root: str) -> dict:
    """Replicated tensors of very different sizes: every rank holds all of them."""
    _configure()
    g = torch.Generator().manual_seed(5)
    sizes = [(2048, 1024), (3, 300000), (50000,), (77, 13), (1, 1)] + [(int(n), 129) for n in
                                                                      torch.randint(1, 400, (60,), generator=g)]
    state = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(sizes)}
    path = os.path.join(root, "rep")
    h = unickpt.save(path, state)
    size = os.path.getsize(os.path.join(path, "data", f"{dist.get_rank()}_0.bin"))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(path, out)
    ok = all(torch.equal(out[k], state[k]) for k in state)
    return {"bytes_per_rank": h.stats.bytes_per_rank, "max_mean": h.stats.max_mean_bytes, "file_size": size,
            "ok": ok, "total": sum(v.numel() * 4 for v in state.values())}


# ---------------------------------------------------------------------------------------------- #
# merging vs flat ranges
# ---------------------------------------------------------------------------------------------- #
def _flat_state(rank: int, ws: int) -> tuple[dict, dict]:
    """ZeRO-like flat shards: uneven cuts of a (37, 11) and a (6, 5, 7) tensor, a 1-D tensor and a
    bf16 matrix; the last two are replicated across the two halves of the world (DP replicas)."""
    g = torch.Generator().manual_seed(11)
    full = {"a": torch.randn(37, 11, generator=g), "b": torch.randn(6, 5, 7, generator=g),
            "c": torch.randn(1001, generator=g), "d": torch.randn(19, 64, generator=g).to(torch.bfloat16)}
    state = {}
    cuts = {"a": [0, 50, 51, 300, 407], "b": [0, 71, 140, 141, 210]}
    for k in ("a", "b"):
        c = cuts[k]
        lo, hi = c[rank * 4 // ws], c[(rank + 1) * 4 // ws]
        state[k] = unickpt.Shard(full[k].reshape(-1)[lo:hi].clone(), full[k].shape, flat_range=(lo, hi - lo))
    half = max(1, ws // 2)
    for k, c in (("c", [0, 333, 1001]), ("d", [0, 700, 19 * 64])):
        i = (rank % half) * 2 // half if half > 1 else 0
        lo, hi = (c[0], c[2]) if half == 1 else (c[i], c[i + 1])
        state[k] = unickpt.Shard(full[k].reshape(-1)[lo:hi].clone(), full[k].shape, flat_range=(lo, hi - lo))
    return state, full


def merge_vs_store(root: str, mode: str, pool_bytes: int | None) -> dict:
    _configure(flat_ranges=mode, pool_bytes=pool_bytes, piece_bytes=256 << 10)
    rank, ws = dist.get_rank(), dist.get_world_size()
    state, full = _flat_state(rank, ws)
    path = os.path.join(root, mode)
    h = unickpt.save(path, state, async_save=True)
    for v in state.values():  # nothing after the call may reach the checkpoint
        v.tensor.fill_(-1)
    h.wait()
    s = h.stats
    # load whole tensors on every rank, and the original flat shards
    out_full = {k: torch.zeros_like(v) for k, v in full.items()}
    unickpt.load(path, out_full)
    shards, _ = _flat_state(rank, ws)
    for v in shards.values():
        v.tensor.zero_()
    unickpt.load(path, shards)
    expect, _ = _flat_state(rank, ws)
    meta = json.load(open(os.path.join(path, "metadata.json"))) if rank == 0 else None
    kinds = None
    if meta is not None:
        kinds = {k: sorted({"flat" if "flat_start" in c else "box" for c in t["chunks"]}) for k, t in meta["tensors"].items()}
    return {"full": {k: _bits(v).tolist() for k, v in out_full.items()},
            "full_ok": all(torch.equal(_bits(out_full[k]), _bits(full[k])) for k in full),
            "shards_ok": all(torch.equal(_bits(shards[k].tensor), _bits(expect[k].tensor)) for k in expect),
            "kinds": kinds, "sends": s.p2p_sends, "recvs": s.p2p_recvs, "sent": s.merge_bytes_sent,
            "streamed": s.streamed}


# ---------------------------------------------------------------------------------------------- #
# bigger than the pool, all writer kinds
# ---------------------------------------------------------------------------------------------- #
def bigger_than_pool(root: str, writer: str, direct: bool, merge: bool) -> dict:
    _configure(pool_bytes=2 << 20, piece_bytes=256 << 10, writer=writer, direct_io=direct,
               flat_ranges="merge" if merge else "store", segment_bytes=3 << 20)
    rank, ws = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    big = torch.randn(1_500_001, generator=g)  # 6 MB, replicated: split across ranks
    mat = torch.randn(900, 1000, generator=g)
    view = mat[:, ::3]  # non-contiguous
    flat = torch.randn(640_007, generator=g).to(torch.float16)
    n = flat.numel()
    lo, hi = n * rank // ws, n * (rank + 1) // ws
    state = {"big": big, "view": view, "half": unickpt.Shard(flat[lo:hi].clone(), (n,), flat_range=(lo, hi - lo)),
             "small": torch.arange(7, dtype=torch.int16)}
    path = os.path.join(root, f"{writer}-{direct}-{merge}")
    h = unickpt.save(path, state)
    out = {"big": torch.zeros_like(big), "view": torch.zeros(900, 334), "half": torch.zeros(n, dtype=torch.float16),
           "small": torch.zeros(7, dtype=torch.int16)}
    unickpt.load(path, out)
    ok = (torch.equal(out["big"], big) and torch.equal(out["view"], view) and torch.equal(_bits(out["half"]), _bits(flat))
          and torch.equal(out["small"], state["small"]))
    files = sorted(os.listdir(os.path.join(path, "data")))
    return {"ok": ok, "streamed": h.stats.streamed, "capacity": h.stats.pool_capacity,
            "bytes_staged": h.stats.bytes_staged, "ring_wait_s": h.stats.ring_wait_s, "files": files,
            "writer": h.stats.writer}


# ---------------------------------------------------------------------------------------------- #
# failures in each stage
# ---------------------------------------------------------------------------------------------- #
def _inject(stage: str, fail: bool, root: str):
    """Make one stage fail on this rank (storage stages through unickpt.testing.faults; staging,
    checksum and merge by patching their function); returns an undo callable."""
    import unickpt.format.integrity as integrity
    import unickpt.saving.pipeline as pl
    import unickpt.saving.transfers as transfers
    from unickpt.testing import Fault, install

    undo = []

    def patch(obj, name, fn):
        old = getattr(obj, name)
        setattr(obj, name, fn)
        undo.append(lambda: setattr(obj, name, old))

    def boom(*_a, **_k):
        raise OSError(5, f"injected {stage} failure on rank {dist.get_rank()}")

    def faults(*fs: Fault) -> None:
        undo.append(install(*fs))

    if fail:
        if stage == "stage":
            patch(pl, "copy_bytes", boom)
        elif stage == "checksum":
            patch(integrity.ChunkHasher, "update", boom)
        elif stage in ("write", "write-direct"):  # the direct path is write_file(direct=True) too
            faults(Fault("write", match="*.bin", nth=None))
        elif stage == "upload":
            faults(Fault("write", match=os.path.join(root, "remote") + "*", nth=None))
        elif stage == "commit":
            faults(Fault("rename", match="*metadata.json", nth=None))
        elif stage == "merge":  # the sends' snapshot fails: the rank still owes its peers their bytes
            patch(transfers.MergeTransfers, "post_sends", boom)
    return lambda: [u() for u in reversed(undo)]


def failing_stage(root: str, stage: str, fail_rank: int) -> dict:
    """Step 1 commits; step 2 fails in ``stage`` on ``fail_rank``; step 3 commits again. The state
    streams through a 2 MiB ring and merges a flat-sharded matrix (transfers between the ranks), so
    a failing rank must still settle the transfers it owes."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    remote = os.path.join(root, "remote")
    _configure(pool_bytes=2 << 20, piece_bytes=256 << 10, segment_bytes=1 << 20, flat_ranges="merge",
               direct_io=stage == "write-direct", writer="process" if stage == "writer-died" else "thread",
               upload_to=remote if stage == "upload" else None)
    ck = unickpt.Checkpointer(os.path.join(root, "run"), keep_last=1)
    n = 3_000_000  # 12 MB: streams through the 2 MiB ring
    cuts = [0] + [n * r // ws + 123 for r in range(1, ws)] + [n]  # cuts inside rows: merging moves bytes
    lo, hi = cuts[rank], cuts[rank + 1]

    def state_for(step: int) -> dict:
        w = torch.arange(lo, hi, dtype=torch.float32) + step
        return {"w": unickpt.Shard(w, (3000, 1000), flat_range=(lo, hi - lo)),
                "rep": torch.full((1000, 300), float(step))}

    ck.save(1, state_for(1)).wait()
    undo = _inject(stage, rank == fail_rank, root)
    error = None
    try:
        h = ck.save(2, state_for(2))
        if stage == "writer-died" and rank == fail_rank:
            os.kill(writer_pid(), signal.SIGKILL)
        h.wait(timeout=120)
    except unickpt.SaveFailedError as e:
        error = {"failures": sorted(e.failures), "text": str(e)}
    except BaseException as e:  # anything else is a bug: report its type
        error = {"failures": None, "text": f"{type(e).__name__}: {e}"}
    finally:
        undo()
    step2 = os.path.exists(os.path.join(root, "run", "step_2", "metadata.json"))
    latest = open(os.path.join(root, "run", "latest")).read() if rank == 0 else None
    out = {"w": unickpt.Shard(torch.zeros(hi - lo), (3000, 1000), flat_range=(lo, hi - lo)), "rep": torch.zeros(1000, 300)}
    loaded = ck.load(out)
    ok1 = torch.equal(out["w"].tensor, state_for(1)["w"].tensor) and torch.equal(out["rep"], state_for(1)["rep"])
    h3 = ck.save(3, state_for(3))  # the engine recovers
    ck.load(out)
    ok3 = torch.equal(out["w"].tensor, state_for(3)["w"].tensor) and h3.stats.committed
    ck.close()
    return {"error": error, "step2_committed": step2, "latest": latest, "loaded_step": loaded, "ok1": ok1, "ok3": ok3}


def commit_and_load_remote(root: str) -> dict:
    """Two-tier: local files uploaded to a second directory as they complete; both copies load."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    remote = os.path.join(root, "remote")
    _configure(upload_to=remote, segment_bytes=1 << 20, pool_bytes=2 << 20, piece_bytes=256 << 10)
    n = 1_000_000
    lo, hi = n * rank // ws, n * (rank + 1) // ws
    w = torch.randn(n, generator=torch.Generator().manual_seed(2))
    h = unickpt.save(os.path.join(root, "local", "ck"), {"w": unickpt.Shard(w[lo:hi].clone(), (n,), offsets=(lo,))})
    outs = []
    for base in (os.path.join(root, "local", "ck"), os.path.join(remote, "ck")):
        o = torch.zeros(n)
        unickpt.load(base, {"w": o})
        outs.append(torch.equal(o, w))
    return {"ok": outs, "uploaded": h.stats.bytes_uploaded, "written": h.stats.bytes_written,
            "files": sorted(os.listdir(os.path.join(remote, "ck", "data")))}


def mismatched_options(root: str) -> str:
    """Rank 1 merges flat ranges, rank 0 stores them: every rank must refuse the save."""
    _configure(flat_ranges="merge" if dist.get_rank() == 1 else "store")
    try:
        unickpt.save(os.path.join(root, "c"), {"w": torch.ones(4)})
    except ValueError as e:
        return f"ValueError: {e}"
    finally:
        _configure()
    return "no error"
