"""Save / load benchmark: unickpt vs torch.save vs torch.distributed.checkpoint, on one state, in one run.

Run (it relaunches itself under torchrun with ``--world-size`` CPU ranks over gloo)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/save_load.py --world-size 4 --size-mb 256

or launch it yourself (then ``--world-size`` is ignored)::

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 4 benchmarks/save_load.py

State (identical for every method): a stack of ``nn.Linear(H, H)`` layers sharded with FSDP2
(``fully_shard`` per layer and on the root, on ``init_device_mesh("cpu", (W,))``), AdamW after one
real forward/backward/step (so ``exp_avg``/``exp_avg_sq``/``step`` exist), plus plain tensors that
are replicated on every rank (about 10 % of the state; written once by unickpt and DCP) and a
python value. ``--size-mb`` is the size of the *unique* global state (what one copy of the
checkpoint holds); the layer count is derived from it.

Save methods (each one writes every iteration into its own fresh directory):

* ``unickpt_sync``   ``unickpt.save(path, state)``: stall == total.
* ``unickpt_async``  ``unickpt.save(path, state, async_save=True)`` on its own process group (so
  its own engine and staging pools: its first save allocates them too); stall = time until the
  call returns, total = until ``handle.wait()`` returns (committed).
* ``torch_save``     each rank ``torch.save``\\ s its local state (DTensors as their local shards,
  replicated tensors included on every rank) to ``rank<r>.pt``, then ``fsync`` (so it is as
  durable as the others; see ``torch_save_nofsync`` for the page-cache-only number).
* ``torch_save_nofsync`` the same without ``fsync``: the data may be only in the page cache.
* ``dcp_sync``       ``dcp.save`` (FileSystemWriter defaults: ``sync_files=True``, one file per rank).
* ``dcp_async``      ``dcp.async_save`` with defaults (a new DefaultStager per call: every call
  allocates a fresh CPU copy of the state); on its own gloo group; stall = until it returns,
  total = until the returned future (``upload_completion``) resolves.
* ``dcp_async_stager`` the same with one ``DefaultStager`` reused across calls (its CPU copies are
  cached per storage, like unickpt's reused pool): DCP's best steady-state setting on CPU.

For DCP the model and optimizer are wrapped in a ``Stateful`` (the pattern in the DCP tutorial), so
``get_state_dict`` runs inside the timed call for DCP as it does for unickpt (which expands
modules / optimizers with the same helpers) and for torch.save (done explicitly, timed).

Timing: every sample starts after a barrier; each rank times itself; a sample is the *slowest
rank's* time (a collective save is done when its last rank is). Iteration 0 of every method is the
warm-up ("first": unickpt allocates and pre-faults its staging pool then, DCP creates its thread
pool, the allocator warms up) and is reported separately; ``--repeats`` further iterations give the
median ("steady"). Methods run round-robin (iteration i of every method, then i+1), so slow drift
of a shared machine is spread over all of them. Throughput = unique state bytes / total time.

Loads (same world size): ``unickpt.load`` and ``dcp.load`` of the last checkpoint each wrote, into
the live FSDP model/optimizer, warm (files in the page cache, as just written) and cold (each file's
clean pages dropped with ``posix_fadvise(DONTNEED)`` first; a VM's host may still cache them). The
first load of each is a verified one: every tensor in the state is zeroed first and compared
bit-for-bit to a snapshot after the load.

Results: JSON (``--out``, default ``benchmarks/results/save_load.json``) and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "save_load.json")

SAVE_METHODS = ["unickpt_sync", "unickpt_async", "torch_save", "torch_save_nofsync",
                "dcp_sync", "dcp_async", "dcp_async_stager"]
LOAD_METHODS = ["unickpt", "dcp"]
ASYNC_METHODS = {"unickpt_async", "dcp_async", "dcp_async_stager"}
REPLICATED_FRACTION = 0.10  # of --size-mb: plain tensors held whole by every rank


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=4, help="ranks (CPU processes, gloo) when self-launching")
    p.add_argument("--size-mb", type=float, default=256.0,
                   help="unique global state size in MB (1e6 B): params + AdamW state + replicated tensors")
    p.add_argument("--hidden", type=int, default=1024, help="width H of the Linear(H, H) layers")
    p.add_argument("--repeats", type=int, default=5, help="measured iterations per method after the warm-up one")
    p.add_argument("--load-repeats", type=int, default=None,
                   help="measured loads per method and cache state (None: --repeats)")
    p.add_argument("--methods", default=",".join(SAVE_METHODS), help="comma-separated save methods to run")
    p.add_argument("--no-load", action="store_true", help="skip the load benchmark")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the process-wide warm-up (a tiny save with every method before timing)")
    p.add_argument("--profile", default="", help="comma-separated save methods to cProfile on rank 0 (the "
                   "calling thread only: the stall) at iteration 0 and the last iteration; top entries go "
                   "into the JSON")
    p.add_argument("--dir", default=None, help="where checkpoints go (a fresh temporary directory under it; "
                   "default: the system temp dir). Put it on the file system you care about")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: deleted at the end)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results path")
    p.add_argument("--timeout", type=float, default=1200.0, help="self-launch: kill the run after this many seconds")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.profile = [m.strip() for m in args.profile.split(",") if m.strip()]
    unknown = sorted(set(args.methods + args.profile) - set(SAVE_METHODS))
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {SAVE_METHODS}")
    if args.load_repeats is None:
        args.load_repeats = args.repeats
    return args


# --------------------------------------------------------------------------------------------- #
# Launcher (no torchrun environment): start torchrun with this script, kill it all on timeout/^C
# --------------------------------------------------------------------------------------------- #
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), os.path.abspath(__file__), *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    print("$ " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=args.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: their own session
        proc.wait()
        print(f"benchmark {'timed out' if isinstance(e, subprocess.TimeoutExpired) else 'interrupted'}; "
              "killed", file=sys.stderr)
        return 124


# --------------------------------------------------------------------------------------------- #
# Worker side
# --------------------------------------------------------------------------------------------- #
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _tensors(obj: Any, out: list, path: str = "") -> list:
    """(path, local tensor) for every tensor in a nested dict/list (DTensors as their local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        out.append((path, obj.to_local()))
    elif isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, out, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(v, out, f"{path}.{i}")
    return out


def _to_local(obj: Any) -> Any:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_local(v) for v in obj)
    return obj


def _files_under(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def _du(path: str) -> int:
    return sum(os.path.getsize(f) for f in _files_under(path))


def _evict(path: str) -> None:
    """Drop the (clean) page-cache pages of every file under ``path``; needs no privileges."""
    for f in _files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Bench:
    """Everything one rank needs: the state, the process groups, the methods."""

    def __init__(self, args: argparse.Namespace, root: str):
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch import nn
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.stateful import Stateful
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.args, self.root = args, root
        self.torch, self.dist, self.dcp = torch, dist, dcp
        self.rank, self.ws = dist.get_rank(), dist.get_world_size()
        self.get_state_dict = get_state_dict

        # ---- the state ------------------------------------------------------------------------
        size = args.size_mb * 1e6
        h = args.hidden
        layer_bytes = (h * h + h) * 4  # fp32 weight + bias
        self.layers = max(1, round(size * (1 - REPLICATED_FRACTION) / 3 / layer_bytes))  # params + 2 Adam moments
        torch.manual_seed(0)  # same init on every rank (fully_shard keeps each rank's slice)
        model = nn.Sequential(*[nn.Linear(h, h) for _ in range(self.layers)])
        mesh = init_device_mesh("cpu", (self.ws,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.manual_seed(1 + self.rank)  # data differs per rank, as in data parallel training
        loss = model(torch.randn(8, h)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        self.model, self.optim = model, optim
        # replicated plain tensors (same values on every rank), e.g. a frozen table, buffers
        rep_elems = int(size * REPLICATED_FRACTION / 4)
        g = torch.Generator().manual_seed(1234)
        rows = rep_elems * 3 // 4 // 64
        self.extra = {"frozen_table": torch.randn(rows, 64, generator=g),
                      "buffer": torch.randn(rep_elems - rows * 64, generator=g)}

        class AppState(Stateful):  # the DCP tutorial's wrapper: get/set_state_dict inside the call
            def __init__(self, m, o):
                self.m, self.o = m, o

            def state_dict(self):
                msd, osd = get_state_dict(self.m, self.o)
                return {"model": msd, "optim": osd}

            def load_state_dict(self, sd):
                set_state_dict(self.m, self.o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        self.unickpt_state = {"model": model, "optim": optim, "extra": self.extra, "step": 1}
        self.dcp_state = {"app": AppState(model, optim), "extra": self.extra, "step": 1}

        # sizes: unique global bytes (dedup replicas as unickpt/DCP do) and what this rank holds
        msd, osd = get_state_dict(model, optim)
        full = {"model": msd, "optim": osd, "extra": self.extra}
        local = _tensors(full, [])
        self.local_bytes = sum(t.numel() * t.element_size() for _, t in local)
        rep_local = sum(t.numel() * t.element_size() for p, t in local
                        if p.startswith("extra.") or p.endswith(".step"))
        locals_ = [None] * self.ws
        dist.all_gather_object(locals_, (self.local_bytes, rep_local))
        self.local_bytes_by_rank = [a for a, _ in locals_]
        self.state_bytes = sum(a - r for a, r in locals_) + locals_[0][1]
        self.replicated_bytes = locals_[0][1]
        self.param_bytes = sum(self.gather(sum(t.numel() * t.element_size() for _, t in _tensors(msd, []))))
        self.n_tensors = len(local)

        # ---- process groups: async methods get their own (own unickpt engine / DCP bg collectives)
        self.pg_unickpt_async = dist.new_group(backend="gloo")
        self.pg_dcp_async = dist.new_group(backend="gloo")
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.warmup_stager = DefaultStager(StagingOptions(False, False, False, False))  # keeps self.stager cold
        self.counter = 0
        self.last_dir: dict[str, str] = {}

    # ---- helpers ----------------------------------------------------------------------------------
    def fresh_dir(self, method: str, it: int) -> str:
        return os.path.join(self.root, f"{method}_{it}")

    def gather(self, x: Any) -> list:
        out = [None] * self.ws
        self.dist.all_gather_object(out, x)
        return out

    def rm(self, path: str) -> None:
        """Collective: rank 0 deletes ``path`` once every rank is done with it."""
        self.dist.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.dist.barrier()

    # ---- save methods: each returns (wait callable, extra info); the call itself is the stall ------
    def start_save(self, method: str, path: str) -> tuple[Callable[[], None], Callable[[], dict]]:
        import unickpt

        torch, dcp = self.torch, self.dcp
        nothing = lambda: None  # noqa: E731
        if method in ("unickpt_sync", "unickpt_async"):
            asyn = method == "unickpt_async"
            h = unickpt.save(path, self.unickpt_state, async_save=asyn,
                             process_group=self.pg_unickpt_async if asyn else None)
            return h.wait, h.stats.as_dict
        if method in ("torch_save", "torch_save_nofsync"):
            os.makedirs(path, exist_ok=True)
            msd, osd = self.get_state_dict(self.model, self.optim)
            obj = _to_local({"model": msd, "optim": osd, "extra": self.extra, "step": 1})
            with open(os.path.join(path, f"rank{self.rank}.pt"), "wb") as f:
                torch.save(obj, f)
                if method == "torch_save":
                    f.flush()
                    os.fsync(f.fileno())
            if method == "torch_save":  # make this rank's new directory entry durable too
                dfd = os.open(path, os.O_RDONLY)
                os.fsync(dfd)
                os.close(dfd)
            return nothing, dict
        if method == "dcp_sync":
            dcp.save(self.dcp_state, checkpoint_id=path)
            return nothing, dict
        if method in ("dcp_async", "dcp_async_stager"):
            kw = {"async_stager": self.stager} if method == "dcp_async_stager" else {}
            fut = dcp.async_save(self.dcp_state, checkpoint_id=path, process_group=self.pg_dcp_async, **kw)
            fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (newer torch) or Future
            return fut.result, dict
        raise ValueError(method)

    def save_once(self, method: str, it: int, profile: bool = False) -> dict:
        path = self.fresh_dir(method, it)
        prof = None
        if profile and self.rank == 0:
            import cProfile

            prof = cProfile.Profile()
        self.dist.barrier()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        wait, info = self.start_save(method, path)
        if prof is not None:
            prof.disable()
        t1 = time.perf_counter()
        wait()
        t2 = time.perf_counter()
        per_rank = self.gather({"stall": t1 - t0, "total": t2 - t0, "info": info()})
        self.dist.barrier()
        bytes_on_disk = _du(path) if self.rank == 0 else 0
        files = ({os.path.relpath(f, path): os.path.getsize(f) for f in _files_under(path)}
                 if self.rank == 0 else {})
        old = self.last_dir.get(method)
        self.last_dir[method] = path
        if old is not None:  # keep only the newest checkpoint of each method (the load benchmark's)
            self.rm(old)
        stall = max(r["stall"] for r in per_rank)
        total = max(r["total"] for r in per_rank)
        sample = {"stall_s": stall, "total_s": total, "bytes_on_disk": bytes_on_disk,
                  "files_over_1mb": {f: n for f, n in sorted(files.items()) if n >= 1_000_000},
                  "stall_by_rank_ms": [round(r["stall"] * 1e3, 1) for r in per_rank],
                  "total_by_rank_ms": [round(r["total"] * 1e3, 1) for r in per_rank]}
        if per_rank[0]["info"]:  # unickpt's own per-phase stats
            keys = ("plan_s", "pool_wait_s", "stage_s", "write_s", "commit_s", "stall_s", "total_s")
            infos = [r["info"] for r in per_rank]
            sample["phases_max_s"] = {k: max(i[k] for i in infos) for k in keys}
            # the last rank to finish writing (stall + write: its drain starts when its call stages):
            # its commit_s is the real commit; the others' include waiting for it in the all_gather
            last = max(infos, key=lambda i: i["stall_s"] + i["write_s"])
            sample["phases_last_writer_s"] = {k: last[k] for k in keys}
            sample["bytes_written_by_rank"] = [i["bytes_written"] for i in infos]
        if prof is not None:
            import io
            import pstats

            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
            sample["profile_rank0_caller_thread"] = buf.getvalue().strip().splitlines()
        return sample

    def warmup(self) -> None:
        """One tiny save with every method (and a load with each library), untimed: imports, gloo
        connections of every group, unickpt's engines, DCP's code paths. Leaves unickpt's staging pools
        tiny, so the first timed save still has to allocate them."""
        import torch
        import unickpt

        tiny = {"w": torch.zeros(16), "step": 0}
        d = os.path.join(self.root, "warmup")
        for m in self.args.methods:
            p = os.path.join(d, m)
            if m.startswith("unickpt"):
                unickpt.save(p, tiny, async_save=m == "unickpt_async",
                             process_group=self.pg_unickpt_async if m == "unickpt_async" else None).wait()
                unickpt.load(p, tiny)
            elif m.startswith("torch_save"):
                os.makedirs(p, exist_ok=True)
                torch.save(tiny, os.path.join(p, f"rank{self.rank}.pt"))
            elif m == "dcp_sync":
                self.dcp.save(tiny, checkpoint_id=p)
                self.dcp.load(tiny, checkpoint_id=p)
            else:
                kw = {"async_stager": self.warmup_stager} if m == "dcp_async_stager" else {}
                fut = self.dcp.async_save(tiny, checkpoint_id=p, process_group=self.pg_dcp_async, **kw)
                getattr(fut, "upload_completion", fut).result()
        self.rm(d)

    # ---- loads --------------------------------------------------------------------------------------
    def zero_state(self) -> None:
        torch = self.torch
        msd, osd = self.get_state_dict(self.model, self.optim)
        with torch.no_grad():
            for _, t in _tensors({"model": msd, "optim": osd, "extra": self.extra}, []):
                t.zero_()
        self.unickpt_state["step"] = self.dcp_state["step"] = -1

    def snapshot(self) -> dict:
        msd, osd = self.get_state_dict(self.model, self.optim)
        return {p: t.clone() for p, t in _tensors({"model": msd, "optim": osd, "extra": self.extra}, [])}

    def matches(self, ref: dict, state: dict) -> bool:
        now = self.snapshot()
        return (now.keys() == ref.keys() and all(self.torch.equal(now[k], ref[k]) for k in ref)
                and state["step"] == 1)

    def load_once(self, method: str, path: str, cold: bool) -> dict:
        import unickpt

        if cold:
            self.dist.barrier()
            if self.rank == 0:
                _evict(path)
        self.dist.barrier()
        t0 = time.perf_counter()
        bytes_read = None
        if method == "unickpt":
            bytes_read = unickpt.load(path, self.unickpt_state).bytes_read
        else:
            self.dcp.load(self.dcp_state, checkpoint_id=path)
        t1 = time.perf_counter()
        per_rank = self.gather((t1 - t0, bytes_read))
        return {"total_s": max(t for t, _ in per_rank),
                "bytes_read": None if bytes_read is None else sum(b for _, b in per_rank)}


def summarize(samples: list[dict], state_bytes: int) -> dict:
    """{"first": ..., "steady": medians over the rest} in ms and GB/s."""
    def row(ss: list[dict]) -> dict | None:
        if not ss:
            return None
        stall = _median([s["stall_s"] for s in ss]) if "stall_s" in ss[0] else None
        total = _median([s["total_s"] for s in ss])
        out = {"n": len(ss), "total_ms": round(total * 1e3, 1),
               "total_min_ms": round(min(s["total_s"] for s in ss) * 1e3, 1),
               "total_max_ms": round(max(s["total_s"] for s in ss) * 1e3, 1),
               "throughput_gbps": round(state_bytes / total / 1e9, 3)}
        if stall is not None:
            out = {"n": len(ss), "stall_ms": round(stall * 1e3, 1),
                   "stall_min_ms": round(min(s["stall_s"] for s in ss) * 1e3, 1),
                   "stall_max_ms": round(max(s["stall_s"] for s in ss) * 1e3, 1), **{k: v for k, v in out.items()
                                                                                     if k != "n"}}
        for key in ("phases_max_s", "phases_last_writer_s"):
            if key in ss[0]:
                out["unickpt_" + key[:-2] + "_ms"] = {k: round(_median([s[key][k] for s in ss]) * 1e3, 1)
                                                    for k in ss[0][key]}
        return out

    return {"first": row(samples[:1]), "steady": row(samples[1:])}


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import unickpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    if rank == 0:
        base = args.dir or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        root = tempfile.mkdtemp(prefix="unickpt-bench-", dir=base)
    else:
        root = None
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[bench {time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    try:
        b = Bench(args, root)
        log(f"world {b.ws}, {b.layers} x Linear({args.hidden},{args.hidden}) FSDP2 + AdamW + replicated: "
            f"unique state {b.state_bytes / 1e6:.1f} MB, per rank "
            f"{[round(x / 1e6, 1) for x in b.local_bytes_by_rank]} MB -> checkpoints under {root}")
        if not args.no_warmup:
            b.warmup()
            log("warm-up done (a tiny save with every method)")
        samples: dict[str, list[dict]] = {m: [] for m in args.methods}
        for it in range(1 + args.repeats):
            for m in args.methods:
                s = b.save_once(m, it, profile=m in args.profile and it == 0)
                samples[m].append(s)
                log(f"save {m:<18} it {it}: stall {s['stall_s'] * 1e3:8.1f} ms  total {s['total_s'] * 1e3:8.1f} ms")
        profiles: dict[str, dict] = {}
        for m in args.profile:  # steady-state profile: one extra iteration, not in the statistics
            extra_it = b.save_once(m, 1 + args.repeats, profile=True)
            profiles[m] = {"iteration_0": samples[m][0].pop("profile_rank0_caller_thread", None),
                           "extra_steady_iteration": extra_it.get("profile_rank0_caller_thread"),
                           "extra_steady_stall_ms": round(extra_it["stall_s"] * 1e3, 1)}

        loads: dict[str, dict] = {}
        if not args.no_load:
            sources = {"unickpt": b.last_dir.get("unickpt_sync") or b.last_dir.get("unickpt_async"),
                       "dcp": b.last_dir.get("dcp_sync") or b.last_dir.get("dcp_async")}
            ref = b.snapshot()
            for m in LOAD_METHODS:
                path = sources[m]
                if path is None:
                    continue
                # verified warm-up load: zero everything, load, compare bit for bit
                b.zero_state()
                zeroed = all(float(t.abs().sum()) == 0 for t in b.snapshot().values())
                first = b.load_once(m, path, cold=False)
                ok = b.matches(ref, b.unickpt_state if m == "unickpt" else b.dcp_state)
                ok_all = all(b.gather(ok and zeroed))
                log(f"load {m:<8} first (verified={ok_all}): {first['total_s'] * 1e3:8.1f} ms")
                warm = [b.load_once(m, path, cold=False) for _ in range(args.load_repeats)]
                cold = [b.load_once(m, path, cold=True) for _ in range(args.load_repeats)]
                for kind, ss in (("warm", warm), ("cold", cold)):
                    log(f"load {m:<8} {kind}: median {_median([s['total_s'] for s in ss]) * 1e3:8.1f} ms")
                loads[m] = {"source": os.path.basename(path), "verified_bitwise": ok_all,
                            "bytes_read_all_ranks": first["bytes_read"],
                            "first": summarize([first], b.state_bytes)["first"],
                            "warm": summarize([first] + warm, b.state_bytes)["steady"],
                            "cold": summarize([first] + cold, b.state_bytes)["steady"]}
            last = b.unickpt_state if m == "unickpt" else b.dcp_state
            if not all(b.gather(b.matches(ref, last))):
                log("WARNING: state differs from the saved one after the load benchmark")
        b.stager.close()
        b.warmup_stager.close()
        wall = time.perf_counter() - t_start

        if rank == 0:
            result = {
                "benchmark": "save_load",
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {
                    "cpu_count": os.cpu_count(),
                    "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                    "loadavg_at_start": [round(x, 2) for x in load0],
                    "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
                    "mem_total_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "unickpt": unickpt.__version__,
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "checkpoint_dir": root,
                },
                "config": {"world_size": b.ws, "size_mb": args.size_mb, "hidden": args.hidden,
                           "layers": b.layers, "repeats": args.repeats, "load_repeats": args.load_repeats,
                           "methods": args.methods, "backend": "gloo (CPU)"},
                "state": {"unique_bytes": b.state_bytes, "param_bytes": b.param_bytes,
                          "replicated_bytes": b.replicated_bytes, "local_bytes_by_rank": b.local_bytes_by_rank,
                          "tensors_per_rank": b.n_tensors},
                "notes": [
                    "Times in ms; a sample is the slowest rank's time, measured from a barrier; "
                    "'first' = iteration 0 (warm-up), 'steady' = median of the next `repeats` iterations.",
                    "throughput_gbps = state.unique_bytes / total time (1 GB = 1e9 B), for every method, even "
                    "those that write more bytes (bytes_on_disk).",
                    "Durability: unickpt fsyncs its data files and commits metadata.json atomically (fsync + "
                    "rename + dir fsync); DCP's FileSystemWriter fsyncs (sync_files=True, the default); "
                    "'torch_save' = torch.save + fsync of each file (+ dir fsync) for a fair comparison; "
                    "'torch_save_nofsync' = plain torch.save, whose data may still be only in the page cache "
                    "when it returns.",
                    "torch.save writes every rank's replicated tensors (no dedup), so it writes more bytes; "
                    "unickpt and DCP write each replicated tensor once.",
                    "Before timing, a process-wide warm-up saves a tiny state with every method (imports, "
                    "gloo connections, unickpt engines, DCP code paths); unickpt's staging pools stay tiny, so "
                    "its first timed save still allocates and pre-faults them ('first'). unickpt_* phases: "
                    "'_max' = max over ranks per phase; '_last_writer' = the rank that finished writing last "
                    "(largest stall + write; the other ranks' commit_s includes waiting for it in the commit "
                    "all_gather).",
                    "--profile METHOD: cProfile of rank 0's calling thread (what the stall is made of) at "
                    "iteration 0 (counted in 'first', with the profiler's small overhead) and in one extra "
                    "steady iteration that is not counted. Background writer threads are not profiled.",
                    "Each iteration writes into a new directory; the previous one of the same method is "
                    "deleted afterwards (only the newest is kept for the loads).",
                    "stall = time the save call blocked the caller (for sync methods = total); total = until "
                    "committed (unickpt: handle.wait(); DCP async: upload future resolved).",
                    "dcp_async: dcp.async_save defaults (a new DefaultStager per call -> fresh CPU copy of the "
                    "whole local state, replicas included, every call); dcp_async_stager reuses one "
                    "DefaultStager (cached CPU copies).",
                    "Loads: 'warm' = files in the page cache (just written); 'cold' = pages dropped with "
                    "posix_fadvise(DONTNEED) before each load (a VM host cache may remain). The first load "
                    "of each method is verified bit-for-bit after zeroing the state.",
                    f"{b.ws} ranks share {os.cpu_count()} CPU cores (OMP_NUM_THREADS=1); background writer "
                    "threads compete with the ranks for CPU, and other users of the machine add noise "
                    "(see loadavg).",
                ],
                "save": {m: {**summarize(ss, b.state_bytes), "bytes_on_disk": ss[-1]["bytes_on_disk"],
                             "files_over_1mb": ss[-1]["files_over_1mb"],
                             **({"bytes_written_by_rank": ss[-1]["bytes_written_by_rank"]}
                                if "bytes_written_by_rank" in ss[-1] else {}),
                             "samples": [{k: (round(v * 1e3, 1) if k.endswith("_s") else v)
                                          for k, v in s.items() if not k.startswith(("phases", "bytes_written",
                                                                                     "profile", "files"))}
                                         for s in ss],
                             **({"profile_rank0_caller_thread": profiles[m]} if m in profiles else {})}
                         for m, ss in samples.items()},
                "load": loads,
                "wall_s": round(wall, 1),
            }
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
            print_table(result)
            print(f"\nwrote {args.out}", flush=True)
    finally:
        dist.barrier()
        if rank == 0 and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


def print_table(r: dict) -> None:
    st = r["state"]
    print(f"\n== save/load: world {r['config']['world_size']}, unique state {st['unique_bytes'] / 1e6:.1f} MB "
          f"({st['replicated_bytes'] / 1e6:.1f} MB replicated on every rank), torch {r['machine']['torch']}, "
          f"{r['machine']['cpu_count']} CPUs, loadavg {r['machine']['loadavg_at_start'][0]}"
          f"->{r['machine']['loadavg_at_end'][0]}")
    fmt = "{:<20}{:>11}{:>11}{:>11}{:>11}{:>9}{:>10}"
    print(fmt.format("save", "stall 1st", "stall med", "total 1st", "total med", "GB/s", "disk MB"))
    for m, s in r["save"].items():
        f, d = s["first"], s["steady"] or s["first"]
        print(fmt.format(m, f"{f['stall_ms']:.0f}", f"{d['stall_ms']:.0f}", f"{f['total_ms']:.0f}",
                         f"{d['total_ms']:.0f}", f"{d['throughput_gbps']:.2f}", f"{s['bytes_on_disk'] / 1e6:.0f}"))
    if r["load"]:
        fmt = "{:<20}{:>11}{:>11}{:>11}{:>9}{:>10}"
        print(fmt.format("load", "first", "warm med", "cold med", "GB/s*", "verified"))
        for m, s in r["load"].items():
            print(fmt.format(m, f"{s['first']['total_ms']:.0f}", f"{s['warm']['total_ms']:.0f}",
                             f"{s['cold']['total_ms']:.0f}", f"{s['cold']['throughput_gbps']:.2f}",
                             str(s["verified_bitwise"])))
        print("(ms; medians of steady iterations; GB/s* = unique state / cold median; sync stall = total;"
              " all writes fsynced except torch_save_nofsync)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:  # not under torchrun: launch ourselves
        return launch(args, argv)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
