"""torchrun worker for tests/plugins/deepspeed/test_deepspeed_pipeline.py: DeepSpeed pipeline engines
(``PipelineModule``, ``train_batch``) and ``checkpoint.tag_validation`` on CPU (gloo) through unickpt.

  DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tests/plugins/deepspeed/ds_pipeline_workers.py pipe OUT 2x1 1x2,2x1
  DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tests/plugins/deepspeed/ds_pipeline_workers.py tags OUT

``pipe OUT SAVE LOADS``: per config, a ``PIPExDP`` pipeline engine trains 2 batches, saves (async), its
full state is gathered (reference, every stage's parameters by name), it trains a 3rd batch (the
uninterrupted run); then fresh engines of each layout in ``LOADS`` load the checkpoint: their gathered
state must equal the reference bitwise, and on the save layout the 3rd batch's loss and the state after
it must equal the uninterrupted run's bitwise. The model has a tied layer (``TiedLayerSpec``) on the
first and last stage. Prints ``OK pipe <config> <save>-><load>`` per config and layout.

``tags OUT``: ``checkpoint.tag_validation`` FAIL / WARN / IGNORE with a different tag on each rank
(DeepSpeed's ``test_checkpoint_unique_tag``). Prints ``OK tags <mode>``. Then a pipeline topology with
a model-parallel axis, refused by ``deepspeed.initialize`` (``OK pipe model-parallel refused``).
"""
from __future__ import annotations

import collections
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import deepspeed  # noqa: E402  (the unickpt startup hook patches it here)
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

CONFIGS = {"z0": (0, False), "z1": (1, False), "z0bf16": (0, True), "z1bf16": (1, True)}  # name -> (stage, bf16)
MICRO, GAS = 2, 2


def _tied_out(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, mod.weight.t())


def pipe_model(pp: int, dp: int, seed: int, extra: list | None = None) -> PipelineModule:
    """8 layers (every stage of 1, 2 or 4 holds a trainable layer of its own), odd sizes (ZeRO-1 splits
    parameters unevenly); layers 0 and 7 share ``tied_modules.emb``, large enough that in a 2x2 layout
    the first stage's two DP ranks split it and the last stage's do not; ``extra`` layers are appended."""
    torch.manual_seed(seed)
    layers = [TiedLayerSpec("emb", nn.Linear, 32, 10, bias=False),
              LayerSpec(nn.Linear, 10, 13), nn.ReLU(), LayerSpec(nn.Linear, 13, 7), LayerSpec(nn.Linear, 7, 10),
              LayerSpec(nn.Linear, 10, 9), LayerSpec(nn.Linear, 9, 10),
              TiedLayerSpec("emb", nn.Linear, 32, 10, bias=False, forward_fn=_tied_out), *(extra or [])]
    return PipelineModule(layers=layers, topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
                          loss_fn=lambda out, y: (out.float() - y).pow(2).mean(), partition_method="uniform")


def make(name: str, layout: str, seed: int, tag_validation: str | None = None):
    stage, bf16 = CONFIGS[name]
    pp, dp = (int(v) for v in layout.split("x"))
    model = pipe_model(pp, dp, seed)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10}},
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
           "unickpt": {"enabled": True, "async_save": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=cfg)
    return engine


def batches(engine, step: int):
    """Deterministic micro-batches of this data-parallel rank (first and last stage draw the same ones)."""
    dp_rank = engine.grid.get_data_parallel_rank()
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    for m in range(GAS):
        g = torch.Generator().manual_seed(10_000 * step + 100 * dp_rank + m)
        yield torch.randn(MICRO, 32, generator=g).to(dtype), torch.randn(MICRO, 32, generator=g)


def train(engine, step: int) -> float:
    return float(engine.train_batch(data_iter=batches(engine, step)))


def gather(engine) -> dict:
    """Every stage's full state by parameter name (DeepSpeed's ``safe_get_full_*``), merged on every
    rank; a tied parameter held by several stages must be the same on each."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._lazy_init_hp_params_optimizer_state()
    mine: dict = {}
    for name, p in engine.module.named_parameters():
        mine[f"lp.{name}"] = p.detach().clone()
        if hasattr(p, "_hp_mapping"):
            mine[f"fp32.{name}"] = safe_get_full_fp32_param(p).clone()
            for key in ("exp_avg", "exp_avg_sq"):
                mine[f"{key}.{name}"] = safe_get_full_optimizer_state(p, key).clone()
        else:  # ZeRO-0 fp32: the torch optimizer steps the module parameters
            mine[f"fp32.{name}"] = p.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                mine[f"{key}.{name}"] = opt.state[p][key].clone()
    base = opt.optimizer if hasattr(opt, "optimizer") else opt
    meta = {"steps": sorted({float(s["step"]) for s in base.state.values() if "step" in s}),
            "lr": [g["lr"] for g in base.param_groups], "global_steps": engine.global_steps,
            "sched": engine.lr_scheduler.state_dict()}
    merged: dict = {}
    for part, m in _all_gather(mine, meta):
        for k, v in part.items():
            if k in merged:
                assert same(merged[k], v), f"tied replica {k} differs between stages"
            merged[k] = v
        assert m == meta, (m, meta)
    merged["meta"] = meta
    return merged


def _all_gather(mine: dict, meta: dict) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (mine, meta))
    return out


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                                b.view(torch.uint8) if b.dtype == torch.bfloat16 else b))
    return a == b


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    for k, w in want.items():
        assert same(got[k], w), (what, k, got[k], w)


def phase_pipe(out: str, save_layout: str, loads: list[str], names: list[str]) -> None:
    for name in names:
        d = os.path.join(out, f"{name}_{save_layout}")
        e1 = make(name, save_layout, seed=0)
        for s in range(2):
            train(e1, s)
        e1.save_checkpoint(d, tag="step2")
        ref = gather(e1)
        assert ref["meta"]["global_steps"] == 2 and ref["meta"]["steps"] == [2.0], ref["meta"]
        loss_after = train(e1, 2)  # the uninterrupted run
        after = gather(e1)
        e1.checkpoint_engine.finish_pending()
        e1.destroy()
        assert open(os.path.join(d, "latest")).read() == "step2"
        for layout in loads:
            e2 = make(name, layout, seed=1)
            assert all(not same(p.detach(), ref[f"lp.{n}"]) for n, p in e2.module.named_parameters())
            path, _ = e2.load_checkpoint(d)
            assert path == os.path.join(d, "step2"), path
            assert_same(gather(e2), ref, f"{name} {save_layout}->{layout}")
            loss = train(e2, 2)
            if layout == save_layout:  # the same layout: the next batch is the uninterrupted run's, bitwise
                assert loss == loss_after, (loss, loss_after)
                assert_same(gather(e2), after, f"{name} {save_layout}->{layout} next batch")
            else:  # another layout: another reduction order; Adam's step moved on everywhere
                assert gather(e2)["meta"]["steps"] == [3.0]
            e2.destroy()
            print(f"OK pipe {name} {save_layout}->{layout}", flush=True)


def phase_errors(out: str, save_layout: str) -> None:
    """A pipeline checkpoint loaded into a model with another last layer: only the last stage misses
    weights, and every rank raises the same StateMismatchError (none waits in the load)."""
    from unickpt import StateMismatchError

    d = os.path.join(out, f"z0_{save_layout}")
    pp, dp = (int(v) for v in save_layout.split("x"))
    model = pipe_model(pp, dp, seed=0, extra=[LayerSpec(nn.Linear, 32, 32)])
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "unickpt": {"enabled": True}}
    e, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    try:
        e.load_checkpoint(d)
    except StateMismatchError as err:
        msg = str(err)
        assert msg.startswith("pipeline stages and the checkpoint differ: rank 1: "), msg  # the last stage only
        assert "missing from the checkpoint: ['module.8.bias', 'module.8.weight', 'optimizer.fp32.8.bias', " \
               "'optimizer.fp32.8.weight']" in msg, msg
    else:
        raise AssertionError("loading into another pipeline model did not raise")
    e.destroy()
    print("OK pipe errors", flush=True)


def phase_model_parallel() -> None:
    """A model-parallel axis is refused by ``deepspeed.initialize`` (NotImplementedError naming it), not
    after training: a pipeline topology with 2 model-parallel slices (1 stage), and DeepSpeed's AutoTP
    (``tensor_parallel.autotp_size`` 2, a column-parallel ``lm_head``, ZeRO-1), whose ranks hold
    different shards of ``lm_head.weight`` under one name. Without the block, AutoTP initializes."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(nn.Linear, 6, 6)],
                           topology=PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1),
                           loss_fn=lambda out, y: (out - y).pow(2).mean())
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "unickpt": {"enabled": True}}
    _expect_refused(model, cfg, "from the PipelineModule's topology")

    autotp = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1},
              "tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
                  {"patterns": [r".*lm_head\.weight$"], "partition_type": "column", "gather_output": True}]}}}
    e, *_ = deepspeed.initialize(model=nn.Sequential(collections.OrderedDict(lm_head=nn.Linear(6, 10))), config=autotp)
    assert e.mp_world_size == 2 and e.module.lm_head.weight.shape[0] == 5, (e.mp_world_size, e.module)
    e.destroy()
    _expect_refused(nn.Sequential(collections.OrderedDict(lm_head=nn.Linear(6, 10))), {**autotp, "unickpt": {"enabled": True}},
                    "from AutoTP's autotp_size or the mpu given to deepspeed.initialize")
    print("OK pipe model-parallel refused", flush=True)


def _expect_refused(model: nn.Module, cfg: dict, where: str) -> None:
    try:
        deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    except NotImplementedError as err:
        assert str(err) == ("unickpt.deepspeed: model (tensor) parallelism is not supported (model-parallel size 2, "
                            f'{where}); remove the "unickpt" block from the DeepSpeed config'), err
    else:
        raise AssertionError(f"a model-parallel axis ({where}) was not refused at deepspeed.initialize")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def phase_tags(out: str) -> None:
    """DeepSpeed's ``test_checkpoint_unique_tag``: ``tag=f"tag-{rank}"`` under each tag_validation mode."""
    from unickpt.deepspeed.checkpoint_engine import UnickptCheckpointEngine

    rank = dist.get_rank()
    records = _Records()
    logging.getLogger("unickpt.deepspeed").addHandler(records)
    for mode in ("FAIL", "WARN", "IGNORE"):
        d = os.path.join(out, f"tags_{mode}")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 3))
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2,
                                                                                               "torch_adam": True}},
               "zero_optimization": {"stage": 1}, "checkpoint": {"tag_validation": mode},
               "unickpt": {"enabled": True}}
        e, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
        assert isinstance(e.checkpoint_engine, UnickptCheckpointEngine)
        g = torch.Generator().manual_seed(rank)
        loss = (e(torch.randn(2, 10, generator=g)) ** 2).mean()
        e.backward(loss)
        e.step()
        records.messages.clear()
        if mode == "FAIL":  # DeepSpeed's AssertionError on every rank, before anything is written
            try:
                e.save_checkpoint(save_dir=d, tag=f"tag-{rank}")
            except AssertionError as err:
                assert f"The checkpoint tag name 'tag-{rank}' is not consistent across all ranks" in str(err), err
            else:
                raise AssertionError("tag_validation FAIL: differing tags did not raise")
            dist.barrier()
            assert not os.path.exists(d) or os.listdir(d) == [], os.listdir(d)
            try:  # a load with differing tags too (it would otherwise wait in the collective load)
                e.load_checkpoint(d, tag=f"tag-{rank}")
            except AssertionError as err:
                assert f"The checkpoint tag name 'tag-{rank}' is not consistent across all ranks" in str(err), err
            else:
                raise AssertionError("tag_validation FAIL: a load with differing tags did not raise")
            e.destroy()
            print(f"OK tags {mode}", flush=True)
            continue
        assert e.save_checkpoint(save_dir=d, tag=f"tag-{rank}") is True
        e.checkpoint_engine.finish_pending()
        dist.barrier()
        dirs = sorted(n for n in os.listdir(d) if os.path.isdir(os.path.join(d, n)))
        assert dirs == ["tag-0"] and os.path.isfile(os.path.join(d, "tag-0", "metadata.json")), os.listdir(d)
        assert open(os.path.join(d, "latest")).read() == "tag-0"
        ours = [m for m in records.messages if "tag" in m]
        if mode == "WARN" and rank != 0:
            assert ours == ["unickpt.deepspeed: rank 1 saves with checkpoint tag 'tag-1', group rank 0 with "
                            "'tag-0': the checkpoint is written under 'tag-0' (the tag 'latest' names)"], ours
        else:
            assert ours == [], ours
        want = {n: p.detach().clone() for n, p in e.module.named_parameters()}
        flat = e.optimizer.single_partition_of_fp32_groups[0]  # this rank's ZeRO-1 fp32 partition
        want_flat = flat.detach().clone()
        want_opt = {k: v.clone() for k, v in e.optimizer.optimizer.state[flat].items()}
        e.destroy()
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 3))
        e2, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
        records.messages.clear()
        path, _ = e2.load_checkpoint(d, tag=f"tag-{rank}")  # DeepSpeed's test idiom: each rank its own tag
        assert path == os.path.join(d, "tag-0"), path
        for n, p in e2.module.named_parameters():
            assert torch.equal(p, want[n]), n
        flat = e2.optimizer.single_partition_of_fp32_groups[0]
        assert torch.equal(flat, want_flat)
        got_opt = e2.optimizer.optimizer.state[flat]
        assert got_opt.keys() == want_opt.keys(), (got_opt.keys(), want_opt.keys())
        for k, v in want_opt.items():  # exp_avg, exp_avg_sq, step
            assert torch.equal(got_opt[k], v), k
        ours = [m for m in records.messages if "tag" in m]
        assert ours == ([] if mode == "IGNORE" or rank == 0 else
                        ["unickpt.deepspeed: rank 1 loads with checkpoint tag 'tag-1', group rank 0 with "
                         "'tag-0': 'tag-0' is loaded"]), ours
        e2.destroy()
        print(f"OK tags {mode}", flush=True)


if __name__ == "__main__":
    deepspeed.init_distributed(dist_backend="gloo")
    phase, out = sys.argv[1], sys.argv[2]
    if phase == "pipe":
        phase_pipe(out, sys.argv[3], sys.argv[4].split(","), sys.argv[5].split(","))
        if len(sys.argv) > 6 and sys.argv[6] == "errors":
            phase_errors(out, sys.argv[3])
    elif phase == "tags":
        phase_tags(out)
        phase_model_parallel()
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    dist.barrier()
    dist.destroy_process_group()
