"""Helpers shared by the Accelerate test scripts (no unickpt import: the scripts stay unmodified)."""
from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import torch
from torch import nn


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 4))


def make_norm() -> nn.Module:
    """A second model whose buffers (BatchNorm running statistics) differ between DDP processes after
    each forward: DDP broadcasts process 0's buffers at the start of forward, then each process
    updates them from its own batch."""
    return nn.BatchNorm1d(4)


def make_data(n: int = 32) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


def _hash_tree(h: "hashlib._Hash", x) -> None:
    if isinstance(x, torch.Tensor):
        h.update(str((x.dtype, tuple(x.shape))).encode())
        h.update(x.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            h.update(repr(k).encode())
            _hash_tree(h, x[k])
    elif isinstance(x, (list, tuple)):
        for v in x:
            _hash_tree(h, v)
    else:
        h.update(repr(x).encode())


def digest(x) -> str:
    h = hashlib.sha256()
    _hash_tree(h, x)
    return h.hexdigest()[:16]


def full_states(model: nn.Module, optimizer) -> tuple[str, str]:
    """Digests of the full model and optimizer state (fqn-keyed, layout-independent)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    inner = getattr(optimizer, "optimizer", optimizer)
    model_sd = get_model_state_dict(model, options=opts)
    return digest(model_sd), digest(get_optimizer_state_dict(model, inner, options=opts))


def rng_digest() -> str:
    return digest([torch.get_rng_state(), repr(random.getstate()), repr(np.random.get_state()[1].tolist())])


class Progress:
    """A registered checkpointing object: the epochs done, a history, and two tensors that differ
    between processes (this process's last losses and their running sum)."""

    def __init__(self):
        self.epoch = -1
        self.history: list[float] = []
        self.recent = torch.zeros(4)
        self.total = torch.zeros(())

    def record(self, loss: torch.Tensor) -> None:
        self.history.append(round(float(loss.detach()), 6))
        self.recent.copy_(torch.cat([self.recent[1:], loss.detach().reshape(1)]))
        self.total += loss.detach()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "history": list(self.history), "recent": self.recent, "total": self.total}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.history = int(sd["epoch"]), list(sd["history"])
        self.recent.copy_(sd["recent"])
        self.total.copy_(sd["total"])

    def report(self) -> dict:
        return {"epoch": self.epoch, "history": list(self.history), "recent": self.recent.tolist(),
                "total": float(self.total)}


def prepare_training(acc) -> tuple:
    """The training script's objects, prepared by ``acc``, with a :class:`Progress` registered for
    checkpointing: ``(model, optimizer, scheduler, loader, norm, progress)``."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=4, shuffle=True)
    norm = make_norm()
    model, optimizer, scheduler, loader, norm = acc.prepare(model, optimizer, scheduler, loader, norm)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    return model, optimizer, scheduler, loader, norm, progress


def write_report(path: str, rank: int, report: dict) -> None:
    with open(f"{path}.{rank}.json", "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)


def listing(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
