"""Accelerate training whose save_state / load_state go through unickpt, resumable on any process count.

Train on 2 CPU processes (checkpoint every 4 steps, keep the newest 2), stop after 10 steps, then
resume on 1 process from the newest committed checkpoint and finish::

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/accelerate_resume.py --project /tmp/acc_run --stop-at 10
    ACCELERATE_USE_CPU=1 python examples/accelerate_resume.py --project /tmp/acc_run
    unickpt ls /tmp/acc_run/checkpoints/checkpoint_2/unickpt

The only unickpt line is ``unickpt.accelerate.enable(...)``. Without it, the same script checkpoints
through unickpt when started with ``UNICKPT_ACCELERATE=1`` (plus
``UNICKPT_ACCELERATE_RNG_RESHARD=by_rank`` to resume on another number of processes).
"""
from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed

import unickpt.accelerate


class Progress:
    """Where training is: registered with the accelerator, so it is saved and restored with it.

    ``samples`` counts the samples consumed by all processes together: unlike a batch count, it means
    the same thing on any number of processes, so a run resumed on another process count skips
    exactly the samples already trained on."""

    def __init__(self) -> None:
        self.global_step = 0
        self.samples = 0

    def state_dict(self) -> dict:
        return {"global_step": self.global_step, "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.global_step = int(state["global_step"])
        self.samples = int(state["samples"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True, help="project_dir: checkpoints go to <project>/checkpoints")
    parser.add_argument("--steps", type=int, default=16, help="total optimizer steps")
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--stop-at", type=int, default=None, help="simulate a failure after this many steps")
    args = parser.parse_args()

    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir=args.project, automatic_checkpoint_naming=True, total_limit=2))
    # per-process RNG state: on another number of processes, process r continues saved process r's streams
    unickpt.accelerate.enable(accelerator, rng_reshard="by_rank")
    set_seed(0)

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    batch_size = 8  # per process
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    checkpoints = os.path.join(args.project, "checkpoints")
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        accelerator.load_state()  # the newest committed checkpoint_<N>, resharded to this run's processes
        accelerator.print(f"resumed at step {progress.global_step} on {accelerator.num_processes} process(es)")

    while progress.global_step < args.steps:
        # the shuffled order of an epoch is the same on any process count; each step takes the next
        # batch_size * num_processes samples of it, so the batches to skip depend on the process count
        epoch, offset = divmod(progress.samples, len(data))
        skip = offset // (batch_size * accelerator.num_processes)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.global_step += 1
            progress.samples = min(progress.samples + batch_size * accelerator.num_processes,
                                   (epoch + 1) * len(data))  # the last batch of an epoch may be short
            if progress.global_step % args.save_every == 0:
                accelerator.save_state()  # returns once the state is in host memory; commits in the background
                accelerator.print(f"step {progress.global_step}: loss {loss.item():.4f}, saved")
            if progress.global_step in (args.stop_at, args.steps):
                break
        if progress.global_step == args.stop_at:
            break
    accelerator.end_training()  # waits for the last save to commit, then destroys the process group


if __name__ == "__main__":
    main()
