"""Lightning's DeepSpeedStrategy routed through unickpt, on CPU (the strategy itself needs CUDA).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tests/plugins/lightning/lightning_deepspeed.py OUT

A ``DeepSpeedStrategy`` whose ``checkpoint_io`` is ``UnickptCheckpointIO`` gets unickpt's
``"unickpt"`` block in its DeepSpeed config from the wrapped ``setup`` (the rest of Lightning's
``setup`` then stops on the missing CUDA accelerator); a DeepSpeed engine built from that config is
attached as the strategy's model, and ``DeepSpeedStrategy.save_checkpoint`` (Lightning's own code)
saves through it. A fresh engine loads the checkpoint; rank 0 prints a JSON report.
"""
import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from lightning.pytorch.strategies import DeepSpeedStrategy

from unickpt.lightning import UnickptCheckpointIO

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}


def engine_for(config, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def step(engine, i):
    g = torch.Generator().manual_seed(100 * i + dist.get_rank())
    x, y = torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)
    loss = (engine(x) - y).pow(2).mean()
    engine.backward(loss)
    engine.step()


def main(out):
    deepspeed.init_distributed(dist_backend="gloo")
    strategy = DeepSpeedStrategy(config=dict(CONFIG))
    strategy.checkpoint_io = UnickptCheckpointIO()
    strategy._config_initialized = True  # the config above is complete; Lightning would fill it from the Trainer
    try:
        strategy.setup(trainer=None)
    except (AssertionError, AttributeError):
        pass  # past the routing, Lightning's setup needs an accelerator (CUDA)
    report = {"block": strategy.config.get("unickpt")}
    engine = engine_for(strategy.config, 0)
    report["engine"] = type(engine.checkpoint_engine).__name__
    for i in range(3):
        step(engine, i)
    strategy.model = engine
    checkpoint = {"epoch": 1, "global_step": 3, "loops": {"fit_loop": {"n": 3}}, "state_dict": {}, "optimizer_states": []}
    strategy.save_checkpoint(checkpoint, f"{out}/epoch=1-step=3.ckpt")  # Lightning's DeepSpeedStrategy code path
    fresh = engine_for(strategy.config, 1)
    _, client = fresh.load_checkpoint(f"{out}/epoch=1-step=3.ckpt", tag="checkpoint")
    same = all(torch.equal(a, b) for a, b in zip(engine.module.state_dict().values(), fresh.module.state_dict().values()))
    step(engine, 3)
    step(fresh, 3)
    same_after = all(torch.equal(a, b) for a, b in zip(engine.module.state_dict().values(),
                                                      fresh.module.state_dict().values()))
    report.update(client={k: client.get(k) for k in ("epoch", "global_step", "loops")}, same=same,
                  same_after_step=same_after)
    if dist.get_rank() == 0:
        print("REPORT " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
