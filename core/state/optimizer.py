"""An optimizer saved or loaded without its model's weights: its state keyed by parameter fqn.

The core pairs an optimizer with the ``nn.Module`` next to it in a state (:mod:`.flat`) and stores its
state under the parameters' fqns (``optimizer.state.<param fqn>.exp_avg``), which is what lets it
reshard. Where the model's weights are not part of the save or the load (they are read from another
file, or a save hook took them out), :class:`OptimizerState` gives the same fqn-keyed layout through
torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, so a checkpoint saved with the
model loads into it and the other way round. Runs on the caller's thread; no collective.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["OptimizerState"]


class OptimizerState:
    """``optimizer``'s state as a stateful leaf, keyed by the fqns ``model`` gives its parameters (with
    ``model=None``, no module holds them: the optimizer's own ``state_dict()``, keyed by parameter index).

    Loading it never touches the model's weights (only the optimizer's state and hyper-parameters).
    """

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        if self.model is None:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        if self.model is None:
            self.optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)
