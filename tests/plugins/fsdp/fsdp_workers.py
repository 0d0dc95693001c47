"""Worker functions for test_fsdp.py (run on every rank of a DistPool: gloo, CPU).

The model has every awkward case at once: a tied embedding / output weight, uneven first
dimensions (11 and 7 rows on 2-4 ranks), a 1x1 layer whose two parameters are smaller than the
world size, a frozen layer (no optimizer state), and a persistent buffer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import unickpt
import unickpt.fsdp

FLAVOURS = ("fsdp1", "fsdp1_orig", "fsdp2")
_DATA_RANK = [0]  # which batch this rank trains on (set by build)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.l1 = nn.Linear(6, 7)
        self.frozen = nn.Linear(7, 7)
        self.norm = nn.LayerNorm(7)
        self.tiny = nn.Linear(1, 1)  # 1x1: both parameters have fewer elements than ranks
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.frozen(torch.tanh(self.l1(self.emb(x)))))
        h = h + self.tiny(h[..., :1])
        return self.head(h[..., :6] * self.scale)


def build(flavour: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model wrapped as ``flavour`` and its AdamW (over all parameters, frozen ones included)."""
    torch.manual_seed(seed)
    model = Net()
    if flavour in ("fsdp1", "fsdp1_orig"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        kw = dict(device_id=torch.device("cpu"), use_orig_params=flavour == "fsdp1_orig")
        model.frozen = FSDP(model.frozen, **kw)
        model.tiny = FSDP(model.tiny, **kw)
        model = FSDP(model, **kw)
    elif flavour == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model.frozen, mesh=mesh)
        fully_shard(model.tiny, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif flavour == "hsdp1":  # FSDP1 HYBRID_SHARD: shard within pairs of ranks, replicate across them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        kw = dict(device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                  device_mesh=init_device_mesh("cpu", (dist.get_world_size() // 2, 2)))
        model.frozen = FSDP(model.frozen, **kw)
        model.tiny = FSDP(model.tiny, **kw)
        model = FSDP(model, **kw)
    elif flavour in ("hsdp2", "fsdp2_tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "x"))
        if flavour == "fsdp2_tp":  # tensor parallel over "x", FSDP2 over "dp"
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

            # 7 output features on 2 ranks: uneven column shards, gathered after each layer
            parallelize_module(model, mesh["x"], {"l1": ColwiseParallel(output_layouts=Replicate()),
                                                  "frozen": ColwiseParallel(output_layouts=Replicate())})
            mesh = mesh["dp"]
        fully_shard(model.frozen, mesh=mesh)  # 2-D mesh: HSDP (replicate over "dp", shard over "x")
        fully_shard(model.tiny, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        raise ValueError(flavour)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # tensor-parallel peers (ranks 2k and 2k+1 under fsdp2_tp) must see the same batch
    _DATA_RANK[0] = dist.get_rank() // 2 if flavour == "fsdp2_tp" else dist.get_rank()
    return model, optim


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(seed + 1000 * i + _DATA_RANK[0])
        x = torch.randint(0, 11, (8,), generator=g)
        y = torch.randint(0, 11, (8,), generator=g)
        F.cross_entropy(model(x), y).backward()
        optim.step()
        optim.zero_grad()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict | None:
    """Every parameter, buffer and optimizer state value, whole, on rank 0 (None elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # cpu_offload=True means rank0_only, which hangs FSDP1 on gloo: every rank gathers, rank 0 reports
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() != 0:
        return None
    out = {f"model.{k}": v.clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    out["param_groups"] = [{k: v for k, v in g.items()} for g in osd["param_groups"]]
    return out


def save_run(path: str, flavour: str, mode: str = "auto", merge: bool = False) -> dict:
    """Train 2 steps, save, record the full state; then train one more step and record it again."""
    from unickpt.engine import get_engine

    model, optim = build(flavour)
    train(model, optim, 2, seed=1)
    before = full_state(model, optim)
    state = {**unickpt.fsdp.state(model, optim, mode=mode), "step": 2}
    eng = get_engine()
    old = eng.options
    if merge:
        eng.configure(flat_ranges="merge")
    try:
        stats = unickpt.save(path, state).stats
    finally:
        eng.options = old
    train(model, optim, 1, seed=7)
    return {"saved": before, "after_step": full_state(model, optim), "merged": stats.flat_ranges,
            "bytes_written": stats.bytes_written, "sends": stats.p2p_sends}


def load_run(path: str, flavours, mode: str = "auto", step_after: bool = False) -> list[dict]:
    """For each flavour: build a fresh (differently initialised) model, load, record the full state
    (and, with ``step_after``, the state after one more training step)."""
    out = []
    for flavour in ([flavours] if isinstance(flavours, str) else flavours):
        model, optim = build(flavour, seed=123)
        state = {**unickpt.fsdp.state(model, optim, mode=mode), "step": 0}
        unickpt.load(path, state)
        res = {"flavour": flavour, "loaded": full_state(model, optim), "step": state["step"]}
        if step_after:
            train(model, optim, 1, seed=7)
            res["after_step"] = full_state(model, optim)
        out.append(res)
    return out


def load_then_save(src: str, dst: str, flavour: str) -> dict:
    """Load ``src`` into ``flavour`` and save it to ``dst`` unchanged (a hop of FSDP1 -> FSDP2 -> FSDP1)."""
    model, optim = build(flavour, seed=5)
    state = {**unickpt.fsdp.state(model, optim), "step": 0}
    unickpt.load(src, state)
    unickpt.save(dst, state)
    return {"state": full_state(model, optim)}


def flat_shards_no_gather(path: str) -> dict:
    """FSDP1 flat save: count FSDP unshards (parameter all-gathers) and tensor all-gathers issued
    during the save (the engine's own planning exchanges small objects), and report each rank's
    leaf for one parameter."""
    import unittest.mock as mock

    from torch.distributed.fsdp._flat_param import FlatParamHandle

    model, optim = build("fsdp1")
    train(model, optim, 1, seed=3)
    calls = {"unshard": 0, "all_gather_into_tensor": 0}
    unshard, gather = FlatParamHandle.unshard, dist.all_gather_into_tensor

    def counted_unshard(self, *a, **k):
        calls["unshard"] += 1
        return unshard(self, *a, **k)

    def counted_gather(*a, **k):
        calls["all_gather_into_tensor"] += 1
        return gather(*a, **k)

    with mock.patch.object(FlatParamHandle, "unshard", counted_unshard), \
            mock.patch.object(dist, "all_gather_into_tensor", counted_gather):
        sd = unickpt.fsdp.model_state(model).state_dict()
        unickpt.save(path, unickpt.fsdp.state(model, optim))
        unsharded_in_save = calls["unshard"]
        full_state(model, optim)  # the check can fail: a full state dict does unshard
    leaf = sd["l1.weight"]
    return {"in_save": unsharded_in_save, "gathers": calls["all_gather_into_tensor"], "after_full": calls["unshard"],
            "spec": str(leaf.spec), "shape": list(leaf.global_shape),
            "tied_same_tensor": sd["head.weight"].tensor.data_ptr() == sd["emb.weight"].tensor.data_ptr()}


# --------------------------------------------------------------------------------------------- #
# torch.distributed.checkpoint interoperability
# --------------------------------------------------------------------------------------------- #
def _dcp_state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "extra": {"epoch": 3, "note": "dcp"}}


def _dcp_apply(model, optim, sd) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def dcp_save(path: str, flavour: str, how: str) -> dict:
    """Train, then save the DCP state dict with ``how``: "writer" (dcp.save + unickpt StorageWriter),
    "async" (dcp.async_save + StorageWriter; the model changes right after the call) or "dcp"
    (dcp.save with its own FileSystemWriter)."""
    import torch.distributed.checkpoint as dcp

    model, optim = build(flavour)
    train(model, optim, 2, seed=1)
    ref = full_state(model, optim)
    sd = _dcp_state(model, optim)
    if how == "writer":
        dcp.save(sd, storage_writer=unickpt.fsdp.StorageWriter(path))
    elif how == "async":
        # DCP's save thread runs collectives while training does: it needs a group of its own
        group = dist.new_group(backend="gloo")
        writer = unickpt.fsdp.StorageWriter(path, process_group=group)
        fut = dcp.async_save(sd, storage_writer=writer, process_group=group)
        train(model, optim, 1, seed=9)  # after staging: must not reach the checkpoint
        (getattr(fut, "upload_completion", None) or fut).result()
        writer.close()
    elif how == "dcp":
        dcp.save(sd, checkpoint_id=path)
    else:
        raise ValueError(how)
    return {"saved": ref}


def dcp_load(path: str, flavour: str, how: str, native: bool = False) -> dict:
    """Load into a fresh model with ``how``: "reader" (dcp.load + unickpt StorageReader),
    "reader_bf16" (the same into a bf16 copy of the model state dict: must refuse to cast), "reader_error"
    (the same, returning the error's last line), or
    "unickpt" / "unickpt_nopickle" (unickpt.load of the module / optimizer, with / without allow_pickle)."""
    import torch.distributed.checkpoint as dcp

    model, optim = build(flavour, seed=123)
    extra = None
    if how in ("reader_bf16", "reader_error"):
        sd = _dcp_state(model, optim)
        if how == "reader_bf16":
            sd["model"] = {k: v.to(torch.bfloat16) for k, v in sd["model"].items()}
        try:
            dcp.load(sd, storage_reader=unickpt.fsdp.StorageReader(path))
        except BaseException as e:  # DCP wraps every rank's exception into a CheckpointException
            return {"error": str(e).strip().splitlines()[-1]}
        return {"error": None}
    if how == "reader":
        sd = _dcp_state(model, optim)
        if native:  # a checkpoint of unickpt.fsdp.state(...) plus "step"
            del sd["extra"]
            sd["step"] = 0
        else:
            sd["extra"] = {"epoch": 0, "note": ""}
        dcp.load(sd, storage_reader=unickpt.fsdp.StorageReader(path))
        _dcp_apply(model, optim, sd)
        extra = sd["step"] if native else sd["extra"]
    elif how in ("unickpt", "unickpt_nopickle"):
        state = {**unickpt.fsdp.state(model, optim), "extra": {"epoch": 0, "note": ""}}
        try:
            unickpt.load(path, state, allow_pickle=how == "unickpt")
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        extra = state["extra"]
    else:
        raise ValueError(how)
    return {"loaded": full_state(model, optim), "extra": extra}


def dcp_empty_optim_state(root: str) -> list[dict]:
    """SGD without momentum keeps no state (``osd["state"] == {}``), which DCP's flattening drops:
    save it with dcp.save (DCP's own writer and unickpt's StorageWriter), then unickpt.load both into
    a fresh model whose optimizer has another lr."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, _ = build("fsdp2")
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.0)
    train(model, optim, 1, seed=1)
    ref = full_state(model, optim)
    msd, osd = get_state_dict(model, optim)
    assert osd["state"] == {}
    out = []
    for name, writer in (("dcp", None), ("unickpt_writer", unickpt.fsdp.StorageWriter(os.path.join(root, "unickpt_writer")))):
        path = os.path.join(root, name)
        dcp.save({"model": msd, "optim": osd, "step": 3}, checkpoint_id=path, storage_writer=writer)
        model2, _ = build("fsdp2", seed=123)
        optim2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.0)
        state = {"model": model2, "optim": optim2, "step": 0}
        try:
            unickpt.load(path, state, allow_pickle=name == "dcp")
        except Exception as e:
            out.append({"how": name, "error": f"{type(e).__name__}: {e}"})
            continue
        out.append({"how": name, "loaded": full_state(model2, optim2), "step": state["step"], "ref": ref})
    return out


def dcp_writer_rank_failure(path: str) -> dict:
    """dcp.save through StorageWriter where only rank 1 fails while preparing its items (a value that
    cannot be pickled): every rank must raise (none left waiting in the collective save), nothing
    committed."""
    import os

    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(4.0) + dist.get_rank(), "fn": (lambda: 1) if dist.get_rank() == 1 else 3}
    try:
        dcp.save(state, storage_writer=unickpt.fsdp.StorageWriter(path))
        error = None
    except BaseException as e:  # DCP wraps every rank's exception into a CheckpointException
        error = str(e).strip().splitlines()[-1]
    return {"error": error, "committed": os.path.exists(os.path.join(path, "metadata.json"))}
