"""Every process saves into, and loads from, its own temporary folder (Accelerate's own
test_distributed_data_loop.py does this with a stateful dataloader: each process writes its own files
into its own folder). It does not import unickpt; run it with UNICKPT_ACCELERATE=1.

    accelerate_own_folders.py REPORT
"""
import os
import sys
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_common import full_states, make_data, make_model, rng_digest, write_report  # noqa: E402

acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
model = make_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = torch.utils.data.DataLoader(make_data(), batch_size=2)
model, optimizer, loader = acc.prepare(model, optimizer, loader)
report = {}
with tempfile.TemporaryDirectory() as tmpdir:  # a different folder on every process
    rest = []
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            acc.save_state(tmpdir)
            saved = full_states(model, optimizer), rng_digest()
        elif step > 2:
            rest.append(x.tolist())
    acc.load_state(tmpdir)
    report["restored"] = (full_states(model, optimizer), rng_digest()) == saved
    report["resumed_batches"] = [x.tolist() for x, _ in loader] == rest and len(rest) == 5
    report["listing"] = sorted(os.listdir(tmpdir))
write_report(sys.argv[1], acc.process_index, report)
acc.end_training()
