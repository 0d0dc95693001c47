"""Accelerate FSDP (SHARDED_STATE_DICT) save_state / load_state through unickpt on 2 CPU processes.

Accelerate selects FSDP only on accelerators (state.py: MULTI_GPU/NPU/XPU/...), never MULTI_CPU, so
after ``Accelerator()`` this script switches both state singletons to ``DistributedType.FSDP`` with an
FSDP plugin. FSDP2: ``accelerator.prepare`` then runs Accelerate's own ``fsdp2_prepare_model``
(DTensor parameters, optimizer re-pointed at them): the state is exactly what Accelerate produces on
GPUs. FSDP1: Accelerate's ``prepare_model`` passes ``device_id=accelerator.device``, which FSDP1
rejects on CPU ("Inconsistent compute device"), so the script wraps the model itself the way
Accelerate does (``FullyShardedDataParallel``, size-based auto wrap, ``use_orig_params=True``) and
``prepare`` keeps the wrapped module. ``torch.distributed.checkpoint.save/load`` are replaced by
functions that raise, so the run fails if Accelerate's DCP route (save_fsdp_model /
save_fsdp_optimizer) is taken.

    accelerate_fsdp.py REPORT CKPT_DIR {1,2} [full]

``full``: ``state_dict_type="FULL_STATE_DICT"`` (Accelerate then writes a gathered ``model.safetensors``):
unickpt gathers the shards of each weight into one process's safetensors file, linked at the folder's root;
the report's ``weights`` is the digest of what ``safetensors`` reads there.
"""
import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

import unickpt.accelerate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_common import full_states, listing, make_model, rng_digest, write_report  # noqa: E402

report_path, out, version = sys.argv[1], sys.argv[2], int(sys.argv[3])
state_dict_type = "FULL_STATE_DICT" if sys.argv[4:] == ["full"] else "SHARDED_STATE_DICT"
acc = Accelerator()
if version == 2:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type,
                                            auto_wrap_policy="size_based_wrap", min_num_params=100,
                                            reshard_after_forward=True)
else:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=state_dict_type,
                                            auto_wrap_policy="size_based_wrap", min_num_params=100,
                                            sharding_strategy="FULL_SHARD", use_orig_params=True)
for shared in (PartialState._shared_state, AcceleratorState._shared_state):
    shared["distributed_type"] = DistributedType.FSDP
AcceleratorState._shared_state["fsdp_plugin"] = plugin
unickpt.accelerate.enable(acc)


def _no_dcp(*args, **kwargs):
    raise AssertionError("torch.distributed.checkpoint was called: Accelerate's own FSDP route was taken")


dcp.save = dcp.load = dcp.async_save = _no_dcp

model = make_model()
if version == 1:
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)
    model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = acc.prepare(model, optimizer)
report = {"distributed_type": str(acc.distributed_type), "is_fsdp2": acc.is_fsdp2,
          "param_types": sorted({type(p).__name__ for p in model.parameters()}),
          "local_shapes": [list(getattr(p, "_local_tensor", p).shape) for p in model.parameters()],
          "fsdp1_units": sum(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())}


def train(steps: int, seed: int) -> None:
    for i in range(steps):
        torch.manual_seed(seed + i + acc.process_index)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


train(2, 0)
saved = full_states(model, optimizer)
rng = rng_digest()
acc.save_state(out)
train(1, 100)
report["perturbed_differs"] = full_states(model, optimizer) != saved
acc.load_state(out)
report["saved"], report["loaded"] = saved, full_states(model, optimizer)
report["rng_saved"], report["rng_loaded"] = rng, rng_digest()
acc.wait_for_everyone()
acc.end_training()
report["files"] = listing(out)
if state_dict_type == "FULL_STATE_DICT":
    from safetensors.torch import load_file

    from accelerate_common import digest  # noqa: E402

    weights: dict = {}
    for name in sorted(n for n in os.listdir(out) if n.endswith(".safetensors")):
        weights.update(load_file(os.path.join(out, name)))
    report["weights"] = digest(weights)
write_report(report_path, acc.process_index, report)
