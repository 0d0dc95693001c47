"""An ordinary Accelerate training script (it does not import unickpt): 3 epochs, save_state after each
epoch with automatic checkpoint naming and total_limit=2, a scheduler, a shuffled dataloader, dropout,
a second model with BatchNorm buffers that differ between processes, and a registered object (with
tensors that differ between processes too). With UNICKPT_ACCELERATE=1 its checkpoints go through unickpt.

    train:  accelerate_train.py REPORT PROJECT train
    resume: accelerate_train.py REPORT PROJECT resume CHECKPOINT_DIR   (load, then finish the epochs)
"""
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_common import digest, full_states, prepare_training, rng_digest, write_report  # noqa: E402

EPOCHS = 3
report_path, project, mode = sys.argv[1], sys.argv[2], sys.argv[3]
acc = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True,
                                                      total_limit=2))
model, optimizer, scheduler, loader, norm, progress = prepare_training(acc)
report = {"world": acc.num_processes, "saves": {}}


def snapshot() -> dict:
    m, o = full_states(model, optimizer)
    gen = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler).sampler.generator
    return {"model": m, "optim": o, "rng": rng_digest(), "lr": scheduler.get_last_lr(), "step": acc.step,
            "progress": progress.report(), "norm": digest(acc.unwrap_model(norm).state_dict()),
            "iteration": acc.save_iteration, "loader_epoch": loader.iteration,
            "generator": digest(gen.get_state()) if gen is not None else None}


start = 0
if mode == "resume":
    acc.load_state(sys.argv[4])
    report["loaded"] = snapshot()
    start = progress.epoch + 1
for epoch in range(start, EPOCHS):
    model.train()
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(norm(model(x)), y)
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.record(loss)
    progress.epoch = epoch
    if mode == "train":
        acc.save_state()
        report["saves"][str(epoch)] = snapshot()
report["final"] = snapshot()
acc.wait_for_everyone()
acc.end_training()
report["files"] = sorted(os.listdir(os.path.join(project, "checkpoints")))
# the first model's weights as Hugging Face safetensors files at each folder's root (what Accelerate's own
# save_state names model.safetensors): digests of what safetensors reads, compared with the saves' own
from safetensors.torch import load_file  # noqa: E402

report["weights"] = {}
for name in report["files"]:
    folder = os.path.join(project, "checkpoints", name)
    shards = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    merged: dict = {}
    for shard in shards:
        merged.update(load_file(os.path.join(folder, shard)))
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    report["weights"][name] = {"names": sorted(os.listdir(folder)), "digest": digest(merged),
                               "index_files": sorted(set(index["weight_map"].values())),
                               "index_keys": sorted(index["weight_map"]) == sorted(merged)}
write_report(report_path, acc.process_index, report)
