"""Writes small native DeepSpeed ZeRO-2 and ZeRO-3 checkpoints on the CPU, for test_tooling_frameworks.py.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tests/plugins/tooling_ds_zero.py OUT_DIR

Writes ``OUT_DIR/zero{2,3}/`` (DeepSpeed's save_dir, tag ``step2``) and ``OUT_DIR/zero{2,3}_expected.pt``
(the full fp32 parameters after training, gathered by rank 0).
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from torch import nn


def main(out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in (2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
               "zero_optimization": {"stage": stage}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for i in range(2):
            g = torch.Generator().manual_seed(100 * stage + 10 * i + dist.get_rank())
            loss = engine(torch.randn(2, 8, generator=g)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(os.path.join(out, f"zero{stage}"), tag="step2")
        params = dict(engine.module.named_parameters())
        ctx = deepspeed.zero.GatheredParameters(list(params.values())) if stage == 3 else torch.no_grad()
        with ctx:
            full = {k: p.detach().clone().float() for k, p in params.items()}
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(out, f"zero{stage}_expected.pt"))
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
