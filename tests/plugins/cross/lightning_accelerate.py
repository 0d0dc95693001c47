"""Lightning (ModelParallelStrategy, FSDP2) <-> Accelerate (DDP on CPU), both through unickpt, one model
and data stream (cross_common.py). A checkpoint of one framework is resumed by the other on another
number of processes.

    python lightning_accelerate.py lightning OUT TAG --devices N --max-steps S [--save-at K] [--resume PATH]
    torchrun --nproc_per_node=N lightning_accelerate.py accelerate OUT TAG --max-steps S [--save-at K] [--resume PATH]

Each run writes ``OUT/<TAG>.json`` (its per-step global-batch losses, keyed by step), with ``--save-at K``
a checkpoint after step K (``OUT/<TAG>_ckpt``: Lightning's checkpoint path (a sharded-route directory) ``step=K.ckpt`` in it, or
Accelerate's folder) and ``OUT/<TAG>_saved.pt`` (the full state then, gathered by torch's full-state-dict
API), with ``--resume`` ``OUT/<TAG>_loaded.pt`` (the full state right after the restore). Ten steps make an
epoch on every world size (a dataloader of 10 batches per process; the data come from the step number).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cross_common import (BETAS, EPS, LR, WEIGHT_DECAY, batch, full_state, global_mean, loss_fn, lr_lambda,  # noqa: E402
                          make_net, write)

torch.set_num_threads(1)
STEPS_PER_EPOCH = 10


def loader(world: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(STEPS_PER_EPOCH * world, 1)),
                                       batch_size=1)


def dump(path: str, model: nn.Module, optim: torch.optim.Optimizer, sched, step: int, epoch: int) -> None:
    state = full_state(model, optim)  # collective
    if dist.get_rank() == 0:
        torch.save({"tensors": state, "lr": [g["lr"] for g in optim.param_groups], "step": step, "epoch": epoch,
                    "sched": {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}}, path)


def run_lightning(args) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from unickpt.lightning import UnickptCheckpointIO

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            net = make_net(seed=5)  # other values than the saving run: everything must come from the checkpoint
            self.body = net.body  # the same parameter names as Net
            self.register_buffer("scale", net.scale)
            self.losses: dict[int, float] = {}

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.body:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def forward(self, x):
            return self.body(x) * self.scale

        def training_step(self, _, batch_idx):
            step = self.global_step + 1
            x, y = batch(step, self.global_rank, self.trainer.world_size)
            loss = loss_fn(self(x), y)
            self.losses[step] = global_mean(loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Dumps(Callback):
        def on_train_start(self, trainer, module):
            if args.resume:
                dump(os.path.join(args.out, f"{args.tag}_loaded.pt"), module, trainer.optimizers[0],
                     trainer.lr_scheduler_configs[0].scheduler, trainer.global_step, trainer.current_epoch)

        def on_train_batch_end(self, trainer, module, *_):
            if trainer.global_step == args.save_at:
                dump(os.path.join(args.out, f"{args.tag}_saved.pt"), module, trainer.optimizers[0],
                     trainer.lr_scheduler_configs[0].scheduler, trainer.global_step, trainer.current_epoch)

    callbacks: list = [Dumps()]
    if args.save_at:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(args.out, f"{args.tag}_ckpt"), filename="{step}",
                                         every_n_train_steps=args.save_at, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=args.max_steps, logger=False,
                        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
                        plugins=[UnickptCheckpointIO()], callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=bool(args.save_at))
    module = Module()
    trainer.fit(module, train_dataloaders=loader(args.devices), ckpt_path=args.resume)
    if trainer.is_global_zero:
        write(os.path.join(args.out, f"{args.tag}.json"),
              {"losses": {str(k): v for k, v in sorted(module.losses.items())}, "global_step": trainer.global_step})


def run_accelerate(args) -> None:
    from accelerate import Accelerator

    import unickpt.accelerate

    acc = Accelerator(step_scheduler_with_optimizer=False)  # one scheduler step per optimizer step
    unickpt.accelerate.enable(acc)
    model = make_net(seed=0 if not args.resume else 5)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda)
    model, optim, sched, dl = acc.prepare(model, optim, sched, loader(acc.num_processes))
    step = 0
    if args.resume:
        acc.load_state(args.resume)
        step = sched.scheduler.last_epoch  # the script's own bookkeeping: one scheduler step per step
        dump(os.path.join(args.out, f"{args.tag}_loaded.pt"), model, optim, sched, step, dl.iteration)
    losses = {}
    rank, world = acc.process_index, acc.num_processes
    while step < args.max_steps:
        for _ in dl:
            step += 1
            x, y = batch(step, rank, world)
            loss = loss_fn(model(x), y)
            acc.backward(loss)
            optim.step()
            sched.step()
            optim.zero_grad()
            losses[step] = global_mean(loss)
            if step == args.max_steps:
                break
        if step == args.save_at:  # end of an epoch
            acc.save_state(os.path.join(args.out, f"{args.tag}_ckpt"))
            dump(os.path.join(args.out, f"{args.tag}_saved.pt"), model, optim, sched, step, dl.iteration)
    acc.wait_for_everyone()
    acc.end_training()
    if rank == 0:
        write(os.path.join(args.out, f"{args.tag}.json"), {"losses": {str(k): v for k, v in sorted(losses.items())}})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=("lightning", "accelerate"))
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", default=None)
    a = p.parse_args()
    {"lightning": run_lightning, "accelerate": run_accelerate}[a.framework](a)
