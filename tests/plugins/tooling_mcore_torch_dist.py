"""Writes a small Megatron-core ``torch_dist`` checkpoint on the CPU, for test_tooling_frameworks.py.

    torchrun --nproc_per_node=2 tests/plugins/tooling_mcore_torch_dist.py OUT_DIR

``OUT_DIR/ckpt``: a weight split by rows over the 2 ranks (TP-style), a stacked-layer tensor
(``prepend_axis_num=1``), a replicated bias, a per-rank ShardedObject and common values;
``OUT_DIR/expected.pt``: the full tensors (rank 0).
"""
import os
import sys

import torch

if not torch.cuda.is_available():  # megatron-core 0.16 calls these on its checkpoint path (test-only shim)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None

import torch.distributed as dist  # noqa: E402


def main(out: str) -> None:
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    full = {"decoder.weight": torch.randn(6, 4, generator=g), "decoder.bias": torch.randn(4, generator=g),
            "layers.norm": torch.randn(2, 3, generator=g).to(torch.bfloat16)}
    rows = full["decoder.weight"].shape[0] // n
    sd = {
        "decoder.weight": ShardedTensor.from_rank_offsets(
            "decoder.weight", full["decoder.weight"][r * rows : (r + 1) * rows].clone(), (0, r, n)),
        "decoder.bias": ShardedTensor.from_rank_offsets("decoder.bias", full["decoder.bias"].clone(), replica_id=r),
        "layers": [ShardedTensor.from_rank_offsets("layers.norm", full["layers.norm"][i].clone(), (0, i, 2),
                                                   replica_id=r, prepend_axis_num=1) for i in range(2)],
        "rng": ShardedObject("rng_state", {"seed": 1000 + r}, (n,), (r,), replica_id=0),
        "iteration": 7,
        "args": {"tp": n, "lr": 0.5},
    }
    os.makedirs(os.path.join(out, "ckpt"), exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, os.path.join(out, "ckpt"))
    if r == 0:
        torch.save(full, os.path.join(out, "expected.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
