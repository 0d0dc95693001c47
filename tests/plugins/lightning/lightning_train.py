"""A tiny Lightning training script for tests/plugins/lightning/test_lightning.py (run as a subprocess: Lightning's
DDP launcher re-executes this file once per extra device).

    python tests/plugins/lightning/lightning_train.py --strategy ddp|mp|fsdp|single --devices N --epochs E
        --ckpt-dir DIR [--io plugin|none] [--resume PATH|last] [--out FILE] [--dump-restored FILE]
        [--watch-listings]

``--io plugin`` passes ``UnickptCheckpointIO()``; ``--io none`` leaves the script unmodified (the
environment decides: ``UNICKPT_LIGHTNING=1`` activates unickpt through the entry point). Rank 0
writes ``--out``: per-step losses, the final full model and optimizer state (gathered for sharded
strategies), scheduler state, and what the run saw (callbacks, CheckpointIO class, save stalls).
``--dump-restored`` writes the same full state right after a checkpoint was restored.
``--watch-listings`` records every state of the checkpoint folder's listing that rank 0's process
produced (:mod:`listing_spy`) into ``--out`` (``listings``).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

torch.set_num_threads(1)


class Tiny(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05, tags: tuple = ("tiny", 1), sharded: str = "none"):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.losses: list[float] = []

    def configure_model(self):
        if self.hparams.sharded == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
        elif self.hparams.sharded == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            if not isinstance(self.net, FSDP):  # FSDP1 on CPU needs device_id=cpu (Lightning passes None)
                self.net = FSDP(self.net, device_id=torch.device("cpu"), use_orig_params=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.seen += x.shape[0]
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=g)
    y = torch.randn(24, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))


def full_state(trainer: L.Trainer, module: Tiny) -> dict:
    """Unsharded model and optimizer state keyed by parameter fqn (collective for sharded models).

    FSDP1: this rank's local shards instead (a full state dict of an FSDP1 model segfaults on CPU
    in torch 2.13, cf. Lightning-AI/pytorch-lightning#21804), compared at equal world sizes."""
    import copy

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = trainer.strategy.model
    opt = trainer.optimizers[0] if trainer.optimizers else None
    if module.hparams.sharded == "fsdp1":
        msd = {k: v.detach().clone() for k, v in model.named_parameters()}
        msd.update({k: v.detach().clone() for k, v in model.named_buffers()})
        return {"model": msd, "optim": copy.deepcopy(opt.state_dict()) if opt is not None else None}
    if isinstance(trainer.strategy, (L.pytorch.strategies.ModelParallelStrategy, L.pytorch.strategies.FSDPStrategy)):
        msd = get_model_state_dict(model, options=opts)
        osd = get_optimizer_state_dict(model, opt, options=opts) if opt is not None else None
    else:
        msd = {k: v.detach().clone() for k, v in module.state_dict().items()}
        osd = get_optimizer_state_dict(module, opt, options=StateDictOptions(full_state_dict=True)) if opt else None
    msd = {k.replace("_forward_module.", "").replace("_fsdp_wrapped_module.", "").replace("module.", ""): v
           for k, v in msd.items()}
    return {"model": msd, "optim": osd}


class Recorder(Callback):
    def __init__(self, args, listings=None):
        self.args = args
        self.listings = listings
        self.pending_at_batch = 0

    def on_train_start(self, trainer, pl_module):
        if self.args.dump_restored:
            state = full_state(trainer, pl_module)
            if pl_module.hparams.sharded == "fsdp1":
                torch.save(state, f"{self.args.dump_restored}.rank{trainer.global_rank}")
            if trainer.is_global_zero:
                state["global_step"] = trainer.global_step
                state["epoch"] = trainer.current_epoch
                state["seen"] = int(pl_module.seen)
                torch.save(state, self.args.dump_restored)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        io = _unickpt_io(trainer.strategy)
        if io is not None and io.last_handle is not None and not io.last_handle.done():
            self.pending_at_batch += 1  # a save is still being written while training goes on

    def on_train_end(self, trainer, pl_module):
        state = full_state(trainer, pl_module)
        if pl_module.hparams.sharded == "fsdp1" and self.args.out:
            torch.save(state, f"{self.args.out}.rank{trainer.global_rank}")
        if trainer.is_global_zero and self.args.out:
            io = _unickpt_io(trainer.strategy)
            sched = trainer.lr_scheduler_configs[0].scheduler.state_dict()
            state.update(losses=pl_module.losses, global_step=trainer.global_step, seen=int(pl_module.seen),
                         sched=sched, callbacks=[type(c).__name__ for c in trainer.callbacks],
                         io=type(trainer.strategy.checkpoint_io).__name__,
                         best_k=sorted(os.path.basename(p) for p in trainer.checkpoint_callback.best_k_models),
                         last=os.path.basename(trainer.checkpoint_callback.last_model_path or ""),
                         pending_at_batch=self.pending_at_batch, listings=self.listings,
                         stall_s=None if io is None or io.last_handle is None else io.last_handle.stats.stall_s)
            torch.save(state, self.args.out)


def _unickpt_io(strategy):
    try:
        from unickpt.lightning._strategies import unickpt_io
    except ImportError:
        return None
    return unickpt_io(strategy)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--io", default="plugin", choices=["plugin", "none"])
    p.add_argument("--resume", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--dump-restored", default=None)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--watch-listings", action="store_true")
    args = p.parse_args()
    listings = None
    if args.watch_listings:
        import listing_spy  # beside this script, on sys.path as its folder

        listings = listing_spy.watch(os.path.abspath(args.ckpt_dir))

    L.seed_everything(0, verbose=False)
    plugins = []
    if args.io == "plugin":
        from unickpt.lightning import UnickptCheckpointIO

        plugins.append(UnickptCheckpointIO())
    sharded = "none"
    if args.strategy == "ddp":
        strategy = "ddp" if args.devices > 1 else "auto"
    elif args.strategy == "ddp_spawn":
        strategy = "ddp_spawn"
    elif args.strategy == "single":
        strategy = "auto"
    elif args.strategy == "mp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy, sharded = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1), "fsdp2"
    elif args.strategy == "mp-full":  # FSDP2, full state dicts through the CheckpointIO
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1,
                                         save_distributed_checkpoint=False)
        sharded = "fsdp2"
    elif args.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        class CPUFSDPStrategy(FSDPStrategy):  # the exact FSDPStrategy type is refused on CPU
            pass

        strategy, sharded = CPUFSDPStrategy(state_dict_type="sharded"), "fsdp1"
    else:
        raise SystemExit(f"unknown strategy {args.strategy}")
    ckpt = ModelCheckpoint(dirpath=args.ckpt_dir, monitor="train_loss", save_top_k=args.top_k, save_last=True,
                           every_n_epochs=1, filename="{epoch}-{step}")
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, plugins=plugins,
                        max_epochs=args.epochs, callbacks=[ckpt, Recorder(args, listings)], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        deterministic=True)
    model = Tiny(sharded=sharded)
    trainer.fit(model, train_dataloaders=data(), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
