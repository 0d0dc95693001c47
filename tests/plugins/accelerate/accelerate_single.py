"""One process (no torchrun): resume the 2-process checkpoints of accelerate_train.py (DDP) and
accelerate_fsdp.py (FSDP2), then overwrite, pickling, total_limit and failure checks.

    accelerate_single.py REPORT DDP_CHECKPOINT FSDP2_CHECKPOINT FSDP1_CHECKPOINT WORKDIR
"""
import json
import os
import subprocess
import sys
import threading

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import unickpt
import unickpt.accelerate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_common import (digest, full_states, make_model, prepare_training, rng_digest,  # noqa: E402
                               write_report)

report_path, ddp_ckpt, fsdp_ckpt, fsdp1_ckpt, work = sys.argv[1:6]
report: dict = {}


def error(fn) -> list:
    try:
        fn()
    except Exception as e:  # the test checks type and message
        return [type(e).__name__, str(e)]
    return ["no error", ""]


# 1. the DDP run's checkpoint_1, the same script objects, on 1 process
acc = Accelerator()
model, optimizer, scheduler, loader, norm, progress = prepare_training(acc)
unickpt.accelerate.enable(acc)  # default: rng_reshard="error"
before = full_states(model, optimizer)
report["rng_error"] = error(lambda: acc.load_state(ddp_ckpt))
report["untouched_after_error"] = full_states(model, optimizer) == before
unickpt.accelerate.enable(acc, rng_reshard="by_rank")
acc.load_state(ddp_ckpt)
gen = loader.batch_sampler.sampler.generator if hasattr(loader.batch_sampler, "sampler") else None
report["ddp_loaded"] = {"model": full_states(model, optimizer)[0], "optim": full_states(model, optimizer)[1],
                        "rng": rng_digest(), "lr": scheduler.get_last_lr(), "progress": progress.report(),
                        "generator": digest(gen.get_state()) if gen is not None else None,
                        "loader_epoch": loader.iteration, "norm": digest(norm.state_dict())}
for x, y in loader:  # one more epoch on 1 process
    loss = torch.nn.functional.mse_loss(norm(model(x)), y)
    acc.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
report["trained_after_resume"] = bool(torch.isfinite(loss).item())

# 2. the FSDP2 checkpoint into a plain module on 1 process
acc2 = Accelerator()
model2 = make_model()
optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
model2, optimizer2 = acc2.prepare(model2, optimizer2)
unickpt.accelerate.enable(acc2, rng_reshard="keep")
rng_before = rng_digest()
acc2.load_state(fsdp_ckpt)
report["fsdp_loaded"] = list(full_states(model2, optimizer2))
report["rng_kept"] = rng_digest() == rng_before
acc5 = Accelerator()
model5 = make_model()
optimizer5 = torch.optim.AdamW(model5.parameters(), lr=1e-2)
model5, optimizer5 = acc5.prepare(model5, optimizer5)
unickpt.accelerate.enable(acc5, rng_reshard="keep")
acc5.load_state(fsdp1_ckpt)  # FSDP1 flat-parameter shards (2 processes) -> a plain module and optimizer
report["fsdp1_loaded"] = list(full_states(model5, optimizer5))

# 2b. a folder Accelerate wrote itself (unickpt off for acc2) still loads with unickpt on
unickpt.accelerate.disable(acc2)
native = os.path.join(work, "native")
acc2.save_state(native)
native_saved = full_states(model2, optimizer2)
with torch.no_grad():
    for p in model2.parameters():
        p.zero_()
unickpt.accelerate.enable(acc2, rng_reshard="keep")
acc2.load_state(native)
report["native"] = {"files": sorted(os.listdir(native)), "reloaded": full_states(model2, optimizer2) == native_saved}

# 3. saving twice into one folder: the newest save is kept, loaded back bitwise
unickpt.accelerate.enable(acc2, async_save=True)
same = os.path.join(work, "same")
# hold the commit (the write of metadata.json): save_state must return before its checkpoint can be committed
from unickpt.testing import Fault, inject  # noqa: E402

with inject(Fault("rename", match="*metadata.json", action="hold", delay_s=60)) as (gate,):
    acc2.save_state(same)
    report["async_returned_uncommitted"] = not os.path.exists(os.path.join(same, "unickpt", "step_0", "metadata.json"))
    gate.release()
with torch.no_grad():
    for p in model2.parameters():
        p.add_(1.0)
second = full_states(model2, optimizer2)
acc2.save_state(same)
unickpt.accelerate.wait()
report["same_listing"] = sorted(os.listdir(os.path.join(same, "unickpt")))
# the newest save's weights at the folder's root, as Accelerate's own save_state leaves them: hard links to
# its safetensors file (the first save's link was replaced)
from safetensors.torch import load_file  # noqa: E402

weights_file = os.path.join(same, "model.safetensors")
root_weights = load_file(weights_file)
own = acc2.unwrap_model(model2).state_dict()
report["same_weights"] = {
    "names": sorted(os.listdir(same)),
    "equal": sorted(root_weights) == sorted(own) and all(torch.equal(root_weights[k], v) for k, v in own.items()),
    "linked": os.path.samefile(weights_file, os.path.join(same, "unickpt", "step_1", "model.safetensors")),
}
with torch.no_grad():
    for p in model2.parameters():
        p.zero_()
acc2.load_state(same)
report["same_reloaded"] = full_states(model2, optimizer2) == second


# 4. a value only pickle can store, and safe_serialization
class Opaque:
    def __init__(self, n):
        self.n = n

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.n == self.n


class Holder:
    def __init__(self):
        self.value = Opaque(3)

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


holder = Holder()
acc2.register_for_checkpointing(holder)
report["unsafe_save"] = error(lambda: acc2.save_state(os.path.join(work, "unsafe")))
acc2.save_state(os.path.join(work, "pickled"), safe_serialization=False)
holder.value = Opaque(0)
report["unsafe_load"] = error(lambda: acc2.load_state(os.path.join(work, "pickled")))
unickpt.accelerate.enable(acc2, allow_pickle=True)
acc2.load_state(os.path.join(work, "pickled"))
report["pickled_reloaded"] = holder.value == Opaque(3)
acc2._custom_objects.remove(holder)

# 5. total_limit=1: a failing save keeps the last committed checkpoint; rotation after commit
project = os.path.join(work, "project")
acc3 = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True,
                                                       total_limit=1))
model3 = acc3.prepare(make_model())
unickpt.accelerate.enable(acc3, async_save=False)
acc3.save_state()
first = full_states(model3, torch.optim.SGD(model3.parameters(), lr=0.1))[0]
acc3.register_for_checkpointing(Holder())
report["failed_save"] = error(lambda: acc3.save_state())
report["after_failed_save"] = sorted(os.listdir(os.path.join(project, "checkpoints")))
acc3._custom_objects.clear()
# what a run killed during its next save leaves: checkpoint_1 with data but no metadata.json, and the
# writer record of a process that is gone
dead = subprocess.Popen([sys.executable, "-c", "pass"])
dead.wait()
crashed = os.path.join(project, "checkpoints", "checkpoint_1", "unickpt", "step_0")
os.makedirs(os.path.join(crashed, "data"))
with open(os.path.join(crashed, "data", "0_0.bin"), "wb") as f:
    f.write(b"\0" * 64)
with open(os.path.join(crashed, ".unickpt-writer"), "w") as f:
    json.dump({"host": os.uname().nodename, "pid": dead.pid, "time": 0}, f)
with torch.no_grad():
    for p in model3.parameters():
        p.zero_()
acc3.load_state()  # the newest loadable folder: checkpoint_0 (checkpoint_1 never committed)
report["reloaded_after_failure"] = full_states(model3, torch.optim.SGD(model3.parameters(), lr=0.1))[0] == first
report["iteration_after_load"] = acc3.save_iteration
acc3.save_state()
report["after_rotation"] = sorted(os.listdir(os.path.join(project, "checkpoints")))
report["rotated_committed"] = os.path.exists(os.path.join(project, "checkpoints", "checkpoint_2", "unickpt", "step_0",
                                                         "metadata.json"))
report["not_a_checkpoint"] = error(lambda: acc3.load_state(os.path.join(project, "checkpoints")))

# 5b. switching to unickpt mid-run: Accelerate wrote checkpoint_0 itself, a new run with unickpt resumes
project6 = os.path.join(work, "project6")
config6 = dict(project_dir=project6, automatic_checkpoint_naming=True, total_limit=3)
acc6 = Accelerator(project_config=ProjectConfiguration(**config6))
model6 = acc6.prepare(make_model())
acc6.save_state()  # unickpt is not enabled for acc6: Accelerate's own files
acc7 = Accelerator(project_config=ProjectConfiguration(**config6))
model7 = acc7.prepare(make_model())
unickpt.accelerate.enable(acc7)
acc7.load_state()
acc7.save_state()
unickpt.accelerate.wait()
report["switched"] = {name: sorted(os.listdir(os.path.join(project6, "checkpoints", name)))
                      for name in os.listdir(os.path.join(project6, "checkpoints"))}

# 6. save / load pre-hooks that take model 0 out (the hook saves it its own way)
acc4 = Accelerator()
model_a, model_b = make_model(), make_model()
opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-2)
opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-2)
model_a, model_b, opt_a, opt_b = acc4.prepare(model_a, model_b, opt_a, opt_b)
for m, o in ((model_a, opt_a), (model_b, opt_b)):
    acc4.backward(m(torch.ones(2, 8)).sum())
    o.step()
    o.zero_grad()
unickpt.accelerate.enable(acc4)


def save_hook(models, weights, output_dir):
    weights.pop(0)
    with open(os.path.join(output_dir, "model_a.txt"), "w") as f:
        f.write("saved by the hook")


def load_hook(models, input_dir):
    models.pop(0)


acc4.register_save_state_pre_hook(save_hook)
acc4.register_load_state_pre_hook(load_hook)
hooked = os.path.join(work, "hooked")
saved_a, saved_b = full_states(model_a, opt_a), full_states(model_b, opt_b)
acc4.save_state(hooked)
unickpt.accelerate.wait()
with torch.no_grad():
    for p in list(model_a.parameters()) + list(model_b.parameters()):
        p.add_(1.0)
changed_a = full_states(model_a, opt_a)[0]
acc4.load_state(hooked)
meta = unickpt.CheckpointMetadata.from_json(open(os.path.join(hooked, "unickpt", "step_0", "metadata.json")).read())
report["hooks"] = {"folder": sorted(os.listdir(hooked)),
                   "model_prefixes": sorted({".".join(k.split(".")[:2]) for k in meta.tensors
                                             if k.startswith("models.")}),
                   "a_untouched": full_states(model_a, opt_a)[0] == changed_a,
                   "opt_a_restored": full_states(model_a, opt_a)[1] == saved_a[1],
                   "b_restored": full_states(model_b, opt_b) == saved_b}
# 6b. one optimizer over two prepared models (Accelerate saves its index-keyed state dict)
acc9 = Accelerator()
enc, head = make_model(), torch.nn.Linear(4, 2)
opt9 = torch.optim.AdamW(list(enc.parameters()) + list(head.parameters()), lr=1e-2)
enc, head, opt9 = acc9.prepare(enc, head, opt9)
acc9.backward(head(enc(torch.ones(2, 8))).sum())
opt9.step()
unickpt.accelerate.enable(acc9)
spanning = os.path.join(work, "spanning")
saved9 = digest(opt9.optimizer.state_dict())
acc9.save_state(spanning)
unickpt.accelerate.wait()
acc9.backward(head(enc(torch.ones(2, 8))).sum())
opt9.step()
changed9 = digest(opt9.optimizer.state_dict()) != saved9
acc9.load_state(spanning)
meta9 = unickpt.CheckpointMetadata.from_json(open(os.path.join(spanning, "unickpt", "step_0", "metadata.json")).read())
report["spanning"] = {"changed": changed9, "restored": digest(opt9.optimizer.state_dict()) == saved9,
                      "keys": sorted(k for k in meta9.tensors if k.startswith("optimizers.0.state.")
                                     and k.endswith(".exp_avg"))}

# 7. enabled for every accelerator, disabled for one: that one writes Accelerate's own files
acc8 = Accelerator()
model8 = acc8.prepare(make_model())
unickpt.accelerate.enable()
unickpt.accelerate.disable(acc8)
acc8.save_state(os.path.join(work, "disabled"))
report["disabled_one"] = [unickpt.accelerate.is_enabled(acc8), unickpt.accelerate.is_enabled(None),
                          sorted(os.listdir(os.path.join(work, "disabled")))]
unickpt.accelerate.disable()
acc3.end_training()
write_report(report_path, 0, report)
