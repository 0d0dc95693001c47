"""Hugging Face Trainer: the training stall of a checkpoint save, Trainer's own against unickpt's
(``unickpt.transformers``), and the resumed run's losses.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_save.py [--quick] --out benchmarks/results/trainer_save.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_save.py --fsdp --out benchmarks/results/trainer_save_fsdp2.json

A random ``LlamaForCausalLM`` (about 0.54 GB of fp32 weights: hidden 768, 9 layers, vocab 32000; AdamW
doubles it) trained by ``Trainer`` on 2 CPU processes (torchrun, gloo DDP) for 40 steps, a checkpoint
every 5 (8 saves; ``tests/plugins/transformers/trainer_worker.py``); ``--quick``: a 0.1 GB model.

Runs, one after another on this machine: ``trainer`` (Trainer's own save), ``unickpt`` (the same
script with ``unickpt.transformers`` on), ``resume-2`` (from unickpt's ``checkpoint-35`` on 2
processes, 5 more steps), ``resume-3`` (the same checkpoint on 3 processes: the optimizer resharded).

Stall of a save = the seconds of the ``_save_checkpoint`` call + the excess of the next step over the
median step without a save before it (an overlap snapshot's copy is waited for in the next
``optimizer.step()``). ``train_s``: the whole ``train()`` call, which waits for pending saves.
``stall_ratio``: Trainer's median stall over unickpt's median stall (8 saves each); the first two
saves are also reported alone (``first_stalls_s``: each allocates and faults in one of the engine's two
staging rings, which later saves reuse, and on these 2 cores the copy competes with the training
processes for the CPU). Checks: the resumed run's losses of steps 36-40 equal (bitwise) the
uninterrupted unickpt run's, and the uninterrupted runs' losses equal each other (saving changes
nothing of the run).

``--fsdp``: the same model under FSDP2 (Accelerate's state switched to FSDP on the CPU, as
``trainer_worker.py --fsdp`` does), 20 steps, a save every 5 (4 saves). Runs: ``trainer-full`` (Trainer's
own ``FULL_STATE_DICT`` save: the weights gathered into ``model.safetensors`` on process 0, the optimizer
gathered too, synchronously), ``trainer-sharded`` (Trainer's own ``SHARDED_STATE_DICT``: DCP, synchronous,
no ``model.safetensors``), ``unickpt`` (``SHARDED_STATE_DICT`` with the plugin: each weight gathered into
one process's safetensors file in the background, the optimizer sharded), ``resume-2`` (from unickpt's
``checkpoint-15``, FSDP2 on 2 processes). ``stall_ratio`` is Trainer's ``FULL_STATE_DICT`` median stall (the
save that gives ``from_pretrained`` files, as unickpt's does) over unickpt's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "plugins", "transformers", "trainer_worker.py")


def run(nproc: int, out: str, *args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), WORKER, out,
           *args]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    with open(os.path.join(out, f"losses-{nproc}.json")) as f:
        got = json.load(f)
    got["wall_s"] = time.perf_counter() - t0
    return got


def stalls(result: dict, save_steps: int) -> list[float]:
    steps = {int(k): v for k, v in result["step_s"].items()}
    saved = [s for s in steps if s % save_steps == 0]
    plain = [v for s, v in steps.items() if (s - 1) not in saved and s != min(steps)]
    base = statistics.median(plain)
    out = []
    for call, s in zip(result["stalls"], saved):
        out.append(call + max(0.0, steps.get(s + 1, base) - base))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=None, help="where the runs write (default: a temporary directory)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP (see the module docstring)")
    a = ap.parse_args()
    if a.fsdp:
        return fsdp_main(a)
    a.out = a.out or os.path.join(ROOT, "benchmarks", "results", "trainer_save.json")
    size = ["--hidden", "384", "--layers", "4", "--vocab", "16000"] if a.quick else \
        ["--hidden", "768", "--layers", "9", "--vocab", "32000"]
    common = [*size, "--batch", "1", "--seq", "16", "--max-steps", "40", "--save-steps", "5"]
    work = tempfile.mkdtemp(prefix="trainer-bench-", dir=a.dir)
    try:
        own = run(2, os.path.join(work, "trainer"), *common)
        ours = run(2, os.path.join(work, "unickpt"), *common, "--unickpt")
        resumed = {}
        for n in (2, 3):
            d = os.path.join(work, f"resume-{n}")
            os.makedirs(d)
            shutil.copytree(os.path.join(work, "unickpt", "checkpoint-35"), os.path.join(d, "checkpoint-35"))
            resumed[n] = run(n, d, *common, "--unickpt", "--resume", "last")
        ckpt = os.path.join(work, "unickpt", "checkpoint-40")
        files = sorted(os.listdir(ckpt))
        nbytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(ckpt) for f in fs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    own_stall, our_stall = stalls(own, 5), stalls(ours, 5)
    tail = {k: v for k, v in ours["losses"].items() if int(k) > 35}
    record = {
        "benchmark": "trainer_save", "quick": a.quick, "processes": 2, "params": ours["params"],
        "weights_bytes": 4 * ours["params"], "checkpoint_bytes": nbytes, "checkpoint_files": files,
        "trainer": {"stall_s": own_stall, "save_call_s": own["stalls"], "train_s": own["train_s"],
                    "median_step_s": statistics.median(own["step_s"].values())},
        "unickpt": {"stall_s": our_stall, "save_call_s": ours["stalls"], "train_s": ours["train_s"],
                    "median_step_s": statistics.median(ours["step_s"].values())},
        "stall_ratio": statistics.median(own_stall) / max(1e-9, statistics.median(our_stall)),
        "first_stalls_s": {"trainer": own_stall[:2], "unickpt": our_stall[:2]},
        "steady_stall_ratio": statistics.median(own_stall[2:]) / max(1e-9, statistics.median(our_stall[2:])),
        "median_stall_s": {"trainer": statistics.median(own_stall), "unickpt": statistics.median(our_stall)},
        "same_losses_as_trainer": ours["losses"] == own["losses"],
        "resume_2_losses_equal": resumed[2]["losses"] == tail,
        "resume_3_steps": sorted(int(k) for k in resumed[3]["losses"]),
        "resume_3_losses": resumed[3]["losses"], "losses": ours["losses"],
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: record[k] for k in ("params", "stall_ratio", "same_losses_as_trainer", "resume_2_losses_equal",
                                             "resume_3_steps")}))
    print("trainer stall_s", [round(s, 3) for s in own_stall], "unickpt stall_s", [round(s, 3) for s in our_stall])


def fsdp_main(a: argparse.Namespace) -> None:
    size = ["--hidden", "384", "--layers", "4", "--vocab", "16000"] if a.quick else \
        ["--hidden", "768", "--layers", "9", "--vocab", "32000"]
    common = [*size, "--batch", "1", "--seq", "16", "--max-steps", "20", "--save-steps", "5"]
    out = a.out or os.path.join(ROOT, "benchmarks", "results", "trainer_save_fsdp2.json")
    work = tempfile.mkdtemp(prefix="trainer-bench-fsdp-", dir=a.dir)
    try:
        full = run(2, os.path.join(work, "trainer-full"), *common, "--fsdp", "FULL_STATE_DICT")
        sharded = run(2, os.path.join(work, "trainer-sharded"), *common, "--fsdp", "SHARDED_STATE_DICT")
        ours = run(2, os.path.join(work, "unickpt"), *common, "--fsdp", "SHARDED_STATE_DICT", "--unickpt")
        d = os.path.join(work, "resume-2")
        os.makedirs(d)
        shutil.copytree(os.path.join(work, "unickpt", "checkpoint-15"), os.path.join(d, "checkpoint-15"))
        resumed = run(2, d, *common, "--fsdp", "SHARDED_STATE_DICT", "--unickpt", "--resume", "last")
        ckpt = os.path.join(work, "unickpt", "checkpoint-20")
        files = sorted(os.listdir(ckpt))
        nbytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(ckpt) for f in fs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    st = {name: stalls(r, 5) for name, r in (("trainer_full", full), ("trainer_sharded", sharded), ("unickpt", ours))}
    record = {
        "benchmark": "trainer_save_fsdp2", "quick": a.quick, "processes": 2, "params": ours["params"],
        "weights_bytes": 4 * ours["params"], "checkpoint_bytes": nbytes, "checkpoint_files": files,
        **{name: {"stall_s": st[name], "save_call_s": r["stalls"], "train_s": r["train_s"],
                  "median_step_s": statistics.median(r["step_s"].values())}
           for name, r in (("trainer_full", full), ("trainer_sharded", sharded), ("unickpt", ours))},
        "median_stall_s": {name: statistics.median(v) for name, v in st.items()},
        "stall_ratio": statistics.median(st["trainer_full"]) / max(1e-9, statistics.median(st["unickpt"])),
        "stall_ratio_vs_sharded": statistics.median(st["trainer_sharded"]) / max(1e-9, statistics.median(st["unickpt"])),
        "same_losses_as_trainer": ours["losses"] == full["losses"] == sharded["losses"],
        "resume_2_losses_equal": resumed["losses"] == {k: v for k, v in ours["losses"].items() if int(k) > 15},
        "losses": ours["losses"],
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: record[k] for k in ("params", "median_stall_s", "stall_ratio", "stall_ratio_vs_sharded",
                                             "same_losses_as_trainer", "resume_2_losses_equal")}))


if __name__ == "__main__":
    main()
