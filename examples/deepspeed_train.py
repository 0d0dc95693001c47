"""A plain DeepSpeed training script: nothing in it knows about unickpt.

Its checkpoints are DeepSpeed's own, or unickpt's when the JSON config has a ``"unickpt"`` block
(``examples/deepspeed_unickpt.json``); unickpt's startup hook does the rest. With unickpt, the script
resumes on a different number of ranks, with the ZeRO partitions resharded at load time:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 examples/deepspeed_train.py \\
        --deepspeed_config examples/deepspeed_unickpt.json --ckpt_dir /tmp/ds_run --steps 20
    DS_ACCELERATOR=cpu torchrun --nproc_per_node=3 examples/deepspeed_train.py \\
        --deepspeed_config examples/deepspeed_unickpt.json --ckpt_dir /tmp/ds_run --steps 40
"""
import argparse

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt_dir", required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--save_every", type=int, default=10)
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
rank = dist.get_rank()

start = 0
load_path, client_state = engine.load_checkpoint(args.ckpt_dir)  # the tag named by ckpt_dir/latest
if load_path is not None:
    start = client_state["step"]
    print(f"rank {rank}: resumed from {load_path} at step {start} on {dist.get_world_size()} ranks", flush=True)

dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
loss = torch.zeros(())
for step in range(start, args.steps):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x, y = torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)
    loss = (engine(x.to(engine.device, dtype)).float() - y.to(engine.device)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    if (step + 1) % args.save_every == 0:
        engine.save_checkpoint(args.ckpt_dir, client_state={"step": step + 1})
print(f"rank {rank}: finished step {args.steps}, loss {loss.item():.6f}", flush=True)
engine.destroy()  # waits for a checkpoint still being written
