"""unickpt plugin for PyTorch FSDP: FSDP1 flat parameters, FSDP2, HSDP, 2-D meshes, and DCP interoperability.

Saving and loading (collective, resharding onto any world size and across FSDP1 <-> FSDP2)::

    import unickpt, unickpt.fsdp
    state = {**unickpt.fsdp.state(model, optim), "step": step}
    unickpt.save(path, state)      # FSDP1: each rank writes its flat-parameter slices, no all-gather
    unickpt.load(path, state)

Code that already calls ``torch.distributed.checkpoint`` keeps doing so and gets unickpt's pipeline
and format by passing ``storage_writer=unickpt.fsdp.StorageWriter(path)`` /
``storage_reader=unickpt.fsdp.StorageReader(path)``. See docs/fsdp.md.
"""
from .state import (MODES, FlatModelState, FlatOptimizerState, StateDictModelState, StateDictOptimizerState,
                    model_state, optimizer_state, state)

__all__ = ["state", "model_state", "optimizer_state", "FlatModelState", "FlatOptimizerState",
           "StateDictModelState", "StateDictOptimizerState", "MODES"]
from .dcp import StorageReader, StorageWriter  # noqa: E402

__all__ += ["StorageWriter", "StorageReader"]
