"""Worker functions for test_dist_semantics.py (run on every rank of a DistPool)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import unickpt


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 33), nn.ReLU(), nn.Linear(33, 7), nn.LayerNorm(7))


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, optim, steps: int, seed: int) -> float:
    loss = torch.tensor(0.0)
    for i in range(steps):
        g = torch.Generator().manual_seed(seed + i)
        x = torch.randn(16, 12, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    return loss.item()


def _full_state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():  # cpu_offload: only rank 0 gets the full state
        for k, v in st.items():
            flat[f"optim.{fqn}.{k}"] = v
    return {k: v.clone() for k, v in flat.items()}


def fsdp2_save(path: str) -> dict:
    model = _fsdp2(_mlp())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    _train(model, optim, 3, seed=10)
    sched.step()
    handle = unickpt.save(path, {"model": model, "optim": optim, "sched": sched, "step": 3}, async_save=True)
    full = _full_state(model, optim)  # gathered while the save drains in the background
    # train on: nothing after the save's return may reach the checkpoint
    _train(model, optim, 1, seed=99)
    handle.wait()
    return {"full": full if dist.get_rank() == 0 else None, "stall_s": handle.stats.stall_s}


def fsdp2_load(path: str) -> dict:
    """Load, then one training step. The load writes FSDP2's local shards in place, so torch's
    ``set_model_state_dict`` is skipped (unickpt.state.writeback); a second load with it forced
    gives the same loss after the step."""
    import torch.distributed.checkpoint.state_dict as dsd

    from unickpt.state import writeback

    real, calls = dsd.set_model_state_dict, []
    dsd.set_model_state_dict = lambda m, sd, **kw: calls.append(m) or real(m, sd, **kw)
    try:
        losses = []
        for forced in (False, True):
            model = _fsdp2(_mlp())
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
            state = {"model": model, "optim": optim, "sched": sched, "step": 0}
            writes_back = writeback.writes_back
            if forced:
                writeback.writes_back = lambda m, sd: True
            penalty = sum(p.pow(2).sum() for p in model.parameters())  # a graph that saved the DTensors
            try:
                unickpt.load(path, state)
            finally:
                writeback.writes_back = writes_back
            try:
                penalty.backward()
                stale = "backward ran"
            except RuntimeError as e:  # as after torch's copy_: the parameters changed under the graph
                stale = "modified by an inplace operation" in str(e)
            model.zero_grad(set_to_none=True)
            if not forced:
                full, skipped, stale_skipped = _full_state(model, optim), not calls, stale
            losses.append(_train(model, optim, 1, seed=50))  # the loaded optimizer state is usable
    finally:
        dsd.set_model_state_dict = real
    return {"full": full if dist.get_rank() == 0 else None, "step": state["step"],
            "last_epoch": sched.last_epoch, "lr": optim.param_groups[0]["lr"], "loss": losses[0],
            "skipped_write_back": skipped, "loss_written_back": losses[1], "forced_calls": len(calls),
            "stale_graph_fails": [stale_skipped, stale]}


def ddp_save(path: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp())
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, optim, 2, seed=1)
    unickpt.save(path, {"model": model, "optim": optim})


def plain_load(path: str) -> dict:
    model = _mlp()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    unickpt.load(path, {"model": model, "optim": optim})
    return {k: v.clone() for k, v in model.state_dict().items()}


def data_file_sizes(path: str) -> dict:
    d = os.path.join(path, "data")
    return {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)}


def failing_write(path: str, fail_rank: int) -> str:
    import contextlib

    from unickpt.testing import Fault, inject

    faults = inject(Fault("write", nth=None)) if dist.get_rank() == fail_rank else contextlib.nullcontext()
    with faults:
        rank, ws = dist.get_rank(), dist.get_world_size()
        shard = unickpt.Shard(torch.full((1000,), float(rank)), (1000 * ws,), offsets=(1000 * rank,))
        handle = unickpt.save(path, {"w": shard}, async_save=True)
        try:
            handle.wait()
        except unickpt.SaveFailedError as e:
            return f"{sorted(e.failures)}|{e}"
        return "no error"


def disagreeing_dtypes(path: str) -> str:
    dtype = torch.float32 if dist.get_rank() == 0 else torch.float16
    try:
        unickpt.save(path, {"w": torch.zeros(4, dtype=dtype)})
    except unickpt.StateMismatchError as e:
        return str(e)
    return "no error"


def per_rank_save(path: str) -> float:
    torch.manual_seed(100 + dist.get_rank())
    state = {"rng": unickpt.RNGState(), "cursor": unickpt.PerRank({"pos": 10 * dist.get_rank()})}
    unickpt.save(path, state)
    return torch.rand(1).item()  # the next draw each rank must reproduce after loading


def per_rank_load(path: str, with_reshard: bool) -> dict:
    def merge(states, rank, world_size):
        return {"pos": sum(s["pos"] for s in states) + rank, "from": len(states)}

    torch.manual_seed(7)
    state = {"rng": unickpt.RNGState(reshard=(lambda states, rank, ws: states[rank % len(states)]) if with_reshard else None),
             "cursor": unickpt.PerRank(None, reshard=merge if with_reshard else None)}
    try:
        unickpt.load(path, state)
    except unickpt.PerRankReshardError as e:
        return {"error": str(e)}
    return {"draw": torch.rand(1).item(), "cursor": state["cursor"].value}


def checkpointer_run(root: str) -> dict:
    ckpt = unickpt.Checkpointer(root, keep_last=2, async_save=True)
    w = torch.zeros(64)
    handles = []
    for step in range(5):
        w.fill_(step * 10 + dist.get_rank())  # per-rank values: a DTensor-free way to see who wrote what
        handles.append(ckpt.save(step, {"w": unickpt.Shard(w, (64 * dist.get_world_size(),),
                                                            offsets=(64 * dist.get_rank(),))}))
    ckpt.wait()
    assert all(h.done() and h.stats.committed for h in handles)
    out = torch.zeros(64)
    step = ckpt.load({"w": unickpt.Shard(out, (64 * dist.get_world_size(),), offsets=(64 * dist.get_rank(),))})
    hits = [h.stats.plan_cache_hit for h in handles]
    return {"step": step, "value": out[0].item(), "listing": sorted(os.listdir(root)), "hits": hits}


def plan_cache_layout_changes(root: str) -> dict:
    """Saves whose layout changes on one rank only must re-plan; returning to a layout hits the cache."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    w = unickpt.Shard(torch.full((4,), float(rank)), (4 * ws,), offsets=(4 * rank,))
    layouts = [{"w": w}, {"w": w, **({"x": torch.arange(3.0)} if rank == 1 else {})}, {"w": w}]
    hits, loaded = [], []
    for i, state in enumerate(layouts):
        h = unickpt.save(os.path.join(root, f"s{i}"), state)
        hits.append(h.stats.plan_cache_hit)
    for i in range(3):
        out = {"w": unickpt.Shard(torch.zeros(4), (4 * ws,), offsets=(4 * rank,))}
        if i == 1:
            out["x"] = torch.zeros(3)
        unickpt.load(os.path.join(root, f"s{i}"), out)
        loaded.append({k: (v.tensor if isinstance(v, unickpt.Shard) else v).tolist() for k, v in out.items()})
    return {"hits": hits, "loaded": loaded}


def die_during_save(path: str, report: str) -> None:
    """Rank 1 dies (os._exit) while its async save drains; rank 0 writes what its handle raised."""
    rank = dist.get_rank()
    shard = unickpt.Shard(torch.full((1 << 20,), float(rank)), (2 << 20,), offsets=(rank << 20,))
    handle = unickpt.save(path, {"w": shard}, async_save=True)
    if rank == 1:
        os._exit(3)
    try:
        handle.wait(timeout=120)
        msg = "no error"
    except unickpt.SaveFailedError as e:
        msg = f"SaveFailedError: {e}"
    except BaseException as e:  # anything else is a bug: record its type
        msg = f"{type(e).__name__}: {e}"
    with open(report, "w") as f:
        f.write(msg)


def flatten_matches_torch_state_dicts() -> dict:
    """``flatten`` of {model, optimizer} (one combined ``get_state_dict``) and of a model with two
    optimizers (separate calls) against torch's own ``get_model_state_dict`` /
    ``get_optimizer_state_dict``: the same fqns, each leaf the same storage, each DTensor's box the
    one torch computes; a second flatten returns the same boxes (the spec cache)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from unickpt.geometry import Box
    from unickpt.state.flat import flatten

    def reference(model, optims: dict) -> dict:
        ref = {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
        for name, o in optims.items():
            for fqn, st in get_optimizer_state_dict(model, o)["state"].items():
                ref.update({f"{name}.state.{fqn}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
        return ref

    def check(state: dict, ref: dict) -> list[str]:
        first, second = flatten(state, for_load=False), flatten(state, for_load=False)
        assert sorted(first.tensors) == sorted(ref), (sorted(first.tensors), sorted(ref))
        for fqn, want in ref.items():
            leaf = first.tensors[fqn]
            local = want.to_local() if isinstance(want, DTensor) else want
            assert leaf.local.data_ptr() == local.data_ptr() and leaf.local.shape == local.shape, fqn
            if isinstance(want, DTensor):
                shape, offset = compute_local_shape_and_global_offset(want.shape, want.device_mesh, want.placements)
                assert leaf.spec == Box(tuple(offset), tuple(shape)), (fqn, leaf.spec, offset, shape)
            else:
                assert leaf.spec == Box((0,) * want.dim(), tuple(want.shape)), fqn
            assert second.tensors[fqn].spec == leaf.spec and leaf.storage_ptr == local.untyped_storage().data_ptr()
        return sorted(first.tensors)

    model = _fsdp2(_mlp())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, 1, seed=3)
    one = check({"model": model, "optim": optim}, reference(model, {"optim": optim}))

    model2 = _fsdp2(_mlp())
    params = list(model2.parameters())
    oa = torch.optim.AdamW(params[:2], lr=1e-2)
    ob = torch.optim.SGD(params[2:], lr=1e-2, momentum=0.9)
    loss = model2(torch.randn(4, 12)).sum()
    loss.backward()
    oa.step()
    ob.step()
    two = check({"model": model2, "oa": oa, "ob": ob}, reference(model2, {"oa": oa, "ob": ob}))
    return {"one": one, "two": two, "cache": _fsdp2_state_dict_cache(model, optim)}


def _fsdp2_state_dict_cache(model, optim) -> dict:
    """The save's state-dict cache on FSDP2 (its resharding pre-hook is the one hook it allows): after
    a training step and a new learning rate, a hit equals torch's ``get_state_dict`` (fqns, local
    shards, placements, the optimizer's own state dicts, param groups); FSDP2's unsharded
    parameters (registered between forward and backward with ``reshard_after_forward=False``) miss."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from unickpt.state import sd_cache

    def same(got, want) -> None:
        (gm, go), (wm, wo) = got, want
        assert list(gm) == list(wm)
        for k, v in wm.items():
            assert gm[k].to_local().data_ptr() == v.to_local().data_ptr() and gm[k].placements == v.placements, k
        assert list(go["state"]) == list(wo["state"]) and all(go["state"][k] is wo["state"][k] for k in wo["state"])
        assert go["param_groups"] == wo["param_groups"]

    sd_cache.clear()
    sd_cache.state_dicts(model, optim)
    _train(model, optim, 1, seed=4)
    optim.param_groups[0]["lr"] = 0.5
    same(sd_cache.state_dicts(model, optim), get_state_dict(model, optim))
    hits = sd_cache.cache_info()["hits"]
    # unsharded between forward and backward: the registered parameters are others, so a miss (torch's
    # call reshards them first through FSDP2's pre-hook), and then hits again once resharded
    model.set_reshard_after_forward(False)
    loss = model(torch.randn(4, 12)).sum()
    unsharded = any(not hasattr(p, "placements") for p in model.parameters())
    msd, _ = sd_cache.state_dicts(model, optim)
    sharded = all(hasattr(v, "placements") for v in msd.values())
    loss.backward()
    optim.zero_grad()
    info = sd_cache.cache_info()
    return {"hits": hits, "after": info, "unsharded_seen": unsharded, "result_sharded": sharded}


def save_load_after_rank_change(root: str, port: int) -> list[bool]:
    """An in-process restart that gives this process the other rank (elastic restarts do): save and
    load a Shard(0) DTensor before and after it. Each round trip must return the global tensor
    (a DTensor box cached for the first group would swap the halves after the restart)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    ok = []
    g = torch.arange(24.0).reshape(6, 4)
    for gen in range(2):
        if gen == 1:
            rank = 1 - dist.get_rank()
            dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        path = os.path.join(root, f"gen{gen}")
        unickpt.save(path, {"a": distribute_tensor(g * (gen + 1), mesh, [Shard(0)])})
        into = distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()])
        unickpt.load(path, {"a": into})
        ok.append(torch.equal(into.to_local(), g * (gen + 1)))
    return ok


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except BaseException as e:  # the test compares every rank's error type and message
        return type(e).__name__, str(e)
    return "ok", ""


def disagreeing_targets(root: str) -> dict:
    """Each rank names its own path, then its own step: refused on every rank, nothing written, and the
    committed step_0 (keep_last=1) survives; a save everyone agrees on works afterwards."""
    rank = dist.get_rank()
    w = unickpt.Shard(torch.full((4,), float(rank)), (8,), offsets=(4 * rank,))
    paths = _outcome(lambda: unickpt.save(os.path.join(root, f"run_rank{rank}"), {"w": w}))
    ckpt = unickpt.Checkpointer(os.path.join(root, "run"), keep_last=1)
    ckpt.save(0, {"w": w}).wait()
    steps = _outcome(lambda: ckpt.save(100 + rank, {"w": w}).wait())
    dist.barrier()  # rank 0 removes the directory it made for step_100 before it raises
    listing = sorted(os.listdir(os.path.join(root, "run")))
    dist.barrier()  # every rank has listed before rank 0 makes step_1
    ckpt.save(1, {"w": w}).wait()  # the engine still works
    out = {"w": unickpt.Shard(torch.zeros(4), (8,), offsets=(4 * rank,))}
    loaded = ckpt.load(out)
    return {"paths": paths, "steps": steps, "listing": listing, "written": sorted(os.listdir(root)),
            "loaded": loaded, "ok": torch.equal(out["w"].tensor, torch.full((4,), float(rank)))}


def options_bad_on_one_rank(root: str, bad_rank: int) -> dict:
    """Invalid per-call options on one rank only: the same error on every rank (no hang), and both the
    save and the load engines stay usable."""
    rank = dist.get_rank()
    w = torch.arange(8.0)
    save_opts = unickpt.SaveOptions(snapshot="bogus") if rank == bad_rank else None
    saved = _outcome(lambda: unickpt.save(os.path.join(root, "a"), {"w": w}, options=save_opts))
    typed = _outcome(lambda: unickpt.save(os.path.join(root, "b"), {"w": w},
                                          options={"snapshot": "overlap"} if rank == bad_rank else None))
    unickpt.save(os.path.join(root, "c"), {"w": w})
    load_opts = unickpt.LoadOptions(read_threads=0) if rank == bad_rank else None
    loaded = _outcome(lambda: unickpt.load(os.path.join(root, "c"), {"w": torch.zeros(8)}, options=load_opts))
    differ = _outcome(lambda: unickpt.load(os.path.join(root, "c"), {"w": torch.zeros(8)},
                                           options=unickpt.LoadOptions(redistribute=rank == 0)))
    mapped = _outcome(lambda: unickpt.load(os.path.join(root, "c"), {"w": torch.zeros(8)},
                                           mapping="bogus" if rank == bad_rank else None))
    out = {"w": torch.zeros(8)}
    unickpt.load(os.path.join(root, "c"), out)
    return {"saved": saved, "typed": typed, "loaded": loaded, "differ": differ, "mapped": mapped,
            "ok": torch.equal(out["w"], w),
            "committed": {p: os.path.exists(os.path.join(root, p, "metadata.json")) for p in "abc"}}
