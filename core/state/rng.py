"""``RNGState``: per-rank random number generator state, ready to put in a checkpoint."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .leaves import PerRank, ReshardFn

__all__ = ["RNGState"]


class _Generators:
    """state_dict / load_state_dict over the process-global generators."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            cuda_states = state["cuda"]
            if len(cuda_states) != torch.cuda.device_count():
                raise ValueError(
                    f"RNG state: saved {len(cuda_states)} CUDA generator states, this process sees "
                    f"{torch.cuda.device_count()} devices"
                )
            torch.cuda.set_rng_state_all(cuda_states)


class RNGState(PerRank):
    """This rank's RNG state: python ``random``, numpy's global generator, torch CPU and CUDA.

    Put it in the state (``{"rng": unickpt.RNGState()}``); saving snapshots the generators and
    loading restores them, rank by rank. Stored as JSON (tensors and arrays as raw bytes), so
    loading unpickles nothing.

    Args:
        reshard: what to do when the world size changed since the save (see
            :class:`~unickpt.PerRank`). Default: raise PerRankReshardError, since no RNG stream
            can be continued exactly on another layout. For example
            ``RNGState(reshard=lambda states, rank, ws: states[rank % len(states)])``.
    """

    how_to_reshard = "RNGState(reshard=fn)"

    def __init__(self, reshard: ReshardFn | None = None):
        super().__init__(_Generators(), reshard=reshard)

    def __repr__(self) -> str:
        return "RNGState()"
