"""End-to-end unickpt demo: kill a 4-rank FSDP2 job mid-checkpoint, resume it on 2 ranks.

Run with ``make demo`` (``.venv/bin/python examples/run_demo.py``).  Phases:

1. reference: ``examples/train_gpt.py`` on 4 CPU ranks for ``--steps`` steps,
   checkpointing every ``--ckpt-every`` steps and dumping the full (unsharded)
   model + optimizer state at each checkpoint step.
2. killed: the same run on 4 ranks, SIGKILLed on every rank right after
   ``ckpt.save(--kill-at)`` returned, i.e. while that checkpoint is being written.
   Checked: ``step_<kill>/`` exists without ``metadata.json`` and the latest
   committed step is not the killed one.
3. resumed: 2 ranks, ``ckpt.load`` of the latest committed checkpoint
   (expected: ``kill - ckpt_every``), then training on to ``--steps``.
4. checks: the state right after the load is bitwise equal to the reference's
   state at that step, and the final loss matches the reference's within
   ``--loss-tol`` (only the floating-point reduction order differs between
   2 and 4 ranks).

Prints a table and writes ``report.json`` into the work directory; exits 1 if a
check fails.  Times: ``*_s`` seconds, ``*_ms`` milliseconds; losses in nats/byte.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train_gpt.py")


# --------------------------------------------------------------------------- #
# Launching
# --------------------------------------------------------------------------- #
def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(name: str, nproc: int, train_args: list[str], log_path: str, timeout_s: float) -> tuple[int, float]:
    """Run ``train_gpt.py`` under torchrun on ``nproc`` CPU ranks.

    The trainer's ``[train]`` lines are echoed, everything goes to ``log_path``.
    Returns (torchrun exit code, wall seconds).  On timeout the whole process
    group is killed and the exit code is -9.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), TRAIN, *train_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print(f"\n=== {name}: {nproc} ranks ===\n$ {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        timed_out = threading.Event()

        def kill_group() -> None:  # torchrun and its workers: their own session / process group
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        watchdog = threading.Timer(timeout_s, kill_group)
        watchdog.start()
        try:
            for line in proc.stdout:
                log.write(line)
                if line.startswith("[train]"):
                    print(f"  {name:>9} {line[8:]}", end="", flush=True)
            rc = proc.wait()
        except KeyboardInterrupt:
            kill_group()
            proc.wait()
            raise
        finally:
            watchdog.cancel()
    if timed_out.is_set():
        print(f"  {name}: timed out after {timeout_s:.0f} s, killed", flush=True)
        rc = -9
    wall = time.perf_counter() - t0
    print(f"  {name}: torchrun exit code {rc}, {wall:.1f} s", flush=True)
    return rc, wall


def dir_bytes(path: str) -> int:
    """Total size of the files under ``path`` (0 if it does not exist)."""
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)


def tail(path: str, n: int = 40) -> str:
    with open(path) as f:
        return "".join(f.readlines()[-n:])


# --------------------------------------------------------------------------- #
# Comparisons
# --------------------------------------------------------------------------- #
def bitwise_diff(a, b, path: str = "") -> list[str]:
    """Paths at which two nested states differ.  Tensors must match in dtype, shape
    and every byte (so NaN payloads and -0.0 vs 0.0 count); other leaves with ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        return [] if torch.equal(ab, bb) else [f"{path}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: missing on one side" for k in sorted(set(a) ^ set(b), key=str)]
        for k in sorted(set(a) & set(b), key=str):
            out += bitwise_diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in bitwise_diff(x, y, f"{path}[{i}]")]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} vs {b!r}"]


def count_tensor_bytes(obj) -> int:
    """Total bytes of all tensors in a nested state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(count_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensor_bytes(v) for v in obj)
    return 0


def median_of_max(saves: list[dict], key: str) -> float | None:
    """Median over checkpoint events of the slowest rank's time for ``key`` (ms)."""
    vals = [max(s[key]) for s in saves if key in s]
    return statistics.median(vals) if vals else None


def max_abs_diff(a, b) -> float | None:
    """Largest |a - b| over the floating-point tensors both nested states hold at the same path."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or not a.is_floating_point():
            return None
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict) and isinstance(b, dict):
        vals = [max_abs_diff(a[k], b[k]) for k in a.keys() & b.keys()]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None
    return None


def engine_breakdown(saves: list[dict]) -> dict[str, float]:
    """Median over checkpoints of the slowest rank's engine timing, per timing name (ms)."""
    names = {n for s in saves for n in s.get("engine_ms_per_rank", {})}
    return {n: statistics.median([max(s["engine_ms_per_rank"][n]) for s in saves
                                  if n in s.get("engine_ms_per_rank", {})])
            for n in sorted(names)}


def latest_committed_step(root: str) -> int | None:
    """The engine's view of the latest committed step, read from a fresh process
    (``unickpt.Checkpointer(root).latest_step()``)."""
    code = ("import sys, unickpt; c = unickpt.Checkpointer(sys.argv[1]); "
            "print(c.latest_step()); c.close()")
    out = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"latest_step() failed:\n{out.stderr}")
    last = out.stdout.strip().splitlines()[-1]
    return None if last == "None" else int(last)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #
def main() -> int:
    p = argparse.ArgumentParser(description="unickpt kill/reshard/resume demo")
    p.add_argument("--workdir", default=None, help="empty or new directory (default: a fresh dir under /tmp)")
    p.add_argument("--steps", type=int, default=40, help="final step of every run")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=30, help="checkpoint step at which the 4-rank run is killed")
    p.add_argument("--world", type=int, default=4, help="ranks of the reference and killed runs")
    p.add_argument("--resume-world", type=int, default=2, help="ranks of the resumed run")
    p.add_argument("--loss-tol", type=float, default=1e-4,
                   help="max |final loss(resumed) - final loss(reference)| in nats")
    p.add_argument("--timeout", type=float, default=300, help="per-run timeout (s)")
    p.add_argument("--keep", action="store_true",
                   help="keep checkpoints and full-state dumps (default: deleted when all checks pass)")
    args = p.parse_args()
    if args.kill_at % args.ckpt_every or not args.ckpt_every < args.kill_at < args.steps:
        p.error("--kill-at must be a checkpoint step after the first one and before --steps")

    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        if os.listdir(args.workdir):
            p.error(f"--workdir {args.workdir} is not empty")
        work = os.path.abspath(args.workdir)
    else:
        work = tempfile.mkdtemp(prefix="unickpt_demo_")
    d = {k: os.path.join(work, k) for k in ("reference", "killed", "resumed")}
    for v in d.values():
        os.makedirs(v)
    ref_root, run_root = os.path.join(d["reference"], "ckpt"), os.path.join(d["killed"], "ckpt")
    expected_resume = args.kill_at - args.ckpt_every
    common = ["--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every)]
    print(f"work dir: {work}")
    t_start = time.perf_counter()

    # 1. Reference run.
    rc_ref, wall_ref = torchrun(
        "reference", args.world,
        common + ["--root", ref_root, "--dump-dir", os.path.join(d["reference"], "dumps"),
                  "--metrics", os.path.join(d["reference"], "metrics.json")],
        os.path.join(d["reference"], "log.txt"), args.timeout)
    if rc_ref != 0:
        print(tail(os.path.join(d["reference"], "log.txt")))
        print("FAIL: reference run failed")
        return 1

    # 2. Same run, SIGKILLed while checkpoint `kill_at` is being written.
    killed_log = os.path.join(d["killed"], "log.txt")
    rc_kill, wall_kill = torchrun(
        "killed", args.world,
        common + ["--root", run_root, "--kill-at-step", str(args.kill_at),
                  "--metrics", os.path.join(d["killed"], "metrics.json")],
        killed_log, args.timeout)
    with open(killed_log) as f:
        killed_by_signal = f"SIGKILL at step {args.kill_at}" in f.read()
    killed_dir = os.path.join(run_root, f"step_{args.kill_at}")
    killed_dir_exists = os.path.isdir(killed_dir)
    killed_dir_files = sorted(os.listdir(killed_dir)) if killed_dir_exists else []
    killed_dir_bytes = dir_bytes(killed_dir)
    killed_during_write = killed_dir_exists and not os.path.exists(os.path.join(killed_dir, "metadata.json"))
    committed_dirs = sorted(n for n in (os.listdir(run_root) if os.path.isdir(run_root) else [])
                            if os.path.exists(os.path.join(run_root, n, "metadata.json")))
    if rc_kill == 0 or not killed_by_signal:
        print(tail(killed_log))
    print(f"  killed: torchrun reported failure as expected: {rc_kill != 0}; "
          f"step_{args.kill_at}/ exists: {killed_dir_exists} ({killed_dir_bytes / 2**20:.1f} MiB written), "
          f"metadata.json absent: {killed_during_write}; committed: {committed_dirs}")
    latest_file = None
    if os.path.exists(os.path.join(run_root, "latest")):
        with open(os.path.join(run_root, "latest")) as f:
            latest_file = f.read().strip()
    try:
        latest_after_kill = latest_committed_step(run_root)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"  killed: {e}")
        latest_after_kill = None
    latest_ok = (latest_after_kill not in (None, args.kill_at)
                 and latest_file != f"step_{args.kill_at}")
    print(f"  killed: latest committed step according to unickpt: {latest_after_kill} "
          f"(root/latest file: {latest_file!r})")

    # 3. Resume on a different world size from the latest committed checkpoint.
    rc_res, wall_res = torchrun(
        "resumed", args.resume_world,
        common + ["--root", run_root, "--resume", "--dump-dir", os.path.join(d["resumed"], "dumps"),
                  "--metrics", os.path.join(d["resumed"], "metrics.json")],
        os.path.join(d["resumed"], "log.txt"), args.timeout)
    if rc_res != 0:
        print(tail(os.path.join(d["resumed"], "log.txt")))

    # 4. Checks.
    with open(os.path.join(d["reference"], "metrics.json")) as f:
        ref = json.load(f)
    res = {}
    if rc_res == 0:
        with open(os.path.join(d["resumed"], "metrics.json")) as f:
            res = json.load(f)
    resumed_from = res.get("resumed_from_step")

    diffs, state_bytes = ["resumed run produced no dump"], 0
    ref_dump = os.path.join(d["reference"], "dumps", f"step_{resumed_from}.pt")
    res_dump = os.path.join(d["resumed"], "dumps", f"resumed_step_{resumed_from}.pt")
    if resumed_from is not None and os.path.exists(ref_dump) and os.path.exists(res_dump):
        a = torch.load(ref_dump, weights_only=True)
        b = torch.load(res_dump, weights_only=True)
        diffs, state_bytes = bitwise_diff(a, b), count_tensor_bytes(a)
    state_equal = not diffs

    # Informational: how far apart the final states of the 2-rank and 4-rank runs are.
    final_state_diff = None
    ref_final = os.path.join(d["reference"], "dumps", f"step_{args.steps}.pt")
    res_final = os.path.join(d["resumed"], "dumps", f"step_{args.steps}.pt")
    if os.path.exists(ref_final) and os.path.exists(res_final):
        final_state_diff = max_abs_diff(torch.load(ref_final, weights_only=True),
                                        torch.load(res_final, weights_only=True))

    final = str(args.steps)
    loss_ref = ref["losses"].get(final)
    loss_res = res.get("losses", {}).get(final)
    loss_diff = abs(loss_ref - loss_res) if loss_res is not None else None
    steps_after = [s for s in res.get("losses", {}) if s in ref["losses"]]
    max_loss_diff = max((abs(ref["losses"][s] - res["losses"][s]) for s in steps_after), default=None)

    checks = {
        "reference run succeeded": rc_ref == 0,
        "killed run died by SIGKILL after save() returned": rc_kill != 0 and killed_by_signal,
        "killed step dir exists without metadata.json": killed_during_write,
        "latest committed step is not the killed one": latest_ok,
        "resumed run succeeded": rc_res == 0,
        f"resumed from step {expected_resume}": resumed_from == expected_resume,
        "loaded state bitwise equal to reference": state_equal,
        f"final loss within {args.loss_tol:g} of reference": loss_diff is not None and loss_diff <= args.loss_tol,
    }
    total_wall = time.perf_counter() - t_start
    ref_steps = [v for k, v in ref["step_time_s"].items() if int(k) > 1]  # step 1 includes warm-up
    report = {
        "saved_world_size": args.world,
        "resumed_world_size": args.resume_world,
        "killed_at_step": args.kill_at,
        "killed_during_write": killed_during_write,
        "killed_step_dir_entries": killed_dir_files,
        "killed_step_bytes_on_disk": killed_dir_bytes,
        "latest_file_after_kill": latest_file,
        "latest_step_after_kill": latest_after_kill,
        "resumed_from_step": resumed_from,
        "state_bitwise_equal": state_equal,
        "state_bytes_compared": state_bytes,
        "state_diffs": diffs[:20],
        "final_step": args.steps,
        "loss_reference": loss_ref,
        "loss_resumed": loss_res,
        "loss_abs_diff": loss_diff,
        "loss_max_abs_diff_resumed_steps": max_loss_diff,
        "final_state_max_abs_diff": final_state_diff,
        "loss_tolerance": args.loss_tol,
        "loss_tolerance_note": "absolute, nats/byte; 2 vs 4 ranks differ only in float reduction order",
        "stall_ms_median": median_of_max(ref["saves"], "stall_ms_per_rank"),
        "torch_save_ms_median": median_of_max(ref["saves"], "torch_save_ms_per_rank"),
        "state_dict_ms_median": median_of_max(ref["saves"], "state_dict_ms_per_rank"),
        "timing_note": ("per checkpoint of the reference run, slowest rank; stall = time ckpt.save() blocked "
                        "the training loop; torch_save = get sharded state dicts + torch.save to a local "
                        "file (page cache, no fsync) of the same state on each rank"),
        "engine_timings_ms_median": engine_breakdown(ref["saves"]),
        "saves_reference": ref["saves"],
        "params": ref["params"],
        "timings": {
            "total_s": total_wall,
            "reference_run_s": wall_ref,
            "killed_run_s": wall_kill,
            "resumed_run_s": wall_res,
            "reference_step_s_median": statistics.median(ref_steps) if ref_steps else None,
            "resumed_step_s_median": statistics.median(
                [v for k, v in res.get("step_time_s", {}).items()]) if res.get("step_time_s") else None,
            "load_s": res.get("load_s"),
            "reference_final_wait_s": ref.get("final_wait_s"),
        },
        "checks": checks,
        "passed": all(checks.values()),
        "workdir": work,
    }
    report_path = os.path.join(work, "report.json")
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)

    def fmt(x, spec):
        return "n/a" if x is None else format(x, spec)

    print("\n=== unickpt demo summary ===")
    rows = [
        ("model parameters", f"{ref['params'] / 1e6:.2f} M"),
        ("saved on / resumed on", f"{args.world} ranks / {args.resume_world} ranks"),
        ("killed at step (mid-write)", f"{args.kill_at} ({'yes' if killed_during_write else 'NO'})"),
        ("resumed from step", fmt(resumed_from, "d")),
        ("loaded state bitwise equal", f"{state_equal} ({state_bytes / 2**20:.1f} MiB of tensors)"),
        (f"loss at step {args.steps}: reference", fmt(loss_ref, ".6f")),
        (f"loss at step {args.steps}: resumed", fmt(loss_res, ".6f")),
        ("|diff| (tolerance)", f"{fmt(loss_diff, '.2e')} ({args.loss_tol:g})"),
        ("ckpt.save() stall, median", f"{fmt(report['stall_ms_median'], '.1f')} ms"),
        ("  engine: plan / stage / total", " / ".join(
            f"{fmt(report['engine_timings_ms_median'].get(n), '.1f')}" for n in ("plan_s", "stage_s", "total_s"))
            + " ms (total = call to commit)"),
        ("torch.save same state, median", f"{fmt(report['torch_save_ms_median'], '.1f')} ms"),
        ("  of which get state dicts", f"{fmt(report['state_dict_ms_median'], '.1f')} ms"),
        ("final-state max |diff| (info)", fmt(final_state_diff, ".2e")),
        ("wall time", f"{total_wall:.1f} s (ref {wall_ref:.1f}, killed {wall_kill:.1f}, resumed {wall_res:.1f})"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print("\nchecks:")
    for k, ok in checks.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {k}")
    if diffs and not state_equal:
        print("  first state differences:", *diffs[:5], sep="\n    ")
    if report["passed"] and not args.keep:  # ~1 GB of checkpoints and dumps; keep logs and metrics
        for sub in ("ckpt", "dumps"):
            for v in d.values():
                shutil.rmtree(os.path.join(v, sub), ignore_errors=True)
        print("\n(checkpoints and dumps deleted; rerun with --keep to keep them)")
    print(f"\nreport: {report_path}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
