"""Live weight sync (``unickpt.sync``): a training job's weights to an inference job, against the common
baseline, and the delta mode.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/weight_sync.py --out benchmarks/results/weight_sync.json [--gb 1.0]

The weights: a Llama-shaped bf16 model (hidden 2048, intermediate 5632, vocab 32000, 7 layers: 0.98 GB at
``--gb 1``; fewer layers for less). The training job (T = 4 or 2 processes, its own gloo world) holds each
tensor row-sharded over its ranks (FSDP2's ``Shard(0)``, as ``unickpt.Shard`` boxes); the inference job
(2 processes, its own gloo world) holds a tensor-parallel model: DTensor parameters, ``q/k/v/gate/up``
and the embedding and head ``Shard(0)``, ``o/down`` ``Shard(1)``, norms replicated. Two separately
launched jobs, joined only by the rendezvous address.

Per configuration (T -> 2), one run with ``delta=False`` and one with ``delta=True``:

- ``first``: the first sync (the subscriber joins, layouts are exchanged, the plan is made; then a full
  version). ``plan_seconds`` of it are reported apart;
- ``full`` (delta=False run): 3 versions, every value changed; ``delta`` (delta=True run): 3 versions
  with 2 % of the values changed (random positions, +1.0);
- ``baseline``, in the same run, on the same processes: what verl's and OpenRLHF's stock paths do,
  tensor by tensor: gather the full tensor on training rank 0 (``dist.gather`` on the training job's
  group), broadcast it to the inference ranks (a gloo group of training rank 0 and the inference ranks),
  each of which copies its tensor-parallel slice into its parameter.

Each timed round starts with a barrier of all processes of both jobs (a gloo group over them, used
only for that) and ends when every process is done (receivers: the version applied to the parameters);
the round's time is the slowest process's. After the last round the baseline's result is compared,
bitwise, with the sync's (``matches_baseline``). ``bytes``: payload bytes the training ranks sent per
version (sum). ``speedup_full``: baseline median / full-sync median; ``speedup_delta``: full median /
delta median; ``delta_bytes_fraction``: delta bytes / full bytes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "sync"))

HIDDEN, INTER, VOCAB = 2048, 5632, 32000
S = 2  # inference ranks
ROUNDS = 3


def shapes(layers: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """``(name, shape, tensor-parallel dim or None)`` of the model."""
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (HIDDEN,), None),
                (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), 0), (p + "self_attn.k_proj.weight", (HIDDEN, HIDDEN), 0),
                (p + "self_attn.v_proj.weight", (HIDDEN, HIDDEN), 0), (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), 1),
                (p + "post_attention_layernorm.weight", (HIDDEN,), None),
                (p + "mlp.gate_proj.weight", (INTER, HIDDEN), 0), (p + "mlp.up_proj.weight", (INTER, HIDDEN), 0),
                (p + "mlp.down_proj.weight", (HIDDEN, INTER), 1)]
    return out + [("model.norm.weight", (HIDDEN,), None), ("lm_head.weight", (VOCAB, HIDDEN), 0)]


def _slice(t: torch.Tensor, dim: int | None, k: int, n: int) -> torch.Tensor:
    if dim is None:
        return t
    step = t.shape[dim] // n
    return t.narrow(dim, k * step, step)


def _everyone(store, rank: int, size: int):
    """A gloo group of every process of both jobs, for the rounds' barriers and times only."""
    return dist.ProcessGroupGloo(dist.PrefixStore("bench/all/", store), rank, size, datetime.timedelta(seconds=600))


def _barrier(pg) -> float:
    pg.allreduce([torch.zeros(1)]).wait()
    return time.perf_counter()


def _round_time(pg, start: float) -> float:
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    pg.allreduce([t], dist.ReduceOp.MAX).wait()
    return float(t.item())


def trainer(rank: int, world: int, addr: str, layers: int, delta: bool) -> dict:
    from unickpt import Shard
    from unickpt.sync import Publisher

    g = torch.Generator().manual_seed(1000 + rank)
    local = {}
    for name, shape, _ in shapes(layers):
        rows = shape[0] // world
        local[name] = Shard(torch.randn((rows,) + shape[1:], generator=g).bfloat16(), shape, offsets=(rank * rows,) + (0,) * (len(shape) - 1))
    pub = Publisher(local, addr, delta=delta)
    while True:  # version 0, until the inference job has joined (a publish with none sends nothing)
        first = pub.publish(0)
        if first.subscribers:
            break
        time.sleep(0.2)
    store = pub.store
    allpg = _everyone(store, rank, world + S)
    bcast = dist.ProcessGroupGloo(dist.PrefixStore("bench/bcast/", store), 0, 1 + S, datetime.timedelta(seconds=600)) if rank == 0 else None
    out = {"first": vars(first).copy(), "sync": [], "baseline": []}

    def mutate(frac: float):
        for sh in local.values():
            flat = sh.tensor.view(-1)
            if frac >= 1.0:
                flat.add_(1.0)
            else:
                idx = torch.randint(0, flat.numel(), (int(flat.numel() * frac),), generator=g)
                flat[idx] += 1.0

    frac = 0.02 if delta else 1.0
    for v in range(1, ROUNDS + 2):
        mutate(frac if v > 1 else 1.0)
        start = _barrier(allpg)
        rep = pub.publish(v)
        out["sync"].append({"seconds": _round_time(allpg, start), "bytes": rep.bytes_sent, "full_bytes": rep.full_bytes,
                            "plan_seconds": rep.plan_seconds, "pack_seconds": rep.pack_seconds,
                            "history_bytes": rep.history_bytes, "delta_pairs": rep.delta_pairs})
    for _ in range(ROUNDS):  # the baseline: the same last version, tensor by tensor
        start = _barrier(allpg)
        sent = 0
        for name, shape, _ in shapes(layers):
            sh = local[name]
            if rank == 0:
                parts = [torch.empty_like(sh.tensor) for _ in range(world)]
                dist.gather(sh.tensor, parts, dst=0)
                full = torch.cat(parts)
                bcast.broadcast([full], dist.BroadcastOptions()).wait()
                sent += full.numel() * full.element_size() * S
            else:
                dist.gather(sh.tensor, dst=0)
                sent += sh.tensor.numel() * sh.tensor.element_size()
        out["baseline"].append({"seconds": _round_time(allpg, start), "bytes": sent})
    _barrier(allpg)
    pub.close()
    return out


def subscriber(rank: int, world: int, addr: str, layers: int, delta: bool) -> dict:
    import xxhash
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from unickpt.sync import Subscriber

    mesh = init_device_mesh("cpu", (world,))
    params = {}
    for name, shape, dim in shapes(layers):
        local = torch.zeros(_slice(torch.empty(shape, device="meta"), dim, rank, world).shape, dtype=torch.bfloat16)
        placement = Replicate() if dim is None else Shard(dim)
        params[name] = torch.nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape),
                                                             stride=torch.empty(shape, device="meta").stride()), requires_grad=False)
    sub = Subscriber(params, addr)
    first = sub.update(timeout_s=600)  # version 0 (its first version: join + plan + full)
    store, pubs = sub.store, sub.publishers
    allpg = _everyone(store, pubs + rank, pubs + world)
    bcast = dist.ProcessGroupGloo(dist.PrefixStore("bench/bcast/", store), 1 + rank, 1 + S, datetime.timedelta(seconds=600))
    out = {"first": vars(first).copy(), "sync": [], "baseline": []}
    for _ in range(ROUNDS + 1):
        start = _barrier(allpg)
        rep = sub.update(timeout_s=600)
        out["sync"].append({"seconds": _round_time(allpg, start), "bytes": rep.bytes_received, "verified": rep.verified})

    def digest() -> str:
        h = xxhash.xxh3_64()
        for name, _, _ in shapes(layers):
            h.update(params[name].to_local().view(torch.uint8).numpy().data)
        return h.hexdigest()

    synced = digest()
    for _ in range(ROUNDS):
        start = _barrier(allpg)
        for name, shape, dim in shapes(layers):
            full = torch.empty(shape, dtype=torch.bfloat16)
            bcast.broadcast([full], dist.BroadcastOptions()).wait()
            params[name].to_local().copy_(_slice(full, dim, rank, world))
        out["baseline"].append({"seconds": _round_time(allpg, start)})
    out["matches_baseline"] = digest() == synced
    _barrier(allpg)
    sub.close()
    return out


def main() -> None:
    from sync_jobs import free_port, run_jobs

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--trainers", default="4,2")
    a = ap.parse_args()
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN
    layers = max(1, round((a.gb * 1e9 / 2 - 2 * VOCAB * HIDDEN) / per_layer))
    nbytes = 2 * sum(torch.Size(s).numel() for _, s, _ in shapes(layers))
    results = {"weights_gb": nbytes / 1e9, "layers": layers, "dtype": "bfloat16", "inference_ranks": S,
               "machine": f"{os.cpu_count()} CPU cores, gloo", "configs": {}}
    for t in (int(x) for x in a.trainers.split(",")):
        cfg = {}
        for delta in (False, True):
            addr = f"127.0.0.1:{free_port()}"
            res = run_jobs({"train": (trainer, t, (addr, layers, delta)), "infer": (subscriber, S, (addr, layers, delta))},
                           timeout=1800)
            tr, inf = res["train"], res["infer"]
            rounds = [r["seconds"] for r in tr[0]["sync"][1:]]
            base = [r["seconds"] for r in tr[0]["baseline"]]
            key = "delta" if delta else "full"
            cfg[key] = {
                "first_sync_s_trainer": max(r["first"]["seconds"] for r in tr),
                "first_plan_s_trainer": max(r["first"]["plan_seconds"] for r in tr),
                "first_sync_s_subscriber": max(r["first"]["seconds"] for r in inf),
                "second_sync_s": tr[0]["sync"][0]["seconds"],
                "plan_s_later": max(x["plan_seconds"] for r in tr for x in r["sync"]),
                "subscriber_first_plan_s": max(r["first"]["plan_seconds"] for r in inf),
                "rounds_s": rounds, "median_s": statistics.median(rounds),
                "bytes_per_version": [sum(r["sync"][i]["bytes"] for r in tr) for i in range(1, ROUNDS + 1)],
                "full_bytes": sum(r["sync"][1]["full_bytes"] for r in tr),
                "pack_s": max(r["sync"][-1]["pack_seconds"] for r in tr),
                "pack_s_per_version": [max(r["sync"][i]["pack_seconds"] for r in tr) for i in range(ROUNDS + 1)],
                "history_bytes_per_trainer_rank": [r["sync"][-1]["history_bytes"] for r in tr],
                "baseline_rounds_s": base, "baseline_median_s": statistics.median(base),
                "baseline_bytes_per_version": sum(r["baseline"][0]["bytes"] for r in tr),
                "matches_baseline": all(r["matches_baseline"] for r in inf),
            }
            print(json.dumps({f"{t}->{S}": {key: cfg[key]}}), flush=True)
        cfg["speedup_full"] = cfg["full"]["baseline_median_s"] / cfg["full"]["median_s"]
        cfg["speedup_delta"] = cfg["full"]["median_s"] / cfg["delta"]["median_s"]
        cfg["delta_bytes_fraction"] = max(cfg["delta"]["bytes_per_version"]) / cfg["delta"]["full_bytes"]
        results["configs"][f"{t}->{S}"] = cfg
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps({k: {m: v[m] for m in ("speedup_full", "speedup_delta", "delta_bytes_fraction")}
                      for k, v in results["configs"].items()}, indent=2))


if __name__ == "__main__":
    main()
