"""torchrun worker for tests/plugins/deepspeed/test_deepspeed.py: DeepSpeed engines on CPU (gloo) saving and loading
through unickpt (the "unickpt" JSON block), compared with full states gathered by DeepSpeed's own
``safe_get_full_*`` APIs.

  DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tests/plugins/deepspeed/deepspeed_workers.py save OUT CONFIGS
  DS_ACCELERATOR=cpu torchrun --nproc_per_node=3 tests/plugins/deepspeed/deepspeed_workers.py load OUT CONFIGS

``save`` (world size N): per config, train 3 steps, save (async), gather the full state (reference),
train a 4th step (the uninterrupted run); then a fresh engine loads the checkpoint at the same size, its
gathered state must equal the reference bitwise, and its 4th step must equal the uninterrupted one
bitwise. ``load`` (another world size): a fresh engine loads each checkpoint, its gathered state must
equal the reference bitwise, then it trains one step. Prints ``OK <phase> <config>`` per config.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import deepspeed  # noqa: E402  (the unickpt startup hook patches it here)
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

CONFIGS = {  # name -> (ZeRO stage, bf16)
    "z0": (0, False), "z1": (1, False), "z2": (2, False), "z3": (3, False),
    "z0bf16": (0, True), "z1bf16": (1, True), "z2bf16": (2, True), "z3bf16": (3, True),
    "z3sub": (3, False),  # sub_group_size 300: several ZeRO-3 sub-groups, their number depends on the DP size
}
SUB_GROUP_SIZE = {"z3sub": 300}


class Net(nn.Module):
    """Odd sizes: every DP size splits the parameters unevenly; one persistent buffer."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 24), nn.ReLU(), nn.Linear(24, 4))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return self.body(x) * self.scale.to(x.dtype)


S3 = json.loads(os.environ["UNICKPT_TEST_S3"]) if os.environ.get("UNICKPT_TEST_S3") else None
REMOTE = "s3://unickpt/deepspeed_run"


def ds_config(stage: int, bf16: bool, unickpt: bool = True, storage_options: dict | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                      "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
        "bf16": {"enabled": bf16},
    }
    if unickpt:
        cfg["unickpt"] = {"enabled": True, "async_save": True}
        if storage_options:
            cfg["unickpt"]["storage_options"] = storage_options
    return cfg


def make(name: str, seed: int, unickpt: bool = True, storage_options: dict | None = None):
    stage, bf16 = CONFIGS[name]
    torch.manual_seed(seed)
    model = Net()
    cfg = ds_config(stage, bf16, unickpt, storage_options)
    if name in SUB_GROUP_SIZE:
        cfg["zero_optimization"]["sub_group_size"] = SUB_GROUP_SIZE[name]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train_step(engine, step: int) -> float:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    loss = (engine(x.to(dtype)).float() - y).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def gather(engine) -> dict:
    """The full state, assembled by DeepSpeed's own APIs (independent of the plugin)."""
    stage = engine.zero_optimization_stage()
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._lazy_init_hp_params_optimizer_state()  # links optimizer state created by a load
    out = {}
    fp32_copy = {}  # ZeRO-0 bf16 (FP16_UnfusedOptimizer): fp32 copies of the module parameters
    if hasattr(opt, "fp32_groups") and not hasattr(opt, "fp32_partitioned_groups_flat"):
        for lps, hps in zip(opt.fp16_groups, opt.fp32_groups):
            fp32_copy.update({lp: hp for lp, hp in zip(lps, hps)})
    for name, p in engine.module.named_parameters():
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p]):
                out[f"lp.{name}"] = p.data.clone()
        else:
            out[f"lp.{name}"] = p.data.clone()
        if hasattr(p, "_hp_mapping") or hasattr(p, "ds_id"):
            out[f"fp32.{name}"] = safe_get_full_fp32_param(p).clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}.{name}"] = safe_get_full_optimizer_state(p, key).clone()
        else:  # ZeRO-0: the torch optimizer steps the module parameters (fp32) or fp32 copies (bf16)
            hp = fp32_copy.get(p, p)
            base = opt.optimizer if fp32_copy else opt
            out[f"fp32.{name}"] = hp.data.clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}.{name}"] = base.state[hp][key].clone()
    out["buffer.scale"] = engine.module.scale.clone()
    base = opt.optimizer if hasattr(opt, "optimizer") else opt
    steps = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
    out["meta"] = {"steps": steps, "lr": [g["lr"] for g in base.param_groups], "global_steps": engine.global_steps,
                   "sched": engine.lr_scheduler.state_dict()}
    return out


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    for k, w in want.items():
        g = got[k]
        if torch.is_tensor(w):
            assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, w.dtype, g.shape, w.shape)
            assert torch.equal(g.view(torch.uint8) if g.dtype == torch.bfloat16 else g,
                               w.view(torch.uint8) if w.dtype == torch.bfloat16 else w), \
                (what, k, (g.float() - w.float()).abs().max().item())
        else:
            assert g == w, (what, k, g, w)


CLIENT = {"my_step": 3, "note": "resume here", "history": [0.5, 0.25], "t": torch.arange(5, dtype=torch.int16)}


def check_client(client: dict) -> None:
    assert client.keys() == CLIENT.keys(), client
    for k, v in CLIENT.items():
        if torch.is_tensor(v):
            assert torch.equal(client[k], v) and client[k].dtype == v.dtype, (k, client[k])
        else:
            assert client[k] == v, (k, client[k])


def phase_save(out: str, names: list[str]) -> None:
    from unickpt.deepspeed.checkpoint_engine import UnickptCheckpointEngine

    rank = dist.get_rank()
    for name in names:
        d = os.path.join(out, name)
        e1 = make(name, seed=0)
        assert isinstance(e1.checkpoint_engine, UnickptCheckpointEngine), type(e1.checkpoint_engine)
        for s in range(3):
            train_step(e1, s)
        e1.save_checkpoint(d, tag="step3", client_state=CLIENT)
        ref = gather(e1)
        train_step(e1, 3)  # the uninterrupted run
        after = gather(e1)
        e1.checkpoint_engine.finish_pending()
        assert open(os.path.join(d, "latest")).read() == "step3"
        assert os.path.isfile(os.path.join(d, "step3", "metadata.json"))
        if rank == 0:
            torch.save({"ref": ref, "after": after}, os.path.join(out, f"{name}_ref.pt"))
        e2 = make(name, seed=1)
        assert not torch.equal(e2.module.body[0].weight.data, ref["lp.body.0.weight"])
        path, client = e2.load_checkpoint(d)
        assert path == os.path.join(d, "step3"), path
        check_client(client)
        assert_same(gather(e2), ref, f"{name} same-size load")
        train_step(e2, 3)
        assert_same(gather(e2), after, f"{name} step after load")
        e1.destroy()
        e2.destroy()
        print(f"OK save {name} ws={dist.get_world_size()}", flush=True)


def phase_load(out: str, names: list[str]) -> None:
    for name in names:
        d = os.path.join(out, name)
        ref = torch.load(os.path.join(out, f"{name}_ref.pt"), weights_only=False)["ref"]
        e = make(name, seed=1)
        _, client = e.load_checkpoint(d)
        check_client(client)
        assert_same(gather(e), ref, f"{name} reshard to ws={dist.get_world_size()}")
        loss = train_step(e, 3)
        assert loss == loss and abs(loss) < 1e3, loss
        assert optimizer_steps(e) == {ref["meta"]["steps"][0] + 1}, (name, optimizer_steps(e))
        e.destroy()
        print(f"OK load {name} ws={dist.get_world_size()}", flush=True)


def optimizer_steps(engine) -> set:
    opt = engine.optimizer
    base = opt.optimizer if hasattr(opt, "optimizer") else opt
    return {float(s["step"]) for s in base.state.values() if "step" in s}


def phase_cross(out: str) -> None:
    """Another ZeRO stage and DP size at once: ZeRO-2 (DP 2) -> ZeRO-3, ZeRO-3 (DP 2) -> ZeRO-1; and another
    number of optimizer partitions: ZeRO-2 (1 partition) -> ZeRO-0 (one per parameter), ZeRO-3 (1 sub-group)
    -> ZeRO-3 with several sub-groups (their number changes with the DP size for large models)."""
    for engine_name, ckpt_name in (("z3", "z2"), ("z1", "z3"), ("z0", "z2"), ("z3sub", "z3")):
        ref = torch.load(os.path.join(out, f"{ckpt_name}_ref.pt"), weights_only=False)["ref"]
        e = make(engine_name, seed=1)
        e.load_checkpoint(os.path.join(out, ckpt_name))
        assert_same(gather(e), ref, f"{ckpt_name} checkpoint into {engine_name} at ws={dist.get_world_size()}")
        train_step(e, 3)  # every partition steps its own copy of Adam's step
        assert optimizer_steps(e) == {ref["meta"]["steps"][0] + 1}, (engine_name, optimizer_steps(e))
        e.destroy()
        print(f"OK cross {ckpt_name}->{engine_name} ws={dist.get_world_size()}", flush=True)


def phase_remote_save(out: str) -> None:
    """ZeRO-3 to an S3 URL (moto): ``latest`` and the checkpoint are read through fsspec, no local file."""
    e1 = make("z3", seed=0, storage_options=S3)
    for s in range(3):
        train_step(e1, s)
    e1.save_checkpoint(REMOTE, tag="step3", client_state=CLIENT)
    ref = gather(e1)
    if dist.get_rank() == 0:
        torch.save(ref, os.path.join(out, "remote_ref.pt"))
    e2 = make("z3", seed=1, storage_options=S3)
    path, client = e2.load_checkpoint(REMOTE)
    assert path == REMOTE + "/step3", path
    check_client(client)
    assert_same(gather(e2), ref, "remote same-size load")
    e1.destroy()
    e2.destroy()
    print(f"OK remote save ws={dist.get_world_size()}", flush=True)


def phase_remote_load(out: str) -> None:
    ref = torch.load(os.path.join(out, "remote_ref.pt"), weights_only=False)
    e = make("z3", seed=1, storage_options=S3)
    _, client = e.load_checkpoint(REMOTE)
    check_client(client)
    assert_same(gather(e), ref, f"remote reshard to ws={dist.get_world_size()}")
    e.destroy()
    print(f"OK remote load ws={dist.get_world_size()}", flush=True)


def phase_errors(out: str) -> None:
    """Mismatched model: a clear StateMismatchError naming the parameter; no block: DeepSpeed's engine."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from unickpt.errors import StateMismatchError

    plain = make("z2", seed=0, unickpt=False)
    assert type(plain.checkpoint_engine) is TorchCheckpointEngine, type(plain.checkpoint_engine)
    train_step(plain, 0)
    plain.save_checkpoint(os.path.join(out, "native"), tag="t1")
    names = os.listdir(os.path.join(out, "native", "t1"))
    assert "mp_rank_00_model_states.pt" in names and "metadata.json" not in names, names
    native_state = gather(plain)
    try:  # DeepSpeed's own loader of a unickpt checkpoint: a clear error (it failed on a bare assert)
        plain.load_checkpoint(os.path.join(out, "z2"))
    except ValueError as err:
        assert f"{os.path.join(out, 'z2', 'step3')!r} is a unickpt checkpoint: DeepSpeed's own load_checkpoint " \
               "cannot read it" in str(err), str(err)
    else:
        raise AssertionError("DeepSpeed's own load_checkpoint took a unickpt checkpoint")
    plain.destroy()
    # an engine with the block still resumes from a DeepSpeed-native checkpoint (DeepSpeed loads it)
    ours = make("z2", seed=1)
    path, _ = ours.load_checkpoint(os.path.join(out, "native"))
    assert_same(gather(ours), native_state, "native checkpoint into an engine with the block")
    ours.destroy()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    e, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(2, False))
    try:
        e.load_checkpoint(os.path.join(out, "z2"))
    except StateMismatchError as err:
        msg = str(err)
        assert "missing from the checkpoint" in msg and "'module.0.weight'" in msg, msg
        assert "model weights in the checkpoint but not in the model" in msg and "'module.body.0.weight'" in msg, msg
    else:
        raise AssertionError("loading into another model did not raise")
    e.destroy()

    # another optimizer (SGD with momentum, ZeRO-3): refused before anything changes; used to load Adam's
    # exp_avg / exp_avg_sq and hyperparameters into it silently, leaving its momentum_buffer stale
    torch.manual_seed(0)
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = ds_config(3, False)
    del cfg["optimizer"], cfg["scheduler"]
    e, *_ = deepspeed.initialize(model=model, optimizer=sgd, config={**cfg, "zero_allow_untested_optimizer": True})
    train_step(e, 0)
    before = {k: v.clone() for k, v in e.optimizer.optimizer.state[e.optimizer.fp32_partitioned_groups_flat[0]].items()}
    groups_before = [dict(g, params=None) for g in e.optimizer.optimizer.param_groups]
    try:
        e.load_checkpoint(os.path.join(out, "z2"))
    except StateMismatchError as err:
        assert str(err) == (f"{os.path.join(out, 'z2', 'step3')!r}: 'optimizer.state': the checkpoint holds optimizer "
                            "state ['exp_avg', 'exp_avg_sq'], this engine's optimizer keeps ['momentum_buffer'] "
                            "(another optimizer?); pass load_optimizer_states=False to load the weights only"), str(err)
    else:
        raise AssertionError("loading Adam's state into SGD did not raise")
    after = e.optimizer.optimizer.state[e.optimizer.fp32_partitioned_groups_flat[0]]
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items()), after.keys()
    assert [dict(g, params=None) for g in e.optimizer.optimizer.param_groups] == groups_before
    train_step(e, 1)  # the engine is usable after the refused load
    e.load_checkpoint(os.path.join(out, "z2"), load_optimizer_states=False)  # the weights alone do load
    e.destroy()
    print("OK errors", flush=True)


def phase_replace(out: str) -> None:
    """Saving a tag again (ZeRO-3): the call waits for a save to that tag still in flight, and the committed
    tag stays loadable until the new save commits (a refused or failed replacement leaves it intact)."""
    from unickpt.errors import SaveFailedError, UnsafeObjectError

    d = os.path.join(out, "replace")
    e = make("z3", seed=0)
    train_step(e, 0)
    e.save_checkpoint(d, client_state={"v": 1})  # tag global_step1
    e.save_checkpoint(d, client_state={"v": 2})  # same tag, the first save still in flight
    ref = gather(e)
    e.checkpoint_engine.finish_pending()
    assert open(os.path.join(d, "latest")).read() == "global_step1"
    assert sorted(os.listdir(d)) == ["global_step1", "latest", "zero_to_fp32.py", "zero_to_torch.py"], os.listdir(d)
    try:  # refused before anything is touched
        e.save_checkpoint(d, client_state={"v": object()})
    except UnsafeObjectError as err:
        assert str(err).startswith("'client_state.v': a value of class builtins.object has no JSON"), str(err)
    else:
        raise AssertionError("an unsavable client_state did not raise")
    import contextlib
    import errno

    from unickpt.testing import Fault, inject

    disk_full = Fault("write", match="*/data/*", nth=None, errno=errno.ENOSPC)
    with inject(disk_full) if dist.get_rank() == 1 else contextlib.nullcontext():
        # a replacement that fails in the background (rank 1's data files), after save_checkpoint returned
        e.save_checkpoint(d, client_state={"v": 3})
        try:
            e.checkpoint_engine.finish_pending()
        except SaveFailedError as err:
            assert "No space left on device (injected: write of" in str(err), str(err)
        else:
            raise AssertionError("the injected failure was not raised")
    assert open(os.path.join(d, "latest")).read() == "global_step1"
    e2 = make("z3", seed=1)
    path, client = e2.load_checkpoint(d)
    assert path == os.path.join(d, "global_step1") and client == {"v": 2}, (path, client)
    assert_same(gather(e2), ref, "committed tag after a failed replacement")
    train_step(e, 1)  # the engine that refused and failed saves still trains
    e.destroy()
    e2.destroy()
    print(f"OK replace ws={dist.get_world_size()}", flush=True)


def phase_tiers(out: str) -> None:
    """The checkpoint tiers through the JSON block (ZeRO-2, a memory save at every optimizer step): a
    fresh engine (a restart) restores the last step from memory, bitwise, with nothing persisted yet;
    then a preemption notice to rank 1 makes every rank save that step with ``save_checkpoint``."""
    import signal

    rank = dist.get_rank()
    d = os.path.join(out, "tiers")

    def make_tiers(seed: int):
        stage, bf16 = CONFIGS["z2"]
        torch.manual_seed(seed)
        model = Net()
        cfg = ds_config(stage, bf16)
        cfg["unickpt"].update(memory_every=1, save_dir=d)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return engine

    e1 = make_tiers(0)
    for s in range(4):
        train_step(e1, s)
    ref = gather(e1)
    e1.checkpoint_engine.tiers.wait()
    assert not os.path.exists(os.path.join(d, "latest"))  # nothing persisted: memory only
    e1.destroy()  # the process would die here; its memory copies stay
    e2 = make_tiers(1)
    path, client = e2.load_checkpoint(d)
    stats = e2.checkpoint_engine.last_load_stats
    assert stats.tier == "memory" and set(stats.bytes_by_tier) == {"memory"}, stats
    assert client == {} and "step_4" in path, (path, client)
    assert_same(gather(e2), ref, "restored from memory")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # a preemption notice to one rank
    train_step(e2, 4)  # optimizer step 5: every rank agrees on the notice and saves
    assert getattr(e2, "unickpt_preempted", False)
    assert open(os.path.join(d, "latest")).read() == "global_step5"
    assert os.path.isfile(os.path.join(d, "global_step5", "metadata.json"))
    e2.destroy()
    print(f"OK tiers ws={dist.get_world_size()}", flush=True)


def run_phases(phases: dict, flags: dict | None = None) -> None:
    """A worker script's ``__main__`` under torchrun, called ``SCRIPT PHASE OUT [CONFIGS [FLAG ...]]``
    (``CONFIGS``: names, comma-separated): starts gloo, calls ``phases[PHASE](OUT, names)`` (nothing for
    another PHASE), then ``flags[FLAG](OUT)`` for each FLAG of ``flags`` on the command line (in ``flags``'
    order), and ends the process group after a barrier."""
    phase, out = sys.argv[1], sys.argv[2]
    names = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else []
    deepspeed.init_distributed(dist_backend="gloo")
    if phase in phases:
        phases[phase](out, names)
    for flag, fn in (flags or {}).items():
        if flag in sys.argv[4:]:
            fn(out)
    dist.barrier()
    dist.destroy_process_group()


def _save_all(out: str, names: list[str]) -> None:
    phase_save(out, names)
    if S3:
        phase_remote_save(out)


def _load_all(out: str, names: list[str]) -> None:
    phase_load(out, names)
    if S3:
        phase_remote_load(out)


def _errors_and_replace(out: str) -> None:
    phase_errors(out)
    phase_replace(out)


if __name__ == "__main__":
    run_phases({"save": _save_all, "load": _load_all, "tiers": lambda out, _: phase_tiers(out)},
               {"cross": phase_cross, "errors": _errors_and_replace})
