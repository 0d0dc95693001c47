"""unickpt for Megatron: megatron-core ``dist_checkpointing`` strategies and a Megatron-LM launcher.

Importing this module registers the ``unickpt`` backend (v1) in megatron-core's strategy registry::

    from megatron.core import dist_checkpointing
    import unickpt.megatron

    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir, sharded_strategy=("unickpt", 1))
    dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)   # backend read from metadata.json

The sharded state is a unickpt checkpoint in ``ckpt_dir/unickpt`` (see :mod:`unickpt.megatron.strategy`).
Megatron-LM training scripts switch to it with a launch flag, no code change::

    torchrun --nproc_per_node 8 -m unickpt.megatron.launch pretrain_gpt.py --ckpt-format unickpt ...

(see :mod:`unickpt.megatron.launch`). Load errors are unickpt's typed errors that are also megatron-core's
``CheckpointingException`` (see :mod:`unickpt.megatron.errors`).
"""
from .errors import MegatronStateMismatchError, checkpointing_error
from .sharded_state import OBJECT_PREFIX, global_flat_range, is_main_replica
from .strategy import (BACKEND, OBJECT_POLICIES, SUBDIR, VERSION, UnickptLoadShardedStrategy,
                       UnickptSaveShardedStrategy, register, unickpt_dir)

register()

__all__ = ["BACKEND", "VERSION", "SUBDIR", "OBJECT_PREFIX", "OBJECT_POLICIES", "UnickptSaveShardedStrategy",
           "UnickptLoadShardedStrategy", "register", "unickpt_dir", "global_flat_range", "is_main_replica",
           "MegatronStateMismatchError", "checkpointing_error"]
