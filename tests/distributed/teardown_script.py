"""torchrun script for test_dist_semantics.py: an async save, then at once ``destroy_process_group()``
and an abrupt end of the process (``os._exit``: no atexit handlers, no thread joins). Ending the group
must wait for the save in flight on it, so the checkpoint is committed.

    torchrun --nproc_per_node=2 tests/distributed/teardown_script.py PATH [group]

``group``: the save runs on a subgroup of all ranks, and that subgroup is destroyed first (then the world).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group  # bound before unickpt wraps it: must wait too

import unickpt


def main() -> None:
    path, how = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "world")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size()))) if how == "group" else None
    g = torch.Generator().manual_seed(7)
    # 64 MB replicated (written once, split between the ranks) and 8 MB per rank (a DTensor-free shard)
    state = {"w": torch.randn(16 << 20, generator=g),
             "mine": unickpt.Shard(torch.full((2 << 20,), float(rank)), (dist.get_world_size() * (2 << 20),),
                                   offsets=(rank * (2 << 20),)),
             "step": 5}
    handle = unickpt.save(path, state, async_save=True, process_group=group)
    assert not handle.done(), "the save finished inside the call: the test would prove nothing"
    if group is not None:
        destroy_process_group(group)
    destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
