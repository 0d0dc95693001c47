"""torchrun worker: DeepSpeed ZeRO-2 (fp32, the "unickpt" JSON block) -> FSDP2 with resharding.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 ds_fsdp2.py ds OUT      20 steps, save, 10 more (the reference)
    torchrun --nproc_per_node=3 ds_fsdp2.py fsdp2 OUT                      load the step-20 checkpoint, 10 steps

``ds`` writes ``OUT/ds.json`` (losses of steps 1-30) and ``OUT/saved.pt`` (the full state at step 20,
gathered by DeepSpeed's own ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, and the LR).
``fsdp2`` loads ``OUT/ckpt`` (the DeepSpeed ``save_dir``) with ``unickpt.load(..., mapping="auto")`` into
a plain FSDP2 model, optimizer and LambdaLR, writes ``OUT/loaded.pt`` (its full state right after the load,
gathered by torch's full-state-dict API) and ``OUT/fsdp2.json`` (losses of steps 21-30, each rank's bytes
read by an unverified load and its shards' size, the errors of targets that cannot take the checkpoint,
a weights-only load).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cross_common import (BETAS, EPS, LR, WEIGHT_DECAY, batch, compare, full_state, global_mean, loss_fn,  # noqa: E402
                          lr_lambda, make_net, write)

torch.set_num_threads(1)
mode, out = sys.argv[1], sys.argv[2]
SAVE_AT, END = 20, 30


def run_deepspeed() -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model = make_net()
    cfg = {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                     "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
           "zero_optimization": {"stage": 2}, "unickpt": {"enabled": True, "async_save": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(1, END + 1):
        x, y = batch(step, rank, world)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(global_mean(loss))
        if step == SAVE_AT:
            engine.save_checkpoint(os.path.join(out, "ckpt"))
            saved = {}
            for name, p in engine.module.named_parameters():
                saved[f"param.{name}"] = safe_get_full_fp32_param(p).clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    saved[f"{key}.{name}"] = safe_get_full_optimizer_state(p, key).clone()
            saved["param.scale"] = engine.module.scale.clone()
            base = engine.optimizer.optimizer
            steps = {float(s["step"]) for s in base.state.values()}
            meta = {"steps": sorted(steps), "lr": [g["lr"] for g in base.param_groups],
                    "sched": {k: v for k, v in engine.lr_scheduler.state_dict().items() if k != "lr_lambdas"},
                    "global_steps": engine.global_steps}
            if rank == 0:
                torch.save({"tensors": saved, "meta": meta}, os.path.join(out, "saved.pt"))
    # a checkpoint of another framework is refused by name (DeepSpeed engines load DeepSpeed checkpoints only)
    import unickpt

    other = os.path.join(out, "other")
    unickpt.save(os.path.join(other, "plain"), {"model": make_net()})
    try:
        engine.load_checkpoint(other, tag="plain")
        refused = None
    except unickpt.StateMismatchError as e:
        refused = str(e)
    engine.destroy()  # waits for the save in flight
    if rank == 0:
        write(os.path.join(out, "ds.json"), {"losses": losses, "refused": refused})


def sharded_net(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_net(seed=123).to(dtype)  # other values: everything must come from the checkpoint
    for layer in model.body:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def run_fsdp2() -> None:
    import unickpt

    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(out, "ckpt")  # the DeepSpeed save_dir: its `latest` names the tag
    model = sharded_net()
    optim = adamw(model)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda)
    state = {"model": model, "optim": optim, "scheduler": sched, "step": 0}
    stats = unickpt.load(ckpt, state, mapping="auto")
    # the same load without checksum verification (no widening of reads to whole checksum blocks): this
    # rank reads exactly its shards' bytes of the fp32 master weights, exp_avg and exp_avg_sq, plus the
    # (replicated) buffer
    exact = unickpt.load(ckpt, {"model": model, "optim": optim, "scheduler": sched, "step": 0}, mapping="auto",
                         verify=False)
    local = sum(p.to_local().numel() for p in model.parameters())
    read = [None] * world
    dist.all_gather_object(read, (exact.bytes_read, local))
    loaded = full_state(model, optim)
    steps = sorted({float(v) for k, v in loaded.items() if k.startswith("step.")})
    if rank == 0:
        torch.save({"tensors": {k: v for k, v in loaded.items() if not k.startswith("step.")},
                    "meta": {"steps": steps, "lr": [g["lr"] for g in optim.param_groups],
                             "sched": {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"},
                             "step": state["step"], "conversion": stats.conversion}},
                   os.path.join(out, "loaded.pt"))
    losses = []
    for step in range(state["step"] + 1, state["step"] + 11):
        x, y = batch(step, rank, world)
        loss = loss_fn(model(x), y)
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    errors = {}
    for name, make in BAD_TARGETS.items():  # what cannot move is refused by name, on every rank, before any byte lands
        target = make()
        before = full_state(target["model"], target["optim"]) if "optim" in target else None
        try:
            unickpt.load(ckpt, target, mapping="auto")
            errors[name] = None
        except unickpt.StateMismatchError as e:
            errors[name] = str(e)
        if before is not None:
            errors[name + ".untouched"] = not compare(before, full_state(target["model"], target["optim"]))
    # a layer of another size: refused, and the fresh AdamW has no state afterwards (looked at before anything
    # else reads it: torch's full-state-dict API would create its state), the parameters bitwise as they were
    target = _other_layer_size()
    params = {n: p.full_tensor().clone() for n, p in target["model"].named_parameters()}
    try:
        unickpt.load(ckpt, target, mapping="auto")
        errors["layer_size"] = None
    except unickpt.StateMismatchError as e:
        errors["layer_size"] = str(e)
    errors["layer_size.optim_empty"] = len(target["optim"].state) == 0
    errors["layer_size.untouched"] = not compare(params, {n: p.full_tensor() for n, p in
                                                          target["model"].named_parameters()})
    weights_only = sharded_net()
    unickpt.load(ckpt, {"model": weights_only}, mapping="auto")  # evaluation: the optimizer state stays behind
    same_weights = not compare({k: v for k, v in loaded.items() if k.startswith("param.")},
                               {k: v for k, v in full_state(weights_only, adamw(weights_only)).items()
                                if k.startswith("param.")})
    every_rank = [None] * world
    dist.all_gather_object(every_rank, errors)
    if rank == 0:
        write(os.path.join(out, "fsdp2.json"), {"losses": losses, "read": read, "total_numel":
                                                sum(p.numel() for p in model.parameters()), "errors": errors,
                                                "errors_every_rank": all(e == errors for e in every_rank),
                                                "weights_only_equal": same_weights})


def _sgd() -> dict:
    model = sharded_net()
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)}


def _no_scheduler() -> dict:
    model = sharded_net()
    return {"model": model, "optim": adamw(model)}


def _bf16() -> dict:
    model = sharded_net(torch.bfloat16)
    optim = adamw(model)
    return {"model": model, "optim": optim, "scheduler": torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda)}


def _other_scheduler() -> dict:
    model = sharded_net()
    optim = adamw(model)
    return {"model": model, "optim": optim, "scheduler": torch.optim.lr_scheduler.StepLR(optim, 5)}


def _other_layer_size() -> dict:
    from torch.distributed.fsdp import fully_shard

    model = make_net(seed=123)
    model.body[2] = torch.nn.Linear(33, 20)  # 24 -> 20 outputs, and the next layer takes 20
    model.body[4] = torch.nn.Linear(20, 4)
    for layer in model.body:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = adamw(model)
    return {"model": model, "optim": optim, "scheduler": torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda)}


BAD_TARGETS = {"sgd": _sgd, "no_scheduler": _no_scheduler, "bf16": _bf16, "other_scheduler": _other_scheduler}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    {"ds": run_deepspeed, "fsdp2": run_fsdp2}[mode]()
    dist.destroy_process_group()
