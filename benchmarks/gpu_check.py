"""GPU check of unickpt's CUDA path (issue #23): pinned staging, D2H overlap, stall at GPU scale.

Run on a device machine with ``bash benchmarks/gpu_check.sh`` (installs the tree without network, then
runs this script with the defaults below); on a CPU machine ``python benchmarks/gpu_check.py --dry-run``
runs every phase at tiny sizes on CPU tensors (the CUDA-only figures are reported as skipped, with the
reason), which is what ``tests/test_gpu_check.py`` does in CI.

One process, world size 1: the default process group is the *training* group (NCCL on CUDA, gloo on
CPU: an ``all_reduce`` on it runs first), and unickpt creates its own private gloo groups beside it.
Phases, in order, each with its own time budget (seconds, ``--budget-<phase>``) inside a total budget
(``--total-budget``, default 450 s); a phase that fails records its error and the next one still runs;
the JSON is rewritten after every phase, and a watchdog writes it and exits (code 3) if the total budget
plus ``--grace`` runs out, so that a kill from outside loses nothing already measured:

1. ``env``: versions, device, host memory, disk space, the imports (numpy, fsspec, xxhash, safetensors,
   torch_checkpointing), the training group's backend and unickpt's private groups' backend.
2. ``correctness`` (``--correct-mb``, default 256 MB of model state on the device): a model with fp32 and
   bf16 parameters of uneven shapes (and a non-contiguous / empty / bf16 / int64 plain tensor, buffers,
   the RNG state incl. CUDA's), AdamW moments after two real steps. (a) ``snapshot="sync"``: an async
   save, then every tensor mutated on the device right after ``save`` returns (and the RNG advanced),
   then a load into freshly built device tensors: every byte equal to the state at the call
   (``bitwise_equal``), devices kept, RNG restored. (b) ``snapshot="overlap"``: the same with a real
   forward/backward/``optimizer.step()`` (three steps) run right after the call, while the state is
   being staged.
3. ``reuse`` (``--reuse-gb``, default 2 GB, ``--reuse-saves`` 10): saves of one device state, each
   waited for (the steady state of training, saves minutes apart: one staging ring is used), tensors
   mutated between saves. Per save: ``SaveStats.pool_allocations`` (the ring's (re)allocations),
   the sum over both rings, the ring's pinnedness and capacity, process RSS (``/proc/self/status``) and
   torch's pinned host allocator counters (``torch.cuda.host_memory_stats``, where available).
   ``flat``: no allocation and RSS growth under max(64 MiB, 2 % of the state) after the first save.
4. ``d2h`` (``--d2h-gb``, default 12 GB; tensors of 256 MB down to 1.5 MB, bf16 and fp32): the pinned
   copy peak (one 1 GiB device tensor into a pinned buffer, ``copy_(non_blocking=True)``; best and
   median of 8), the per-tensor ``t.to("cpu", non_blocking=True)`` baseline (allocates pinned outputs
   through torch's caching host allocator; a warm-up round, then the median of 3), per-tensor copies
   into preallocated pinned buffers, and unickpt's staging copy (``snapshot="sync"`` async saves; a
   warm-up save that allocates the ring, then the median of 3; ``bytes_staged / stage_s`` GB/s, the
   drain writing the previous pieces meanwhile, as in a real save). GB = 1e9 bytes.
5. ``train`` (``--train-params-b``, default 2.0: a GPT of that many parameters, width ``--hidden``
   2048, bf16 weights, AdamW with fp32 master weights and fp32 moments held in the optimizer state:
   14 B per parameter): a training loop, batch ``--batch`` x ``--seq``. Per system: one untimed warm-up
   save (allocations), ``--idle-steps`` steps without a save, then ``--saves`` saves, each followed by
   steps until it is durable (at least ``--steps-between``); each checkpoint is deleted once durable.
   Systems: ``none`` (idle steps only), ``unickpt-async`` (``snapshot="sync"``), ``unickpt-async-overlap``
   (``snapshot="overlap"``: ``optimizer.step()`` waits for the snapshot), ``dcp-async-cached`` (DCP's
   best: ``dcp.async_save`` with one reused ``DefaultStager``, pinned, non-blocking, background
   staging; the loop waits for staging just before its optimizer step), ``torch_checkpointing``
   (``CheckpointManager`` defaults, ``optimizer.step()`` under ``manager.lock()``; skipped when not
   importable), ``torch.save`` (one save: state dicts to one file, fsynced; no warm-up). ``stall_s``: per
   save, the time the loop was blocked (the call + any wait before or in the optimizer step), median;
   ``step_s``: the step's wall time without the stall (``torch.cuda.synchronize`` at each step's end);
   ``interference`` = median step time while a save is in flight / median idle step - 1.

Targets (``targets`` in the JSON; CUDA only): unickpt's staging copy at least 80 % of the pinned-copy
peak; the training-loop stall of unickpt's best mode at least 20x below ``torch.save``'s and no higher
than DCP's best; every correctness check true.

Memory and disk: every save uses one ring bound, the largest state of the run + 5 % (``--pool-gb``; see
:func:`pool_bound`), and rings are freed between phases and systems; checkpoints go to a directory on a
disk, not tmpfs (:func:`pick_dir`; ``--dir`` overrides), and each is deleted once durable. The systems'
order is the targets' first (``none``, ``unickpt-async-overlap``, ``dcp-async-cached``, ``torch.save``),
so that a tight budget cuts ``unickpt-async`` and ``torch_checkpointing`` first.

Exit code: 0 when every phase ran (whatever the figures), 1 when a phase raised (the JSON has its
traceback and the other phases' results), 2 on a setup error, 3 from the watchdog.

Output: one JSON object, ``$OUT/gpu_check.json`` when ``$OUT`` is set, else
``benchmarks/results/gpu_check.json`` (``--out`` overrides). Sizes and budgets are arguments; seconds are
wall-clock ``time.perf_counter`` intervals, CUDA work synchronized before each timestamp.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ["env", "correctness", "reuse", "d2h", "train"]
SCHEMA = "unickpt-gpu-check/1"
GB = 1e9
TARGET_D2H_FRACTION = 0.8
TARGET_STALL_VS_TORCH_SAVE = 20.0


# -- arguments ------------------------------------------------------------------------------------------
def default_out() -> str:
    out = os.environ.get("OUT")
    return os.path.join(out, "gpu_check.json") if out else os.path.join(HERE, "results", "gpu_check.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: every phase's non-CUDA logic")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to run (env always runs)")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_check.json or benchmarks/results/)")
    p.add_argument("--dir", default=None, help="where checkpoints go (a fresh temporary directory under it)")
    p.add_argument("--total-budget", type=float, default=450.0, help="seconds for all phases")
    p.add_argument("--grace", type=float, default=30.0, help="seconds past the total budget before the watchdog exits")
    p.add_argument("--budget-correctness", type=float, default=60.0)
    p.add_argument("--budget-reuse", type=float, default=60.0)
    p.add_argument("--budget-d2h", type=float, default=90.0)
    p.add_argument("--budget-train", type=float, default=270.0)
    p.add_argument("--disk-probe-mb", type=float, default=2048.0, help="disk write probe size, MiB (0: none)")
    p.add_argument("--correct-mb", type=float, default=256.0, help="correctness state, MB (1e6 B)")
    p.add_argument("--reuse-gb", type=float, default=2.0)
    p.add_argument("--reuse-saves", type=int, default=10)
    p.add_argument("--d2h-gb", type=float, default=12.0)
    p.add_argument("--pool-gb", type=float, default=None, help="staging ring bound, GB (default: the largest "
                   "state of the run + 5 %%)")
    p.add_argument("--d2h-repeats", type=int, default=3)
    p.add_argument("--peak-mb", type=float, default=1024.0, help="size of the pinned-copy peak's tensor, MiB")
    p.add_argument("--train-params-b", type=float, default=2.0, help="GPT parameters, billions")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--saves", type=int, default=2, help="timed saves per system in the training loop")
    p.add_argument("--steps-between", type=int, default=3, help="at least this many steps after each save")
    p.add_argument("--idle-steps", type=int, default=4, help="steps without a save in flight, per system")
    p.add_argument("--max-busy-steps", type=int, default=200, help="then the loop just waits for the save")
    p.add_argument("--tc-direct-io", action="store_true", help="torch_checkpointing with its O_DIRECT writes")
    p.add_argument("--systems", default="none,unickpt-async-overlap,dcp-async-cached,torch.save,unickpt-async,"
                   "torch_checkpointing", help="training-loop systems, in order (the targets' first: a tight budget "
                   "cuts the last)")
    a = p.parse_args(argv)
    if a.dry_run:
        a.device = a.device or "cpu"
        tiny = dict(disk_probe_mb=16.0, correct_mb=4.0, reuse_gb=0.016, reuse_saves=4, d2h_gb=0.032, d2h_repeats=2, peak_mb=16.0,
                    train_params_b=0.0004, hidden=64, vocab=512, batch=2, seq=32, saves=2, steps_between=2,
                    idle_steps=3, max_busy_steps=50)
        for k, v in tiny.items():  # tiny sizes unless given on the command line
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    a.out = a.out or default_out()
    return a


# -- small helpers ----------------------------------------------------------------------------------
def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rnd(x: Any, nd: int = 4) -> Any:
    return None if x is None else round(float(x), nd)


def rss_bytes() -> int | None:
    """Resident set size of this process, bytes (``VmRSS`` of ``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable", "Cached", "Shmem"):
                    out[k + "_bytes"] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


class Budget:
    """A phase's deadline: ``min(start + seconds, the total deadline)``."""

    def __init__(self, seconds: float, total_deadline: float):
        self.t0 = time.perf_counter()
        self.deadline = min(self.t0 + seconds, total_deadline)
        self.seconds = seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def fs_type(path: str) -> str | None:
    """The file system type of the mount holding ``path`` (``/proc/mounts``; None where unknown)."""
    path = os.path.realpath(path)
    best, typ = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, typ = mnt, parts[2]
    except OSError:
        pass
    return typ


def pick_dir(args: argparse.Namespace, need: int) -> tuple[str, dict]:
    """Where checkpoints go: ``--dir`` / ``$UNICKPT_GPU_CHECK_DIR`` as given; else the first of the temp
    dir, the repository's parent and the repository itself that is on a disk (not tmpfs/ramfs: checkpoints
    there would take RAM the pinned rings need) with ``need`` bytes free, else the one with most space."""
    given = args.dir or os.environ.get("UNICKPT_GPU_CHECK_DIR")
    if given:
        os.makedirs(given, exist_ok=True)
        return given, {"dir": given, "how": "given", "fs_type": fs_type(given)}
    repo = os.path.dirname(HERE)
    seen = []
    for c in (tempfile.gettempdir(), os.path.dirname(repo), repo):
        try:
            free = shutil.disk_usage(c).free
        except OSError:
            continue
        typ = fs_type(c)
        seen.append({"dir": c, "fs_type": typ, "free_bytes": free})
        if typ not in ("tmpfs", "ramfs") and free >= need:
            return c, {"dir": c, "how": "first on disk with room", "need_bytes": need, "candidates": seen}
    best = max(seen, key=lambda x: x["free_bytes"])
    return best["dir"], {"dir": best["dir"], "how": "most free space (none had room on disk)", "need_bytes": need,
                         "candidates": seen}


def pool_bound(args: argparse.Namespace) -> int:
    """The staging ring bound used for every save here, bytes: ``--pool-gb``, else the largest state of the
    run (the training state at 14 B/param, the d2h and reuse states) plus 5 %, so that no save streams
    through a ring smaller than its state. unickpt's own default (a quarter of ``SC_PHYS_PAGES``) is not
    used: on the device machine RAM starts small and grows as it is used, so MemTotal at start is far
    below the 128 GiB the machine gives (``env`` records both)."""
    if args.pool_gb:
        return int(args.pool_gb * GB)
    need = max(14 * args.train_params_b * 1e9, args.d2h_gb * GB, args.reuse_gb * GB, 64 << 20)
    return int(need * 1.05)


class Ctx:
    """What every phase shares: torch, the device, the checkpoint root, the engine."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.torch = torch
        want = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if want.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        self.device = torch.device(want if want != "cuda" else "cuda:0")
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)
        base, self.dir_choice = pick_dir(args, need=int(1.3 * max(14 * args.train_params_b * 1e9, args.d2h_gb * GB)))
        os.makedirs(base, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix="unickpt-gpu-check-", dir=base)
        self.n = 0
        self.partial: Callable[[dict], None] = lambda obj: None  # set by main: record a phase's partial result
        self.pool_bytes = pool_bound(args)

    def path(self, name: str) -> str:
        self.n += 1
        return os.path.join(self.root, f"{self.n:03d}-{name}")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def engine(self):
        from unickpt.engine import get_engine

        return get_engine()

    def configure(self, **kw: Any) -> None:
        from unickpt.options import SaveOptions

        d = SaveOptions()
        base = {f: getattr(d, f) for f in ("snapshot", "direct_io", "writer", "overlap_drain")}
        self.engine().configure(**{**base, "pool_bytes": self.pool_bytes, **kw})

    def pools(self) -> list[dict]:
        return [{"index": p.index, "allocations": p.allocations, "capacity_bytes": p.capacity_bytes,
                 "pinned": bool(p.pinned)} for p in self.engine().saver.pipeline.pools]

    def host_stats(self) -> dict | None:
        """torch's pinned host allocator counters (None where this torch has none or CUDA is off)."""
        if not self.cuda:
            return None
        try:
            s = dict(self.torch.cuda.host_memory_stats())
        except Exception:  # noqa: BLE001 - older torch
            return None
        keep = ("num_host_alloc", "num_host_free", "allocations.current", "allocated_bytes.current",
                "active_bytes.current", "host_alloc_time.total")
        return {k: s[k] for k in keep if k in s} or s

    def empty_host_cache(self) -> str | None:
        """Return torch's cached pinned blocks to the system between phases (name of the call used)."""
        gc.collect()
        if not self.cuda:
            return None
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
        names = ["_host_emptyCache", "_accelerator_emptyHostCache", "_cuda_CachingHostAllocator_emptyCache"]
        names += sorted(n for n in dir(self.torch._C) if "host" in n.lower() and "emptycache" in n.lower()
                        and n not in names)
        for name in names:
            fn = getattr(self.torch._C, name, None)
            if fn is not None:
                try:
                    fn()
                    return name
                except Exception:  # noqa: BLE001
                    continue
        return None

    def release_rings(self) -> None:
        """Free unickpt's staging rings (both idle here), so that the next system or phase starts without
        them holding pinned host memory; the next save allocates a ring again."""
        for p in self.engine().saver.pipeline.pools:
            if not p.released.wait(60):
                raise RuntimeError(f"staging ring {p.index} still in use after 60 s")
            p.close()

    def rm(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


def bitwise_equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    ab = a.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    bb = b.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return bool(torch.equal(ab, bb))


def host_copy(x: Any) -> Any:
    """A host copy of every tensor in a nested structure (the reference taken at the save call)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: host_copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(host_copy(v) for v in x)
    return x


def compare(ref: Any, got: Any, prefix: str, bad: list[str], counts: list[int]) -> None:
    import torch

    if isinstance(ref, torch.Tensor):
        counts[0] += 1
        if not bitwise_equal(ref, got):
            bad.append(prefix)
    elif isinstance(ref, dict):
        if not isinstance(got, dict) or set(ref) != set(got):
            bad.append(f"{prefix} (keys {sorted(map(str, ref))} vs {sorted(map(str, got)) if isinstance(got, dict) else type(got)})")
            return
        for k in ref:
            compare(ref[k], got[k], f"{prefix}.{k}" if prefix else str(k), bad, counts)
    elif isinstance(ref, (list, tuple)):
        if len(ref) != len(got):
            bad.append(prefix)
            return
        for i, (r, g) in enumerate(zip(ref, got)):
            compare(r, g, f"{prefix}.{i}", bad, counts)
    elif ref != got:
        bad.append(prefix)


def tensors_bytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(tensors_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(tensors_bytes(v) for v in x)
    return 0


def disk_probe(directory: str, nbytes: int) -> dict:
    """Sequential buffered write of ``nbytes`` (16 MiB writes) + fsync in ``directory``: GB/s (1e9 B/s),
    to read the durable times against. One run (a few seconds at most)."""
    if nbytes <= 0:
        return {"skipped": "--disk-probe-mb 0"}
    path = os.path.join(directory, "disk-probe.bin")
    buf = os.urandom(16 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        done = 0
        while done < nbytes:
            f.write(buf)
            done += len(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.unlink(path)
    return {"bytes": done, "seconds": rnd(dt), "gbps": rnd(done / dt / GB, 3)}


# -- phase: env -----------------------------------------------------------------------------------
def phase_env(ctx: Ctx, budget: Budget) -> dict:
    torch = ctx.torch
    import torch.distributed as dist

    out: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
                 "cuda_build": torch.version.cuda, "device": str(ctx.device), "cpu_count": os.cpu_count(),
                 "checkpoint_dir": ctx.root, "checkpoint_dir_choice": ctx.dir_choice, **meminfo()}
    try:
        out["disk_free_bytes"] = shutil.disk_usage(ctx.root).free
    except OSError:
        pass
    out["disk_write"] = disk_probe(ctx.root, int(ctx.args.disk_probe_mb * (1 << 20)))
    imports = {}
    for mod in ("numpy", "fsspec", "xxhash", "safetensors", "torch_checkpointing", "unickpt"):
        try:
            m = __import__(mod)
            imports[mod] = getattr(m, "__version__", "ok")
        except Exception as e:  # noqa: BLE001
            imports[mod] = f"missing: {type(e).__name__}: {e}"
    out["imports"] = imports
    import unickpt

    out["unickpt_file"] = getattr(unickpt, "__file__", None)
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        out.update(gpu=p.name, gpu_memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}")
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
        except Exception as e:  # noqa: BLE001
            out["nccl"] = f"unknown: {type(e).__name__}"
    # the training group: NCCL on CUDA; one collective so the communicator really exists
    x = torch.ones(4, device=ctx.device)
    dist.all_reduce(x)
    ctx.sync()
    out["training_group_backend"] = dist.get_backend()
    out["training_all_reduce_ok"] = bool(x.sum().item() == 4)
    eng = ctx.engine()
    out["unickpt_plan_group_backend"] = dist.get_backend(eng.comm.plan_group) if getattr(eng.comm, "plan_group", None) is not None else None
    out["unickpt_background_group_backend"] = (dist.get_backend(eng.comm.background_group)
                                               if getattr(eng.comm, "background_group", None) is not None else None)
    out["unickpt_world_size"] = eng.world_size
    from unickpt.saving.staging import default_ring_bytes as default_pool_cap

    out["unickpt_default_pool_cap_bytes"] = default_pool_cap(1)
    out["pool_bytes_used"] = ctx.pool_bytes
    return out


# -- phase: correctness ---------------------------------------------------------------------------------
def _check_model(ctx: Ctx, nbytes: float, seed: int):
    torch = ctx.torch
    from torch import nn

    bf16 = torch.bfloat16
    # two large parameters of uneven width (1531 and 997 columns) take the size, fp32 and bf16
    rows32 = max(3, int(nbytes * 0.6 / (1531 * 4)))
    rows16 = max(3, int(nbytes * 0.4 / (997 * 2)))

    class CheckModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(37, 53)
            self.b = nn.Linear(53, 29).to(bf16)
            self.emb = nn.Parameter(torch.randn(1001, 3))
            self.w3 = nn.Parameter(torch.randn(3, 517, 7, dtype=bf16))
            self.big32 = nn.Parameter(torch.randn(rows32, 1531) * 0.01)
            self.big16 = nn.Parameter((torch.randn(rows16, 997) * 0.01).to(bf16))
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))
            self.register_buffer("stat", torch.zeros(13, 3))

        def forward(self, x):
            self.count += 1
            self.stat.add_(x[:13, :3].detach())
            h = self.b(torch.tanh(self.a(x)).to(bf16)).float()
            reg = self.emb.square().mean() + self.w3.float().square().mean()
            reg = reg + self.big32[:, :64].square().mean() + self.big16[:, :64].float().square().mean()
            # touch the whole big tensors too, so the backward writes their full gradients
            reg = reg + 1e-6 * (self.big32.sum() + self.big16.float().sum())
            return h.square().mean() + reg

    torch.manual_seed(seed)
    with torch.device(ctx.device):
        m = CheckModel()
    return m


def _train_steps(ctx: Ctx, model, optim, n: int, seed: int) -> None:
    torch = ctx.torch
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    for _ in range(n):
        x = torch.randn(64, 37, device=ctx.device, generator=g)
        model(x).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def _extras(ctx: Ctx, zero: bool = False) -> dict:
    torch = ctx.torch
    d = ctx.device
    mk = torch.zeros if zero else torch.randn
    return {"noncontig": mk(61, 47, device=d).t(),  # a (47, 61) non-contiguous view
            "empty": torch.empty(0, 5, device=d),
            "bf16": mk(777, device=d).to(torch.bfloat16),
            "int64": (torch.zeros(129, dtype=torch.int64, device=d) if zero
                      else torch.randint(-2**40, 2**40, (129,), device=d))}


def _reference(ctx: Ctx, model, optim, extras: dict) -> dict:
    torch = ctx.torch
    ctx.sync()
    ref = {"model": host_copy(model.state_dict()), "optim": host_copy(optim.state_dict()["state"]),
           "extras": host_copy(extras), "rng_cpu": torch.get_rng_state().clone()}
    if ctx.cuda:
        ref["rng_cuda"] = torch.cuda.get_rng_state(ctx.device).clone()
    return ref


def _mutate(ctx: Ctx, model, optim, extras: dict) -> None:
    """Change every tensor of the state on the device, queued right after the save call returned."""
    torch = ctx.torch
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3).add_(1)
        for b in model.buffers():
            b.add_(7)
        for st in optim.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.add_(5)
        for k, v in extras.items():
            if v.numel():
                v.add_(3)
    torch.randn(1024, device=ctx.device)  # advance the device generator
    torch.rand(16)  # and the CPU one


def _check_loaded(ctx: Ctx, ref: dict, model2, optim2, extras2: dict) -> dict:
    torch = ctx.torch
    ctx.sync()
    bad: list[str] = []
    counts = [0]
    compare(ref["model"], model2.state_dict(), "model", bad, counts)
    compare(ref["optim"], optim2.state_dict()["state"], "optim", bad, counts)
    compare(ref["extras"], extras2, "extras", bad, counts)
    rng_ok = bitwise_equal(ref["rng_cpu"], torch.get_rng_state())
    if ctx.cuda:
        rng_ok = rng_ok and bitwise_equal(ref["rng_cuda"], torch.cuda.get_rng_state(ctx.device))
    on_device = all(t.device == ctx.device for t in list(model2.parameters()) + list(extras2.values())) and all(
        v.device == ctx.device for st in optim2.state.values() for k, v in st.items()
        if isinstance(v, torch.Tensor) and k != "step")
    return {"tensors_compared": counts[0], "mismatched": bad[:20], "bitwise_equal": not bad and counts[0] > 0,
            "rng_restored": bool(rng_ok), "rng_cuda_in_checkpoint": bool(ctx.cuda), "on_device": bool(on_device)}


def _fresh(ctx: Ctx, nbytes: float):
    import unickpt

    model2 = _check_model(ctx, nbytes, seed=999)
    optim2 = ctx.torch.optim.AdamW(model2.parameters(), lr=1e-3)
    _train_steps(ctx, model2, optim2, 1, seed=77)  # moments exist, with other values
    extras2 = _extras(ctx, zero=True)
    state2 = {"model": model2, "optim": optim2, "rng": unickpt.RNGState(), "extras": extras2, "step": -1}
    return model2, optim2, extras2, state2


def phase_correctness(ctx: Ctx, budget: Budget) -> dict:
    import unickpt

    torch = ctx.torch
    nbytes = ctx.args.correct_mb * 1e6
    out: dict = {}
    for mode in ("sync", "overlap"):
        ctx.configure(snapshot=mode)
        model = _check_model(ctx, nbytes, seed=1)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        _train_steps(ctx, model, optim, 2, seed=5)
        extras = _extras(ctx)
        state = {"model": model, "optim": optim, "rng": unickpt.RNGState(), "extras": extras, "step": 2}
        path = ctx.path(f"correct-{mode}")
        ref = _reference(ctx, model, optim, extras)
        state_bytes = tensors_bytes(ref["model"]) + tensors_bytes(ref["optim"]) + tensors_bytes(ref["extras"])
        t0 = time.perf_counter()
        h = unickpt.save(path, state, async_save=True)
        call_s = time.perf_counter() - t0
        snap_done_at_return = h.snapshot_done()
        stall_at_return = h.stats.stall_s
        if mode == "sync":
            _mutate(ctx, model, optim, extras)
        else:  # a real forward/backward/optimizer step while the state is staged
            _train_steps(ctx, model, optim, 3, seed=6)
            _mutate(ctx, model, optim, extras)
        h.wait()
        ctx.sync()
        mutated = not bitwise_equal(ref["model"]["a.weight"], model.a.weight)
        model2, optim2, extras2, state2 = _fresh(ctx, nbytes)
        unickpt.load(path, state2)
        res = _check_loaded(ctx, ref, model2, optim2, extras2)
        s = h.stats
        ring = ctx.engine().saver.pipeline.pools[s.pool_index]
        res.update(state_bytes=state_bytes, call_s=rnd(call_s, 5), stall_s=rnd(s.stall_s, 5),
                   stall_at_return_s=rnd(stall_at_return, 5), snapshot_s=rnd(s.snapshot_s, 5),
                   stage_s=rnd(s.stage_s, 5), snapshot_done_at_return=bool(snap_done_at_return),
                   step_restored=state2["step"] == 2, source_mutated_after_call=bool(mutated),
                   ring_pinned=bool(ring.pinned), ring_pinned_expected=ctx.cuda)
        res["ok"] = bool(res["bitwise_equal"] and res["rng_restored"] and res["on_device"] and res["step_restored"]
                         and mutated and (res["ring_pinned"] or not ctx.cuda))
        out[mode] = res
        ctx.rm(path)
        del model, optim, extras, state, model2, optim2, extras2, state2
    ctx.configure(snapshot="sync")
    out["ok"] = all(out[m]["ok"] for m in ("sync", "overlap"))
    return out


# -- phase: reuse ------------------------------------------------------------------------------------------
def _tensor_set(ctx: Ctx, total_bytes: float, seed: int) -> dict:
    """Tensors of 256 MB down to 1.5 MB (bf16 and fp32, uneven widths), ``total_bytes`` in all."""
    torch = ctx.torch
    sizes = [256e6, 64e6, 16e6, 64e6, 4e6, 1.5e6, 128e6, 32e6]
    out, left, i = {}, total_bytes, 0
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    while left > 0:
        nb = min(sizes[i % len(sizes)], left)
        dtype = torch.bfloat16 if i % 2 else torch.float32
        width = (1531, 997, 4096, 1024)[i % 4]
        n = max(1, int(nb // (width * (2 if i % 2 else 4))))
        t = torch.empty(n, width, dtype=dtype, device=ctx.device)
        t.uniform_(-1, 1, generator=g) if dtype == torch.float32 else t.copy_(
            torch.empty(n, width, device=ctx.device).uniform_(-1, 1, generator=g))
        out[f"t{i:04d}"] = t
        left -= t.numel() * t.element_size()
        i += 1
    return out


def phase_reuse(ctx: Ctx, budget: Budget) -> dict:
    import unickpt

    torch = ctx.torch
    ctx.configure(snapshot="sync")
    tensors = _tensor_set(ctx, ctx.args.reuse_gb * GB, seed=3)
    nbytes = tensors_bytes(tensors)
    state = {"t": tensors, "step": 0}
    rows = []
    for i in range(ctx.args.reuse_saves):
        if i >= 2 and budget.left() < 2 * (rows[-1]["total_s"] or 1):
            break
        path = ctx.path(f"reuse-{i}")
        ctx.sync()
        h = unickpt.save(path, state, async_save=True, step=i)
        with torch.no_grad():
            for t in tensors.values():
                t.add_(1)
        h.wait()
        s = h.stats
        pools = ctx.pools()
        rows.append({"save": i, "stall_s": rnd(s.stall_s, 5), "total_s": rnd(s.total_s, 4),
                     "pool_index": s.pool_index, "pool_allocations": s.pool_allocations,
                     "pool_capacity_bytes": s.pool_capacity, "allocations_all_rings": sum(p["allocations"] for p in pools),
                     "ring_pinned": pools[s.pool_index]["pinned"], "rss_bytes": rss_bytes(), "host_stats": ctx.host_stats()})
        ctx.rm(path)
    first, last = rows[0], rows[-1]
    rss_growth = (last["rss_bytes"] - first["rss_bytes"]) if first["rss_bytes"] and last["rss_bytes"] else None
    rss_limit = max(64 << 20, int(0.02 * nbytes))
    host_flat = None
    if first["host_stats"] and last["host_stats"]:
        keys = [k for k in ("num_host_alloc", "allocated_bytes.current") if k in first["host_stats"]]
        host_flat = all(first["host_stats"][k] == last["host_stats"].get(k) for k in keys) if keys else None
    flat = (len(rows) >= 2 and first["allocations_all_rings"] == last["allocations_all_rings"]
            and rss_growth is not None and rss_growth <= rss_limit and host_flat is not False)
    pinned = (first["host_stats"] or {}).get("allocated_bytes.current")
    ring = first["pool_capacity_bytes"]
    return {"state_bytes": nbytes, "saves": len(rows), "rows": rows,
            # torch's caching host allocator (it rounds each pinned block up to a power of two); unickpt's
            # rings are pinned with cudaHostRegister of their exact range, so None / 0 here is expected
            "pinned_bytes_after_first_save": pinned, "pinned_bytes_per_ring_byte": rnd(pinned / ring, 3)
            if pinned and ring else None,
            "allocations_first_save": first["allocations_all_rings"], "allocations_last_save": last["allocations_all_rings"],
            "rss_growth_after_first_save_bytes": rss_growth, "rss_growth_limit_bytes": rss_limit,
            "host_alloc_counters_flat": host_flat, "ring_pinned": all(r["ring_pinned"] for r in rows),
            "flat": bool(flat), "ok": bool(flat and (all(r["ring_pinned"] for r in rows) or not ctx.cuda))}


# -- phase: d2h ----------------------------------------------------------------------------------------------
def _timed(ctx: Ctx, fn: Callable[[], Any]) -> float:
    ctx.sync()
    t0 = time.perf_counter()
    fn()
    ctx.sync()
    return time.perf_counter() - t0


def phase_d2h(ctx: Ctx, budget: Budget) -> dict:
    import unickpt

    torch = ctx.torch
    out: dict = {"device": str(ctx.device)}
    # 1. the pinned-copy peak: one large device tensor into a pinned buffer
    n = int(ctx.args.peak_mb * (1 << 20))
    src = torch.ones(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=ctx.cuda)
    _timed(ctx, lambda: dst.copy_(src, non_blocking=ctx.cuda))  # warm-up
    ts = [_timed(ctx, lambda: dst.copy_(src, non_blocking=ctx.cuda)) for _ in range(8)]
    out["peak"] = {"what": "one %d MiB %s tensor -> pinned host buffer, copy_(non_blocking=True)" % (
        ctx.args.peak_mb, "device" if ctx.cuda else "host (CPU run: a host memcpy, not D2H)"),
        "bytes": n, "best_gbps": rnd(n / min(ts) / GB, 3), "median_gbps": rnd(n / med(ts) / GB, 3),
        "samples_s": [rnd(t, 5) for t in ts]}
    del src, dst
    # 2. the state: tensors of 256 MB down to 1.5 MB, bf16 and fp32
    tensors = _tensor_set(ctx, ctx.args.d2h_gb * GB, seed=4)
    nbytes = tensors_bytes(tensors)
    out["state_bytes"], out["tensors"] = nbytes, len(tensors)
    reps = ctx.args.d2h_repeats
    if ctx.cuda:
        # 3. per-tensor t.to("cpu", non_blocking=True): pinned outputs from torch's caching host allocator
        holder: list = []

        def to_cpu():
            holder.append([t.to("cpu", non_blocking=True) for t in tensors.values()])

        warm = _timed(ctx, to_cpu)
        pinned_out = all(x.is_pinned() for x in holder[-1])
        holder.clear()
        ts = []
        for _ in range(reps):
            ts.append(_timed(ctx, to_cpu))
            holder.clear()
        out["to_cpu_non_blocking"] = {"gbps": rnd(nbytes / med(ts) / GB, 3), "warmup_gbps": rnd(nbytes / warm / GB, 3),
                                      "outputs_pinned": pinned_out, "samples_s": [rnd(t, 4) for t in ts]}
        # 4. per-tensor copies into preallocated pinned buffers
        dsts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors.values()]

        def into_pinned():
            for d, t in zip(dsts, tensors.values()):
                d.copy_(t, non_blocking=True)

        into_pinned()
        ts = [_timed(ctx, into_pinned) for _ in range(reps)]
        out["copy_into_preallocated_pinned"] = {"gbps": rnd(nbytes / med(ts) / GB, 3), "samples_s": [rnd(t, 4) for t in ts]}
        del dsts
        ctx.empty_host_cache()
    else:
        out["to_cpu_non_blocking"] = {"skipped": "needs CUDA: on CPU tensors .to('cpu') copies nothing"}
        out["copy_into_preallocated_pinned"] = {"skipped": "needs CUDA (pinned memory)"}
    # 5. unickpt's staging copy (sync snapshot, async save): a warm-up save allocates the ring
    ctx.configure(snapshot="sync")
    state = {"t": tensors}
    rows = []
    for i in range(reps + 1):
        if i >= 2 and budget.left() < 1.5 * rows[-1]["total_s"]:
            out["truncated"] = f"budget: {i - 1} timed saves"
            break
        path = ctx.path(f"d2h-{i}")
        ctx.sync()
        h = unickpt.save(path, state, async_save=True)
        h.wait()
        s = h.stats
        rows.append({"warmup": i == 0, "stall_s": s.stall_s, "stage_s": s.stage_s, "snapshot_s": s.snapshot_s,
                     "plan_s": s.plan_s, "bytes_staged": s.bytes_staged, "total_s": s.total_s,
                     "pool_allocations": s.pool_allocations, "pool_capacity_bytes": s.pool_capacity,
                     "streamed": s.streamed, "ring_pinned": ctx.engine().saver.pipeline.pools[s.pool_index].pinned,
                     "host_stats": ctx.host_stats()})
        ctx.rm(path)
    timed = [r for r in rows if not r["warmup"]] or rows
    stage = med([r["stage_s"] for r in timed])
    stall = med([r["stall_s"] for r in timed])
    staged = timed[0]["bytes_staged"]
    out["unickpt_staging"] = {
        "stage_gbps": rnd(staged / stage / GB, 3) if stage else None,
        "stall_gbps": rnd(nbytes / stall / GB, 3) if stall else None,
        "warmup_stage_gbps": rnd(rows[0]["bytes_staged"] / rows[0]["stage_s"] / GB, 3) if rows[0]["stage_s"] else None,
        "stage_s": rnd(stage, 4), "stall_s": rnd(stall, 4), "bytes_staged": staged,
        "ring_pinned": all(r["ring_pinned"] for r in rows), "streamed": any(r["streamed"] for r in rows),
        "rows": [{k: (rnd(v, 5) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}
    hs = rows[0].get("host_stats") or {}
    if hs.get("allocated_bytes.current") and rows[0]["pool_capacity_bytes"]:
        # torch's caching host allocator rounds each pinned block up to a power of two
        out["unickpt_staging"]["pinned_bytes_per_ring_byte"] = rnd(
            hs["allocated_bytes.current"] / rows[0]["pool_capacity_bytes"], 3)
    peak = out["peak"]["best_gbps"]
    frac = (out["unickpt_staging"]["stage_gbps"] / peak) if (peak and out["unickpt_staging"]["stage_gbps"]) else None
    out["unickpt_vs_peak"] = rnd(frac, 3)
    if ctx.cuda:
        tc = out["to_cpu_non_blocking"]["gbps"]
        out["unickpt_vs_to_cpu"] = rnd(out["unickpt_staging"]["stage_gbps"] / tc, 3) if tc else None
    return out


# -- phase: train -------------------------------------------------------------------------------------------
def _gpt(ctx: Ctx):
    from save_load import gpt_model  # the benchmarks' GPT-like model (benchmarks/ is on sys.path)

    torch = ctx.torch
    a = ctx.args
    d, vocab = a.hidden, a.vocab
    heads = max(1, d // 128) if d >= 128 else 1
    layers = max(1, round((a.train_params_b * 1e9 - 2 * vocab * d) / (12 * d * d + 13 * d)))
    torch.manual_seed(0)
    with torch.device(ctx.device):
        m = gpt_model(d, heads, layers, vocab)
    m.to(torch.bfloat16)
    return m, layers


def mixed_adamw(torch):
    class MixedAdamW(torch.optim.Optimizer):
        """AdamW over bf16 parameters with fp32 master weights and fp32 moments in the optimizer state
        (``master``, ``exp_avg``, ``exp_avg_sq``; ``step`` a CPU float tensor), as mixed-precision
        trainers keep them: every tensor of the state changes only inside ``step()``."""

        def __init__(self, params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                b1, b2 = g["betas"]
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["step"] = torch.tensor(0.0)
                        st["master"] = p.detach().float()
                        st["exp_avg"] = torch.zeros_like(st["master"])
                        st["exp_avg_sq"] = torch.zeros_like(st["master"])
                    st["step"] += 1
                    n = float(st["step"])
                    gr = p.grad.float()
                    m, v, w = st["exp_avg"], st["exp_avg_sq"], st["master"]
                    m.lerp_(gr, 1 - b1)
                    v.mul_(b2).addcmul_(gr, gr, value=1 - b2)
                    w.mul_(1 - g["lr"] * g["weight_decay"])
                    denom = (v / (1 - b2 ** n)).sqrt_().add_(g["eps"])
                    w.addcdiv_(m, denom, value=-g["lr"] / (1 - b1 ** n))
                    p.copy_(w)
            return None

    return MixedAdamW


class Trainer:
    """The training loop's model, optimizer and the save methods of every system."""

    def __init__(self, ctx: Ctx):
        torch = ctx.torch
        self.ctx, self.torch = ctx, torch
        self.model, self.layers = _gpt(ctx)
        self.optim = mixed_adamw(torch)(self.model.parameters(), lr=1e-4)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.seed = 0
        self.step()  # the optimizer state exists from here on
        ctx.sync()
        self.state_bytes = tensors_bytes(self.model.state_dict()) + tensors_bytes(self.optim.state_dict()["state"])
        self.unickpt_state = {"model": self.model, "optim": self.optim, "step": 1}
        self._dcp = None
        self._tc = None
        self.tc_shared = True  # torch_checkpointing's default; False after a failure with it (a small /dev/shm)

    def batch(self):
        torch, a = self.torch, self.ctx.args
        self.seed += 1
        g = torch.Generator(device=self.ctx.device).manual_seed(self.seed)
        return torch.randint(0, a.vocab, (a.batch, a.seq), device=self.ctx.device, generator=g)

    def forward_backward(self) -> None:
        idx = self.batch()
        logits = self.model(idx)
        loss = self.torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())
        loss.backward()

    def step(self) -> None:
        self.forward_backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    # -- systems
    def setup(self, system: str) -> None:
        torch = self.torch
        if system.startswith("unickpt"):
            self.ctx.configure(snapshot="overlap" if "overlap" in system else "sync")
        elif system == "dcp-async-cached":
            import torch.distributed as dist
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            from torch.distributed.checkpoint.stateful import Stateful

            model, optim = self.model, self.optim

            class AppState(Stateful):  # the DCP tutorial's wrapper
                def state_dict(self):
                    msd, osd = get_state_dict(model, optim)
                    return {"model": msd, "optim": osd}

                def load_state_dict(self, sd):
                    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

            cuda = self.ctx.cuda
            self._dcp = {"state": {"app": AppState(), "step": 1}, "pg": dist.new_group(backend="gloo"),
                         "stager": DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                                use_async_staging=True, use_non_blocking_copy=cuda))}
        elif system == "torch_checkpointing":
            import torch_checkpointing as tc
            from torch_checkpointing.config import AsyncCheckpointSaverConfig
            from torch_checkpointing.staging import CheckpointStagerConfig
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

            # its defaults on CUDA (pinned staging, non-blocking copies, shared memory, a writer process);
            # on CPU its CPU configuration (pinned memory and non-blocking copies need CUDA). O_DIRECT
            # off unless --tc-direct-io: 0.1.1 writes torch.save's unaligned stream to an O_DIRECT file
            # and fails with EINVAL on ext4 (seen on the CPU machine).
            staging = (CheckpointStagerConfig(use_shared_memory=self.tc_shared) if self.ctx.cuda else
                       CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False,
                                              use_shared_memory=self.tc_shared))
            cfg = tc.CheckpointManager.Config(
                save=AsyncCheckpointSaverConfig(staging_config=staging),
                storage_config=LocalFileSystemStorageConfig(use_direct_io=self.ctx.args.tc_direct_io))
            self._tc = tc.CheckpointManager(cfg)

    def teardown(self, system: str) -> None:
        if system == "dcp-async-cached" and self._dcp is not None:
            with contextlib.suppress(Exception):
                self._dcp["stager"].close()
            self._dcp = None
        if system == "torch_checkpointing" and self._tc is not None:
            with contextlib.suppress(Exception):
                self._tc.close()
            self._tc = None
        if system.startswith("unickpt"):
            self.ctx.configure(snapshot="sync")
            self.ctx.release_rings()
        self.ctx.empty_host_cache()

    def start(self, system: str, path: str) -> tuple[Callable[[], None], Callable[[], None], Any]:
        """Start a save: (wait until the parameters may change, wait until durable, handle)."""
        torch = self.torch
        nothing = lambda: None  # noqa: E731
        if system.startswith("unickpt"):
            import unickpt

            h = unickpt.save(path, self.unickpt_state, async_save=True)
            return h.wait_snapshot, h.wait, h
        if system == "torch.save":
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "full.pt"), "wb") as f:
                torch.save({"model": self.model.state_dict(), "optim": self.optim.state_dict(), "step": 1}, f)
                f.flush()
                os.fsync(f.fileno())
            return nothing, nothing, None
        if system == "dcp-async-cached":
            import torch.distributed.checkpoint as dcp

            d = self._dcp
            resp = dcp.async_save(d["state"], checkpoint_id=path, process_group=d["pg"], async_stager=d["stager"])
            staging = getattr(resp, "staging_completion", None)
            upload = getattr(resp, "upload_completion", resp)
            return (staging.result if staging is not None else nothing), upload.result, upload
        if system == "torch_checkpointing":
            fut = self._tc.save(path, {"model": self.model.state_dict(), "optim": self.optim.state_dict()})
            return nothing, (fut.result if fut is not None else nothing), fut
        raise ValueError(system)


class _Durable:
    """Waits for a save's durability in a thread (the loop must not block on it)."""

    def __init__(self, t0: float, durable: Callable[[], None]):
        self.t0, self.durable_s, self.error = t0, None, None
        self._t = threading.Thread(target=self._run, args=(durable,), daemon=True)
        self._t.start()

    def _run(self, durable: Callable[[], None]) -> None:
        try:
            durable()
        except BaseException as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
        self.durable_s = time.perf_counter() - self.t0

    def done(self) -> bool:
        return not self._t.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._t.join(timeout)


def _loop_step(tr: Trainer, system: str, path: str | None) -> dict:
    """One training step, with a save at its start when ``path`` is given. Seconds, CUDA synchronized."""
    ctx = tr.ctx
    ctx.sync()
    t0 = time.perf_counter()
    stall = 0.0
    snap = durable = h = None
    before = None
    if path is not None:
        snap, durable, h = tr.start(system, path)
        stall += time.perf_counter() - t0
        before = getattr(getattr(h, "stats", None), "stall_s", None)
    tr.forward_backward()
    if snap is not None and system == "dcp-async-cached":
        c0 = time.perf_counter()
        snap()  # DCP's best configuration: wait for its background staging only now
        stall += time.perf_counter() - c0
    if system == "torch_checkpointing" and tr._tc is not None:
        c0 = time.perf_counter()
        with tr._tc.lock():
            stall += time.perf_counter() - c0 if path is not None else 0.0
            tr.optim.step()
    else:
        tr.optim.step()  # unickpt overlap: its pre-hook waits here and adds the wait to stats.stall_s
    tr.optim.zero_grad(set_to_none=True)
    if before is not None and system.startswith("unickpt-async-overlap"):
        stall += max(0.0, h.stats.stall_s - before)
    ctx.sync()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "step_s": wall - (stall if path is not None else 0.0),
            "stall_s": stall if path is not None else None, "durable": durable, "t0": t0, "handle": h}


def _run_system(tr: Trainer, system: str, budget_s: float) -> dict:
    ctx, a = tr.ctx, tr.ctx.args
    end = time.perf_counter() + budget_s
    rec: dict = {"system": system}
    tr.setup(system)
    try:
        if system not in ("none", "torch.save"):  # warm-up save: rings, plan cache, pinned copies
            path = ctx.path(f"train-{system}-warmup")
            r = _loop_step(tr, system, path)
            w = _Durable(r["t0"], r["durable"])
            w.join()
            rec["warmup_stall_s"], rec["warmup_durable_s"] = rnd(r["stall_s"]), rnd(w.durable_s)
            if w.error:
                raise RuntimeError(f"warm-up save failed: {w.error}")
            ctx.rm(path)
        idle = [_loop_step(tr, system, None)["step_s"] for _ in range(a.idle_steps)]
        rec["idle_step_s"] = rnd(med(idle[1:] if len(idle) > 2 else idle))
        rec["idle_samples_s"] = [rnd(x) for x in idle]
        if system == "none":
            return rec
        stalls, durables, busy, walls, extra = [], [], [], [], []
        saves = 1 if system == "torch.save" else a.saves
        for k in range(saves):
            if k >= 1 and time.perf_counter() + max(durables) > end:
                rec["truncated"] = f"budget: {k} of {saves} saves"
                break
            path = ctx.path(f"train-{system}-{k}")
            r = _loop_step(tr, system, path)
            stalls.append(r["stall_s"])
            walls.append(r["wall_s"])
            w = _Durable(r["t0"], r["durable"])
            n = 0
            while (not w.done() or n < a.steps_between) and n < a.max_busy_steps:
                s = _loop_step(tr, system, None)
                (busy if not w.done() else extra).append(s["step_s"])
                n += 1
            w.join()
            if w.error:
                raise RuntimeError(f"save {k} failed: {w.error}")
            durables.append(w.durable_s)
            h = r["handle"]
            if h is not None and hasattr(h, "stats"):
                rec.setdefault("pool_allocations", []).append(h.stats.pool_allocations)
                rec.setdefault("snapshot_s", []).append(rnd(h.stats.snapshot_s))
                rec["pool_capacity_bytes"], rec["streamed"] = h.stats.pool_capacity, h.stats.streamed
            ctx.rm(path)
        busy_med, idle_med = med(busy), med(idle[1:] if len(idle) > 2 else idle)
        rec.update(stall_s=rnd(med(stalls), 5), stall_samples_s=[rnd(x, 5) for x in stalls],
                   durable_s=rnd(med(durables)), durable_samples_s=[rnd(x) for x in durables],
                   save_step_wall_s=[rnd(x) for x in walls], busy_step_s=rnd(busy_med), busy_steps=len(busy),
                   interference=rnd(busy_med / idle_med - 1, 4) if busy_med and idle_med else None)
        return rec
    finally:
        tr.teardown(system)


def phase_train(ctx: Ctx, budget: Budget) -> dict:
    tr = Trainer(ctx)
    out: dict = {"params": tr.params, "layers": tr.layers, "hidden": ctx.args.hidden, "vocab": ctx.args.vocab,
                 "batch": ctx.args.batch, "seq": ctx.args.seq, "state_bytes": tr.state_bytes,
                 "state": "bf16 weights + fp32 master weights + fp32 AdamW moments (14 B/param)", "systems": {}}
    free = shutil.disk_usage(ctx.root).free
    out["disk_free_bytes"] = free
    systems = [s for s in ctx.args.systems.split(",") if s]
    weight = {"none": 0.1, "torch.save": 0.5}  # shares of the budget: idle steps only / one save, no warm-up
    for i, s in enumerate(systems):
        left = budget.left()
        share = left * weight.get(s, 1.0) / sum(weight.get(x, 1.0) for x in systems[i:])
        if s != "none" and left < 5:
            out["systems"][s] = {"system": s, "skipped": f"budget: {left:.1f} s left"}
            continue
        if s != "none" and free < 1.2 * tr.state_bytes:
            out["systems"][s] = {"system": s, "skipped": f"disk: {free} bytes free for a {tr.state_bytes}-byte checkpoint"}
            continue
        if s == "torch_checkpointing":
            try:
                import torch_checkpointing  # noqa: F401
            except Exception as e:  # noqa: BLE001
                out["systems"][s] = {"system": s, "skipped": f"not installed: {type(e).__name__}: {e}"}
                continue
        t0 = time.perf_counter()
        try:
            out["systems"][s] = _run_system(tr, s, share)
        except Exception as e:  # noqa: BLE001 - one system's failure keeps the others' results
            out["systems"][s] = {"system": s, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            if s == "torch_checkpointing" and tr.tc_shared and budget.left() > 10:
                first = out["systems"][s]  # once more without its shared-memory staging (/dev/shm may be small)
                tr.tc_shared = False
                try:
                    out["systems"][s] = _run_system(tr, s, budget.left())
                except Exception as e2:  # noqa: BLE001
                    out["systems"][s] = {"system": s, "error": f"{type(e2).__name__}: {e2}",
                                         "traceback": traceback.format_exc()[-3000:]}
                out["systems"][s]["first_try_with_shared_memory"] = {"error": first["error"]}
        if s == "torch_checkpointing":
            out["systems"][s]["use_shared_memory"] = tr.tc_shared
            out["systems"][s]["use_direct_io"] = ctx.args.tc_direct_io
        out["systems"][s]["elapsed_s"] = rnd(time.perf_counter() - t0, 2)
        ctx.partial(out)  # in the JSON now, should a later system take the process down
    return out


# -- targets -----------------------------------------------------------------------------------------
def targets(results: dict, cuda: bool) -> dict:
    ph = results["phases"]

    def res(name: str) -> dict:
        p = ph.get(name) or {}
        return p.get("result") or {}

    t: dict = {}
    c = res("correctness")
    t["correctness"] = {"sync": (c.get("sync") or {}).get("ok"), "overlap": (c.get("overlap") or {}).get("ok"),
                        "ok": c.get("ok")}
    r = res("reuse")
    t["pinned_pool_reuse"] = {"flat": r.get("flat"), "ok": r.get("ok")}
    d = res("d2h")
    frac = d.get("unickpt_vs_peak")
    t["d2h"] = ({"skipped": "needs CUDA (a CPU run copies host to host)", "fraction_of_peak": frac} if not cuda else
                {"fraction_of_peak": frac, "target": TARGET_D2H_FRACTION,
                 "ok": None if frac is None else frac >= TARGET_D2H_FRACTION})
    tr = (res("train").get("systems") or {})

    def stall(s: str) -> float | None:
        return (tr.get(s) or {}).get("stall_s")

    best_name = min((s for s in ("unickpt-async", "unickpt-async-overlap") if stall(s) is not None),
                    key=lambda s: stall(s), default=None)
    best = stall(best_name) if best_name else None
    ts, dcp_best = stall("torch.save"), stall("dcp-async-cached")
    ratio = ts / best if ts and best else None
    st = {"unickpt_best": best_name, "unickpt_best_stall_s": best, "torch_save_stall_s": ts,
          "dcp_best_stall_s": dcp_best, "torch_checkpointing_stall_s": stall("torch_checkpointing"),
          "torch_save_over_unickpt": rnd(ratio, 2), "target_ratio": TARGET_STALL_VS_TORCH_SAVE}
    if not cuda:
        st["skipped"] = "targets are for the CUDA run (CPU stalls are memcpy-bound)"
    else:
        st["ok_vs_torch_save"] = None if ratio is None else ratio >= TARGET_STALL_VS_TORCH_SAVE
        st["ok_vs_dcp"] = None if best is None or dcp_best is None else best <= dcp_best
    t["stall"] = st
    return t


# -- driver -------------------------------------------------------------------------------------------
def write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _init_group(cuda: bool) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    total_deadline = t_start + args.total_budget
    results: dict = {"schema": SCHEMA, "started_utc": now_utc(), "args": vars(args), "phases": {},
                     "status": "running"}
    lock = threading.Lock()

    def save_json() -> None:
        with lock:
            write_json(args.out, results)

    def log(msg: str) -> None:
        print(f"[gpu_check {time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    finished = threading.Event()

    def watchdog() -> None:
        while time.perf_counter() < total_deadline + args.grace:
            if finished.wait(0.5):
                return
        with lock:
            if finished.is_set():
                return
            for p in results["phases"].values():
                if p.get("status") == "running":
                    p["status"], p["error"] = "timeout", "the watchdog ended the run (total budget + grace)"
            results["status"] = "timeout"
            results["elapsed_s"] = rnd(time.perf_counter() - t_start, 2)
            write_json(args.out, results)
        print(f"[gpu_check] watchdog: total budget exceeded, wrote {args.out}", flush=True)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True, name="gpu-check-watchdog").start()
    save_json()
    try:
        ctx = Ctx(args)
        _init_group(ctx.cuda)
    except Exception as e:  # noqa: BLE001
        results["status"] = "error"
        results["error"] = f"setup: {type(e).__name__}: {e}"
        results["traceback"] = traceback.format_exc()
        save_json()
        log(results["error"])
        return 2
    results["device"] = str(ctx.device)
    results["cuda"] = ctx.cuda
    wanted = ["env"] + [p for p in args.phases.split(",") if p and p != "env"]
    fns = {"env": (phase_env, 30.0), "correctness": (phase_correctness, args.budget_correctness),
           "reuse": (phase_reuse, args.budget_reuse), "d2h": (phase_d2h, args.budget_d2h),
           "train": (phase_train, args.budget_train)}
    for name in wanted:
        if name not in fns:
            results["phases"][name] = {"status": "error", "error": f"unknown phase {name!r}"}
            continue
        fn, secs = fns[name]
        left = total_deadline - time.perf_counter()
        if left < 3:
            results["phases"][name] = {"status": "skipped", "reason": f"total budget: {left:.1f} s left"}
            save_json()
            continue
        b = Budget(secs, total_deadline)
        entry = {"status": "running", "budget_s": rnd(min(secs, left), 1), "started_utc": now_utc()}
        with lock:
            results["phases"][name] = entry
        save_json()

        def partial(obj: dict, entry: dict = entry) -> None:
            with lock:
                entry["partial"] = json.loads(json.dumps(obj, default=str))
            save_json()

        ctx.partial = partial
        log(f"phase {name}: budget {entry['budget_s']} s")
        try:
            entry["result"] = fn(ctx, b)
            entry.pop("partial", None)
            entry["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - a failing phase must not lose the others
            entry["status"] = "error"
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            log(f"phase {name} failed: {entry['error']}")
        entry["elapsed_s"] = rnd(b.elapsed(), 2)
        entry["over_budget"] = b.elapsed() > secs
        if name in ("correctness", "reuse", "d2h"):
            try:
                ctx.release_rings()
            except Exception as e:  # noqa: BLE001
                entry["release_rings_error"] = f"{type(e).__name__}: {e}"
        entry["host_cache_emptied_with"] = ctx.empty_host_cache()
        results["targets"] = targets(results, ctx.cuda)
        save_json()
        log(f"phase {name}: {entry['status']} in {entry['elapsed_s']} s")
    results["targets"] = targets(results, ctx.cuda)
    with lock:
        finished.set()  # the watchdog stands down: from here on only cleanup runs
        results["status"] = "done"
        results["elapsed_s"] = rnd(time.perf_counter() - t_start, 2)
        write_json(args.out, results)
    print(json.dumps({"targets": results["targets"],
                      "phases": {k: v.get("status") for k, v in results["phases"].items()}}, indent=1, default=str))
    log(f"wrote {args.out}")
    try:
        from unickpt.engine import get_engine

        get_engine().close()
    except Exception:  # noqa: BLE001
        pass
    shutil.rmtree(ctx.root, ignore_errors=True)
    failed = [k for k, v in results["phases"].items() if v.get("status") == "error"]
    if failed:
        log(f"phases with errors: {failed} (their tracebacks are in the JSON)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
