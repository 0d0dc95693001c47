"""Changing the DP size of a DeepSpeed ZeRO checkpoint: DeepSpeed's universal checkpoint vs unickpt.

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_vs_universal.py [--stages 2,3] [--width 1024] [--layers 4]

1. ``torchrun`` 2 ranks: one ZeRO engine trains 2 steps, then saves the same state twice: with
   DeepSpeed's own checkpoint engine (``zero_pp_rank_*_optim_states.pt``) and with unickpt (the
   plugin's ``UnickptCheckpointEngine`` swapped in), and gathers the full reference state
   (parameters, fp32 master, ``exp_avg``, ``exp_avg_sq``) with DeepSpeed's ``safe_get_full_*`` APIs.
2. ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state`` converts the native one
   (timed: the offline step DeepSpeed needs before a different DP size can load it).
3. ``torchrun`` 3 ranks: an engine with ``"checkpoint": {"load_universal": true}`` loads the converted
   checkpoint, and an engine with the ``"unickpt"`` block loads unickpt's; both gathered states are
   compared with the reference (bitwise equal, and the largest absolute difference).

Writes ``benchmarks/results/deepspeed_vs_universal.json`` (one entry per ZeRO stage). Times are wall-clock seconds on this machine
(a shared 2-core CPU host when the numbers in the results file were taken), rank 0's view.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(ROOT, "benchmarks", "results", "deepspeed_vs_universal.json")


# -- worker (under torchrun) -------------------------------------------------------------------------
def _model(width: int, layers: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width + 1), nn.GELU(), nn.Linear(width + 1, width)]
    return nn.Sequential(*mods)


def _config(stage: int, *, unickpt: bool, universal: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if unickpt:
        cfg["unickpt"] = {"enabled": True, "async_save": False}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _compare(got: dict, want: dict) -> dict:
    import torch

    equal, worst, worst_key = True, 0.0, None
    for k, w in want.items():
        g = got[k]
        if not torch.equal(g, w):
            equal = False
            d = (g.float() - w.float()).abs().max().item()
            if d >= worst:
                worst, worst_key = d, k
    return {"bitwise_equal": equal, "max_abs_diff": worst, "worst_tensor": worst_key}


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from unickpt.deepspeed.config import UnickptConfig
    from unickpt.deepspeed.checkpoint_engine import UnickptCheckpointEngine

    sys.path.append(os.path.join(ROOT, "tests", "plugins", "deepspeed"))  # the tests' helper, shared
    from ds_gather import gather_params  # the full state by DeepSpeed's safe_get_full_* APIs

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    res = {}

    def timed(fn):
        dist.barrier()
        t = time.perf_counter()
        out = fn()
        dist.barrier()
        return out, time.perf_counter() - t

    if args.phase == "save":
        model = _model(args.width, args.layers)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(args.stage, unickpt=False, universal=False))
        for s in range(2):
            g = torch.Generator().manual_seed(s * 100 + rank)
            loss = engine(torch.randn(2, args.width, generator=g)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        _, res["native_save_s"] = timed(lambda: engine.save_checkpoint(os.path.join(args.work, "native"), tag="t"))
        engine.checkpoint_engine = UnickptCheckpointEngine(engine._config, UnickptConfig(enabled=True, async_save=False))
        _, res["unickpt_save_s"] = timed(lambda: engine.save_checkpoint(os.path.join(args.work, "unickpt"), tag="t"))
        # the default, async: the call blocks only while the state is copied into host memory
        engine.checkpoint_engine = UnickptCheckpointEngine(engine._config, UnickptConfig(enabled=True, async_save=True))
        _, res["unickpt_async_save_call_s"] = timed(
            lambda: engine.save_checkpoint(os.path.join(args.work, "unickpt_async"), tag="t"))
        res["unickpt_async_stall_s_rank0"] = engine.checkpoint_engine.last_save.stats.stall_s
        _, res["unickpt_async_until_committed_s"] = timed(engine.checkpoint_engine.finish_pending)
        ref = gather_params(engine)
        if rank == 0:
            torch.save(ref, os.path.join(args.work, "ref.pt"))
            res["params"] = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    else:
        ref = torch.load(os.path.join(args.work, "ref.pt"), weights_only=True)
        for which, cfg, load_dir in (
                ("universal", _config(args.stage, unickpt=False, universal=True), "native"),
                ("unickpt", _config(args.stage, unickpt=True, universal=False), "unickpt")):
            model = _model(args.width, args.layers)
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            _, res[f"{which}_load_s"] = timed(lambda: engine.load_checkpoint(os.path.join(args.work, load_dir)))
            res[f"{which}_vs_saved"] = _compare(gather_params(engine), ref)
            if which == "unickpt":
                st = engine.checkpoint_engine.last_load_stats
                res["unickpt_load_stats_rank0"] = {k: getattr(st, k) for k in ("plan_s", "read_s", "copy_s", "total_s",
                                                                                 "bytes_read", "reads")}
            engine.destroy()
    if rank == 0:
        with open(os.path.join(args.work, f"{args.phase}.json"), "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


# -- driver ------------------------------------------------------------------------------------------
def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default="2,3", help="ZeRO stages to run, comma-separated")
    p.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--save-world", type=int, default=2)
    p.add_argument("--load-world", type=int, default=3)
    p.add_argument("--out", default=RESULT)
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        worker(args)
        return
    results = {f"zero{stage}": run_stage(args, int(stage)) for stage in args.stages.split(",")}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


def run_stage(args, stage: int) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    work = tempfile.mkdtemp(prefix="ds_vs_universal_")
    common = [__file__, "--stage", str(stage), "--width", str(args.width), "--layers", str(args.layers),
              "--work", work]

    def torchrun(n: int, phase: str) -> dict:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *common,
               "--phase", phase]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{phase} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        return json.load(open(os.path.join(work, f"{phase}.json")))

    try:
        res = {"stage": stage, "save_world": args.save_world, "load_world": args.load_world}
        res.update(torchrun(args.save_world, "save"))
        t = time.perf_counter()
        conv = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               os.path.join(work, "native", "t"), "--output_folder",
                               os.path.join(work, "native", "t_universal"), "--inject_missing_state"],
                              env=env, capture_output=True, text=True)
        res["ds_to_universal_s"] = time.perf_counter() - t
        if conv.returncode != 0:
            sys.exit(f"ds_to_universal failed:\n{conv.stderr[-5000:]}")
        with open(os.path.join(work, "native", "latest_universal"), "w") as f:
            f.write("t_universal")
        res["bytes_native"] = _du(os.path.join(work, "native", "t"))
        res["bytes_universal"] = _du(os.path.join(work, "native", "t_universal"))
        res["bytes_unickpt"] = _du(os.path.join(work, "unickpt", "t"))
        res.update(torchrun(args.load_world, "load"))
        res["universal_total_s"] = res["ds_to_universal_s"] + res["universal_load_s"]
        res["host_loadavg_1m"] = os.getloadavg()[0]  # the host is shared: read the times with this in mind
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
