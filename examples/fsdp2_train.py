"""An ordinary FSDP2 training script that checkpoints with ``torch.distributed.checkpoint`` (the
pattern of PyTorch's DCP tutorial), switched to unickpt's engine and format by two changed lines
(marked ``# unickpt``) plus one import.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/fsdp2_train.py --steps 20 --ckpt-every 10 --root /tmp/run
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/fsdp2_train.py --steps 30 --ckpt-every 10 --root /tmp/run

The second command resumes from the newest step on 2 ranks (resharding happens at load). Every
checkpoint is an ordinary unickpt checkpoint: ``unickpt inspect /tmp/run/step_20`` lists it, and
``unickpt.load`` or ``dcp.load`` with ``unickpt.fsdp.StorageReader`` read it.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unickpt.fsdp  # unickpt: the one added import


class AppState(Stateful):
    """Model and optimizer state for DCP (sharded state dicts, as the DCP tutorial does)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, step: int = 0):
        self.model, self.optim, self.step = model, optim, step

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = sd["step"]


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(nn.Embedding(256, width), *layers, nn.LayerNorm(width), nn.Linear(width, 256))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def latest_step(root: str) -> int | None:
    steps = [int(d[5:]) for d in os.listdir(root) if d.startswith("step_")] if os.path.isdir(root) else []
    steps = [s for s in steps if os.path.exists(os.path.join(root, f"step_{s}", "metadata.json"))]
    return max(steps) if steps else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--root", default="/tmp/unickpt_fsdp2_example")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    args = p.parse_args()

    dist.init_process_group("gloo")
    model = make_model(args.width, args.depth)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    app = AppState(model, optim)

    start = latest_step(args.root) if dist.get_rank() == 0 else None
    start = [start]
    dist.broadcast_object_list(start, src=0)
    if start[0] is not None:
        path = os.path.join(args.root, f"step_{start[0]}")
        dcp.load({"app": app}, checkpoint_id=path,
                 storage_reader=unickpt.fsdp.StorageReader(path))  # unickpt: changed line 1 of 2
        if dist.get_rank() == 0:
            print(f"resumed from {path} (step {app.step}) on {dist.get_world_size()} ranks")

    while app.step < args.steps:
        g = torch.Generator().manual_seed(app.step * 1000 + dist.get_rank())
        x = torch.randint(0, 256, (8, 32), generator=g)
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        app.step += 1
        if app.step % args.ckpt_every == 0:
            path = os.path.join(args.root, f"step_{app.step}")
            dcp.save({"app": app}, checkpoint_id=path,
                     storage_writer=unickpt.fsdp.StorageWriter(path))  # unickpt: changed line 2 of 2
            if dist.get_rank() == 0:
                print(f"step {app.step}: loss {loss.item():.4f}, saved {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
