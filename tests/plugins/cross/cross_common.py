"""Shared by the cross-framework workers (tests/plugins/cross/): one model, one data stream, one optimizer
and LR schedule, whichever framework trains it, so that a run resumed in another framework can be
compared with an uninterrupted one step by step.

The data of step ``s`` (1-based) is a global batch of ``GLOBAL_BATCH`` rows drawn from a generator seeded
with ``s``; rank ``r`` of ``w`` trains on rows ``[r * GLOBAL_BATCH / w, (r + 1) * GLOBAL_BATCH / w)``. Every
framework averages gradients over its data-parallel ranks, so each step's update is the gradient of the
global batch's mean loss whatever the world size (up to the order of floating-point sums).
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

GLOBAL_BATCH = 12  # divisible by 2 and 3
MEGATRON_CONFIG = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                   "ffn_hidden_size": 48, "vocab_size": 64, "layernorm_epsilon": 1e-5, "rotary_base": 10000}
"""The Llama-like megatron-core GPT of megatron_hf.py (grouped-query attention: 4 heads in 2 groups)."""
TOKENS = torch.tensor([[5, 17, 3, 60, 22, 41, 8, 33, 12, 0, 63, 7]])
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01


class Net(nn.Module):
    """Odd sizes, so that 2 and 3 ranks shard every parameter unevenly; a persistent buffer."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 24), nn.Tanh(), nn.Linear(24, 4))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return self.body(x) * self.scale


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def lr_lambda(step: int) -> float:
    """Warm up over 5 steps, then decay: the LR differs at every step, so a scheduler that did not move
    shows in the losses."""
    return min(1.0, (step + 1) / 5) * 0.97 ** step


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def global_mean(loss: torch.Tensor) -> float:
    """The global batch's mean loss (every rank holds as many rows)."""
    import torch.distributed as dist

    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def write(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Unsharded, fqn-keyed model and optimizer state (torch's own full-state-dict API; collective)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    out = {f"param.{k}": v.detach().clone() for k, v in msd.items()}
    for name, st in osd["state"].items():
        for key, v in st.items():
            out[f"{key}.{name}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def compare(saved: dict, loaded: dict) -> list[str]:
    """Keys whose tensors are not bitwise equal (dtype, shape and bytes), plus keys on one side only."""
    bad = sorted(set(saved) ^ set(loaded))
    for k in sorted(set(saved) & set(loaded)):
        a, b = saved[k], loaded[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                                                                        b.reshape(-1).view(torch.uint8) if b.numel() else b):
            bad.append(k)
    return bad
