"""Lightning + unickpt: a Trainer whose every checkpoint goes through unickpt, with any strategy.

    # DDP on 2 CPU processes, 3 epochs, then resume from last.ckpt to epoch 6
    OMP_NUM_THREADS=1 python examples/lightning_train.py --root /tmp/lt_ckpt --epochs 3
    OMP_NUM_THREADS=1 python examples/lightning_train.py --root /tmp/lt_ckpt --epochs 6 --resume

    # FSDP2 (ModelParallelStrategy) saved on 2 processes, resumed on 3 (resharded on load)
    python examples/lightning_train.py --root /tmp/lt_fsdp2 --strategy fsdp2 --devices 2 --epochs 2
    python examples/lightning_train.py --root /tmp/lt_fsdp2 --strategy fsdp2 --devices 3 --epochs 4 --resume

    # the same script without the plugin, switched on from the environment only
    UNICKPT_LIGHTNING=1 python examples/lightning_train.py --root /tmp/lt_env --no-plugin

``--root`` may be an fsspec URL (``s3://bucket/run``; credentials from the usual AWS variables).
After a run, ``unickpt ls ROOT/last.ckpt.unickpt`` and ``unickpt inspect ROOT/last.ckpt.unickpt/step_<N>``
show what was written.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class Regressor(L.LightningModule):
    def __init__(self, width: int = 256, lr: float = 1e-3, fsdp2: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                 nn.Linear(width, 1))

    def configure_model(self):
        if self.hparams.fsdp2:
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="checkpoint directory or fsspec URL")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    p.add_argument("--no-plugin", action="store_true", help="leave the Trainer unmodified (use UNICKPT_LIGHTNING=1)")
    args = p.parse_args()

    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=32, shuffle=True)

    plugins = []
    if not args.no_plugin:
        from unickpt.lightning import UnickptCheckpointIO

        plugins.append(UnickptCheckpointIO())  # async saves; sharded strategies are routed too
    if args.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    else:
        strategy = "ddp" if args.devices > 1 else "auto"
    checkpoints = ModelCheckpoint(dirpath=args.root, monitor="train_loss", save_top_k=2, save_last=True,
                                  every_n_epochs=1)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, plugins=plugins,
                        max_epochs=args.epochs, callbacks=[checkpoints], logger=False, enable_progress_bar=False)
    trainer.fit(Regressor(fsdp2=args.strategy == "fsdp2"), data, ckpt_path="last" if args.resume else None)
    if trainer.is_global_zero:
        print(f"best: {checkpoints.best_model_path}  last: {checkpoints.last_model_path}  "
              f"checkpoint IO: {type(trainer.strategy.checkpoint_io).__name__}")


if __name__ == "__main__":
    main()
