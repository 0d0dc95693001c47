"""Train a small byte-level GPT with FSDP2 on CPU ranks and checkpoint it with unickpt.

Launch with torchrun, e.g.::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/train_gpt.py \\
        --steps 40 --ckpt-every 10 --root /tmp/ckpt --metrics /tmp/metrics.json

What the script demonstrates:

* A decoder-only transformer (~11 M parameters with the defaults) sharded with
  FSDP2 (``fully_shard`` on every block and on the root) over a 1-D CPU mesh
  (gloo backend).
* Training data that every machine has: the Python standard library's own
  ``*.py`` files, read as raw bytes (vocabulary = 256 byte values).
* Data order that depends on the global step only.  Each step consumes one
  global batch of ``--batch`` sequences; rank ``r`` of ``W`` takes the slice
  ``[r * B/W, (r+1) * B/W)``.  The per-rank read position is checkpointed as
  ``unickpt.PerRank`` state with a ``reshard`` rule, so a resume on a
  different world size continues with exactly the same global batches.
* AdamW + warmup/cosine ``LambdaLR`` schedule, per-rank RNG state
  (``unickpt.RNGState``), asynchronous checkpoints every ``--ckpt-every``
  steps, and, for comparison, the time a plain synchronous ``torch.save`` of
  the same sharded state takes on each rank.
* ``--kill-at-step S``: SIGKILL every rank right after ``ckpt.save(S)``
  returned, i.e. while the background write of step ``S`` is in flight.
* ``--dump-dir``: independent of unickpt, rank 0 writes the FULL (unsharded)
  model + optimizer state at each checkpoint step and right after a resume,
  so that another process can compare them bitwise.

Units: times are reported in seconds (``*_s``) or milliseconds (``*_ms``);
losses are mean cross-entropy per byte in nats.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unickpt


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #
@dataclass
class GPTConfig:
    """Hyper-parameters of the GPT.  ``block_size`` is the context length T."""

    vocab_size: int = 256  # byte-level
    block_size: int = 128
    n_layer: int = 6
    n_head: int = 6
    d_model: int = 384


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: (B, T, C) -> (B, T, C).  No dropout."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer: byte ids (B, T) int64 -> logits (B, T, 256) float32."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #
def load_stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """Concatenate the sorted top-level ``*.py`` files of the standard library.

    Returns a 1-D uint8 tensor of at most ``max_bytes`` bytes.  The result is the
    same on every rank (and every run on the same Python installation).
    """
    stdlib = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class StepOrderedSampler:
    """Global, world-size independent order of training sequences.

    The corpus is cut into ``n = (len - 1) // T`` non-overlapping windows of
    ``T + 1`` bytes (input + shifted target).  Global sample ``i`` is window
    ``perm_e[i % n]`` of epoch ``e = i // n``, where ``perm_e`` is a permutation
    seeded with ``seed + e``.  Global step ``s`` (1-based) consumes global
    samples ``[(s-1) * B, s * B)``, so the order is a function of the step only.
    """

    def __init__(self, corpus: torch.Tensor, block_size: int, seed: int):
        self.corpus = corpus
        self.t = block_size
        self.n = (corpus.numel() - 1) // block_size
        self.seed = seed
        self._perm_epoch, self._perm = -1, None

    def window(self, i: int) -> torch.Tensor:
        """Global sample ``i`` as an int64 tensor of shape (T + 1,)."""
        epoch, j = divmod(i, self.n)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g), epoch
        start = int(self._perm[j]) * self.t
        return self.corpus[start : start + self.t + 1].long()


class RankCursor:
    """This rank's read position in the global sample stream (a Stateful object).

    ``next_sample`` is the global index of the first sample of this rank's next
    slice: ``step * B + rank * (B / W)`` after ``step`` completed steps.  Each
    call to :meth:`next_batch` reads ``B / W`` consecutive samples and then jumps
    over the other ranks' slices (``next_sample += B``).
    """

    def __init__(self, sampler: StepOrderedSampler, global_batch: int, rank: int, world_size: int):
        assert global_batch % world_size == 0, "global batch must be divisible by the world size"
        self.sampler = sampler
        self.global_batch = global_batch
        self.local_batch = global_batch // world_size
        self.next_sample = rank * self.local_batch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (inputs, targets), both int64 of shape (B / W, T)."""
        rows = [self.sampler.window(self.next_sample + k) for k in range(self.local_batch)]
        self.next_sample += self.global_batch
        xy = torch.stack(rows)
        return xy[:, :-1], xy[:, 1:]

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample}

    def load_state_dict(self, state: dict) -> None:
        self.next_sample = int(state["next_sample"])


def reshard_cursor(states: list[dict], rank: int, world_size: int, *, global_batch: int) -> dict:
    """Map the saved cursors of ``len(states)`` old ranks to rank ``rank`` of ``world_size``.

    Old rank ``r`` saved ``base + r * B / W_old`` where ``base = step * B`` is the
    first sample of the next global batch.  The new rank continues at
    ``base + rank * B / W_new``.  Raises if the old cursors are inconsistent.
    """
    old_w = len(states)
    base = int(states[0]["next_sample"])
    expected = [base + r * (global_batch // old_w) for r in range(old_w)]
    got = [int(s["next_sample"]) for s in states]
    if got != expected or base % global_batch != 0:
        raise ValueError(f"inconsistent saved data cursors {got}, expected {expected}")
    return {"next_sample": base + rank * (global_batch // world_size)}


def reshard_rng(states: list, rank: int, world_size: int) -> object:
    """RNG streams across a world-size change: rank ``r`` keeps old rank ``r``'s
    stream; new ranks beyond the old world size continue old rank ``r % W_old``'s.
    (Training here draws no random numbers: no dropout.)"""
    return states[rank % len(states)]


# --------------------------------------------------------------------------- #
# Schedule
# --------------------------------------------------------------------------- #
def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at ``total`` steps.  ``step`` counts completed optimizer steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
def log0(*args) -> None:
    if dist.get_rank() == 0:
        print("[train]", *args, flush=True)


def gather_all(x):
    """All ranks' value of the picklable ``x`` (collective), as a list indexed by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def dump_full_state(path: str, model: nn.Module, optim: torch.optim.Optimizer, extra: dict) -> float:
    """Collective.  Gather the full (unsharded) model + optimizer state on rank 0 and
    ``torch.save`` it to ``path`` together with ``extra``.  Returns seconds taken."""
    t0 = time.perf_counter()
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optim, options=opts)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save({"model": msd, "optim": osd, **extra}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()
    return time.perf_counter() - t0


def time_torch_save(model: nn.Module, optim: torch.optim.Optimizer, sched, scratch_dir: str) -> tuple[float, float]:
    """Seconds a plain synchronous checkpoint blocks this rank: take the sharded model
    and optimizer state dicts and ``torch.save`` them (+ scheduler state) to a private
    file (page cache, no fsync).  The file is deleted afterwards.

    Returns (total seconds, of which getting the state dicts)."""
    path = os.path.join(scratch_dir, f".torch_save_baseline_rank{dist.get_rank()}.pt")
    t0 = time.perf_counter()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "sched": sched.state_dict(),
    }
    t1 = time.perf_counter()
    torch.save(state, path)
    elapsed = time.perf_counter() - t0
    os.remove(path)
    return elapsed, t1 - t0


def engine_timings(handle) -> dict[str, float]:
    """The ``*_s`` fields of a save handle's stats (seconds), empty if it has none."""
    stats = getattr(handle, "stats", None)
    fields = vars(stats) if hasattr(stats, "__dict__") else {}
    return {k: float(v) for k, v in fields.items() if k.endswith("_s") and isinstance(v, (int, float))}


def write_json(path: str, obj: dict) -> None:
    """Atomically write ``obj`` as JSON (rank 0 only)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="final global step (optimizer steps)")
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every K steps (0: never)")
    p.add_argument("--root", required=True, help="checkpoint root directory")
    p.add_argument("--keep-last", type=int, default=3, help="committed checkpoints to keep")
    p.add_argument("--resume", action="store_true", help="load the latest committed checkpoint first")
    p.add_argument("--kill-at-step", type=int, default=None,
                   help="SIGKILL every rank right after ckpt.save(S) returns (S must be a checkpoint step)")
    p.add_argument("--dump-dir", default=None, help="write full-state dumps here (rank 0)")
    p.add_argument("--metrics", default=None, help="JSON file with losses and timings (rank 0)")
    p.add_argument("--batch", type=int, default=8, help="global batch size in sequences (divisible by 1, 2, 4)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=5, help="warmup steps")
    p.add_argument("--total-steps", type=int, default=None, help="cosine horizon (default: --steps)")
    p.add_argument("--corpus-mb", type=float, default=2.0, help="bytes of stdlib source to train on (MB)")
    p.add_argument("--torch-save-every", type=int, default=1,
                   help="time the torch.save baseline at every n-th checkpoint (0: never)")
    p.add_argument("--seed", type=int, default=1234)
    for f, default in asdict(GPTConfig()).items():
        p.add_argument("--" + f.replace("_", "-"), type=int, default=default)
    args = p.parse_args()
    if args.kill_at_step is not None and (not args.ckpt_every or args.kill_at_step % args.ckpt_every):
        p.error("--kill-at-step must be a multiple of --ckpt-every")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    # Model: identical init on every rank, then sharded (dim 0) by FSDP2.
    cfg = GPTConfig(**{f: getattr(args, f) for f in asdict(GPTConfig())})
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.total_steps or args.steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, partial(warmup_cosine, warmup=args.warmup, total=total))

    corpus = load_stdlib_corpus(int(args.corpus_mb * 2**20))
    cursor = RankCursor(StepOrderedSampler(corpus, cfg.block_size, args.seed), args.batch, rank, world)

    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": unickpt.RNGState(reshard=reshard_rng),
        "data": unickpt.PerRank(cursor, reshard=partial(reshard_cursor, global_batch=args.batch)),
        "step": 0,
    }
    log0(f"world_size={world} params={n_params / 1e6:.2f}M corpus={corpus.numel() / 2**20:.2f}MB "
         f"global_batch={args.batch}x{cfg.block_size} tokens/step={args.batch * cfg.block_size}")

    ckpt = unickpt.Checkpointer(args.root, keep_last=args.keep_last, async_save=True)
    metrics = {"world_size": world, "params": n_params, "args": vars(args),
               "losses": {}, "step_time_s": {}, "saves": [], "resumed_from_step": None}

    def dump(name: str, step: int) -> None:
        if args.dump_dir:
            # Rank 0's cursor is the first sample of the next global batch on any world size.
            extra = {"step": step, "sched": sched.state_dict(), "data_next_global_sample": cursor.next_sample}
            secs = dump_full_state(os.path.join(args.dump_dir, name), model, optim, extra)
            log0(f"dumped full state {name} ({secs:.2f} s)")

    start = 0
    if args.resume:
        t0 = time.perf_counter()
        loaded = ckpt.load(state)
        load_s = time.perf_counter() - t0
        if loaded is not None:
            start = int(state["step"])
            assert start == loaded, f"ckpt.load returned {loaded} but state['step'] is {start}"
            metrics.update(resumed_from_step=loaded, load_s=load_s)
            log0(f"resumed from step {loaded} in {load_s:.2f} s (world size now {world})")
            dump(f"resumed_step_{loaded}.pt", loaded)
        else:
            log0("no committed checkpoint found, starting from scratch")

    # The torch.save baseline writes next to the checkpoint root (same file system).
    scratch = os.path.dirname(os.path.abspath(args.root))
    os.makedirs(scratch, exist_ok=True)
    n_ckpt, handles = 0, []
    for step in range(start + 1, args.steps + 1):
        # Sanity: the data position is a function of the global step only.
        assert cursor.next_sample == (step - 1) * args.batch + rank * cursor.local_batch
        t0 = time.perf_counter()
        x, y = cursor.next_batch()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()  # FSDP2 reduce-scatters the mean gradient over ranks
        optim.step()
        sched.step()
        # Global mean loss (equal slice sizes: mean of the per-rank means).
        loss_sum = loss.detach().clone()
        dist.all_reduce(loss_sum)
        global_loss = loss_sum.item() / world
        dt = time.perf_counter() - t0
        metrics["losses"][str(step)] = global_loss
        metrics["step_time_s"][str(step)] = dt
        log0(f"step {step:4d} | loss {global_loss:.6f} | lr {sched.get_last_lr()[0]:.2e} | {dt:.2f} s")

        if args.ckpt_every and step % args.ckpt_every == 0:
            n_ckpt += 1
            state["step"] = step
            dump(f"step_{step}.pt", step)
            rec = {"step": step}
            if args.torch_save_every and (n_ckpt - 1) % args.torch_save_every == 0:
                dist.barrier()
                per_rank = gather_all(time_torch_save(model, optim, sched, scratch))
                rec["torch_save_ms_per_rank"] = [1e3 * total for total, _ in per_rank]
                rec["state_dict_ms_per_rank"] = [1e3 * sd for _, sd in per_rank]
            dist.barrier()
            t0 = time.perf_counter()
            handle = ckpt.save(step, state)
            stall = time.perf_counter() - t0
            if args.kill_at_step == step:
                dist.barrier()  # every rank's save() has returned; the write is in flight
                log0(f"SIGKILL at step {step} while its checkpoint is being written")
                os.kill(os.getpid(), signal.SIGKILL)
            rec["stall_ms_per_rank"] = [1e3 * s for s in gather_all(stall)]
            handles.append(handle)
            metrics["saves"].append(rec)
            ts = rec.get("torch_save_ms_per_rank")
            log0(f"checkpoint step {step}: save() blocked {max(rec['stall_ms_per_rank']):.1f} ms (max over ranks)"
                 + (f"; torch.save of the same state {max(ts):.1f} ms" if ts else ""))
        if rank == 0 and args.metrics:
            write_json(args.metrics, metrics)

    t0 = time.perf_counter()
    ckpt.wait()
    metrics["final_wait_s"] = time.perf_counter() - t0
    # The engine's own per-save timings (plan / stage / write / commit ...), now that all are done.
    all_ranks = gather_all([engine_timings(h) for h in handles])  # [rank][save] -> {name: s}
    for i, rec in enumerate(metrics["saves"]):
        names = all_ranks[0][i].keys()
        rec["engine_ms_per_rank"] = {n: [1e3 * r[i][n] for r in all_ranks] for n in names}
    metrics["latest_step"] = ckpt.latest_step()
    ckpt.close()
    metrics["final_step"] = args.steps
    if rank == 0 and args.metrics:
        write_json(args.metrics, metrics)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
