"""Test fixture: a training script written the way Megatron-LM's are, knowing nothing of unickpt.

Like megatron/training (core_v0.16.1): ``--ckpt-format`` only accepts the built-in formats (argparse
``choices``), the save branch for ``torch_dist`` asks ``get_default_save_sharded_strategy(args.ckpt_format)``
(imported by name, as megatron/training/checkpointing.py does), ``--async-save`` goes through megatron's
``AsyncCallsQueue``, and the load picks its strategy from the checkpoint's metadata.json. Run by
tests/plugins/megatron/test_megatron.py under ``torchrun -m unickpt.megatron.launch``; writes a JSON result (rank 0).
"""
import argparse
import json
import os


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-format", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"], default="torch_dist")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--save", required=True)
    p.add_argument("--result", default=None)
    args = p.parse_args()

    import megatron_cuda_shim  # noqa: F401  (CPU-only CI: megatron's async queue calls torch.cuda)
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import megatron_workers as W

    dist.init_process_group("gloo")
    W.setup(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, 1)
    want = W.full_tensors()
    iteration = 7
    ckpt = os.path.join(args.save, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(ckpt)
    dist.barrier()
    state = W._M["model"].sharded_state_dict()
    state["iteration"] = iteration
    if args.ckpt_format == "torch_dist":
        strategy = get_default_save_sharded_strategy(args.ckpt_format)
        req = dist_checkpointing.save(state, ckpt, strategy, async_sharded_save=args.async_save)
        if args.async_save:
            queue = AsyncCallsQueue()
            queue.schedule_async_request(req)
            W.fill(42)  # the next training steps
            queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
            queue.close()
    else:
        raise SystemExit(f"this fixture only implements torch_dist, got {args.ckpt_format}")

    W.fill(3)
    state = W._M["model"].sharded_state_dict()
    state["iteration"] = 0
    loaded = dist_checkpointing.load(state, ckpt)
    it = loaded.pop("iteration")
    W._M["model"].load_state_dict(loaded)
    got = W.full_tensors()
    if dist.get_rank() == 0 and args.result:
        with open(os.path.join(ckpt, "metadata.json")) as f:
            backend = json.load(f)["sharded_backend"]
        equal = sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
        with open(args.result, "w") as f:
            json.dump({"ckpt_format_seen": args.ckpt_format, "sharded_backend": backend, "async": args.async_save,
                       "bitwise_equal": equal, "iteration": it}, f)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
