"""A small Hugging Face Trainer run (a random LlamaForCausalLM on random tokens, CPU, DDP over gloo when
launched by torchrun), for test_trainer.py and benchmarks/trainer_save.py.

    python trainer_worker.py OUT --max-steps 8 --save-steps 2 [--resume PATH|last] [--unickpt] [--hidden 32]
                             [--deepspeed STAGE | --fsdp SHARDED_STATE_DICT|FULL_STATE_DICT]

FSDP on the CPU: Accelerate selects FSDP only on accelerators (``state.py``: MULTI_GPU/NPU/XPU/...), never
MULTI_CPU, so Trainer's accelerator would run DDP. ``--fsdp`` switches Accelerate's state singletons to
``DistributedType.FSDP`` with Trainer's own FSDP plugin right after Trainer creates its accelerator (as
``tests/plugins/accelerate/accelerate_fsdp.py`` does): ``accelerator.prepare`` then runs Accelerate's
``fsdp2_prepare_model``, and Trainer takes its FSDP paths (its own save: ``save_fsdp_model`` /
``save_fsdp_optimizer``), as on GPUs.

Writes ``OUT/losses-<tag><world>.json`` (rank 0): the loss and the seconds of every step this run took
(``on_step_begin`` to ``on_step_end``: with overlap snapshots the optimizer step's wait for a save's copy
is inside the step after the save), the seconds of each ``Trainer._save_checkpoint`` call, the wall time
of ``train()`` (which waits for pending saves).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--save-steps", type=int, default=2)
    ap.add_argument("--save-total-limit", type=int, default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--unickpt", action="store_true")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--save-only-model", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--deepspeed", type=int, default=None, help="a ZeRO stage: Trainer under DeepSpeed (CPU)")
    ap.add_argument("--load-best", action="store_true",
                    help="evaluate at each save, load_best_model_at_end; report whether the final weights are the "
                         "best checkpoint's model.safetensors")
    ap.add_argument("--fsdp", default=None, choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"],
                    help="Trainer under FSDP2 with this state dict type (CPU: see cpu_fsdp)")
    a = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    if a.unickpt:
        import unickpt.transformers

        unickpt.transformers.enable()

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> dict:
            x = torch.randint(0, a.vocab, (a.seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x}

    losses: dict[int, float] = {}
    stalls: list[float] = []
    step_s: dict[int, float] = {}  # global step -> seconds from on_step_begin to on_step_end

    class Record(TrainerCallback):
        t0 = 0.0

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

        def on_step_begin(self, args, state, control, **kw):
            Record.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_s[state.global_step] = time.perf_counter() - Record.t0

    class Timed(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if a.fsdp is not None:
                from accelerate.state import AcceleratorState, PartialState
                from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

                for shared in (PartialState._shared_state, AcceleratorState._shared_state):
                    shared["distributed_type"] = DistributedType.FSDP
                AcceleratorState._shared_state["fsdp_plugin"] = FullyShardedDataParallelPlugin(
                    **self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True

        def _save_checkpoint(self, model, trial):
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            stalls.append(time.perf_counter() - t0)

    torch.manual_seed(0)
    heads = max(1, a.hidden // 16)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=heads, num_key_value_heads=heads)
    args = TrainingArguments(a.out, save_steps=a.save_steps, max_steps=a.max_steps, save_total_limit=a.save_total_limit,
                             report_to=[], use_cpu=True, per_device_train_batch_size=a.batch, logging_steps=1,
                             seed=0, save_only_model=a.save_only_model, ddp_backend="gloo", disable_tqdm=True,
                             dataloader_num_workers=0, learning_rate=1e-3,
                             eval_strategy="steps" if a.load_best else "no",
                             eval_steps=a.save_steps if a.load_best else None, load_best_model_at_end=a.load_best,
                             metric_for_best_model="loss" if a.load_best else None,
                             fsdp="full_shard auto_wrap" if a.fsdp else "",
                             fsdp_config={"version": 2, "state_dict_type": a.fsdp,
                                          "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]} if a.fsdp else None,
                             deepspeed=None if a.deepspeed is None else {
                                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
                                 "zero_optimization": {"stage": a.deepspeed}})
    evaluation = torch.utils.data.Subset(Tokens(), range(8)) if a.load_best else None
    trainer = Timed(LlamaForCausalLM(cfg), args, train_dataset=Tokens(), eval_dataset=evaluation, callbacks=[Record()])
    resume: str | bool | None = a.resume
    if a.resume == "last":
        resume = True
    t_start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    best = None
    if a.load_best:  # the final weights (gathered under FSDP: collective) against the best checkpoint's files
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        final = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        stored: dict = {}
        folder = trainer.state.best_model_checkpoint
        for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
            stored.update(load_file(os.path.join(folder, name)))
        best = {"checkpoint": os.path.basename(folder), "equal": trainer.args.process_index != 0 or (
            sorted(stored) == sorted(final) and all(torch.equal(stored[k], final[k]) for k in final))}
    if trainer.args.process_index == 0:
        with open(os.path.join(a.out, f"losses-{a.tag}{world}.json"), "w") as f:
            json.dump({"losses": {str(k): v for k, v in sorted(losses.items())}, "stalls": stalls,
                       "step_s": {str(k): v for k, v in sorted(step_s.items())}, "enabled": bool(a.unickpt),
                       "params": sum(p.numel() for p in trainer.model.parameters()), "best": best,
                       "train_s": time.perf_counter() - t_start}, f)
    import torch.distributed as dist

    if dist.is_initialized():  # torn down here, not at interpreter exit: under DeepSpeed on the CPU a group
        dist.barrier()  # left to the exit hooks aborted one process ("terminate called without an active
        dist.destroy_process_group()  # exception") in a CI run of Trainer's own DeepSpeed save


if __name__ == "__main__":
    main()
