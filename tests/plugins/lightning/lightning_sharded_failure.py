"""A Lightning run with ModelParallelStrategy (FSDP2, unickpt's sharded route) on 2 CPU processes,
saving every step; the writes of step 2's checkpoint fail on global rank 1 only. Prints, per rank, how
``fit`` ended and the checkpoint folder's listing (test_lightning_save_errors.py reads them).

Usage: python lightning_sharded_failure.py DIR raise|warn
"""
import os
import sys

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from unickpt.lightning import UnickptCheckpointIO
from unickpt.testing import Fault, install

folder, on_error = sys.argv[1], sys.argv[2]


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 32)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 32)), batch_size=2)


fault = Fault("write", match="*step=2*", nth=None, enabled=False)
install(fault)


class Arm(pl.Callback):
    def on_train_batch_start(self, trainer, *args):
        fault.enabled = trainer.global_rank == 1


trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=4, logger=False, enable_progress_bar=False,
                     enable_model_summary=False,
                     strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                     plugins=[UnickptCheckpointIO(on_error=on_error)],
                     callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1), Arm()])
try:
    trainer.fit(Model())
    outcome = "finished"
except Exception as e:  # noqa: BLE001 - printed for the test
    outcome = type(e).__name__
# one write per line (atomic on a pipe): the two processes' lines never interleave
os.write(1, f"rank {trainer.global_rank}: {outcome} {sorted(os.listdir(folder))}\n".encode())
