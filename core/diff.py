"""``diff_checkpoints``: which tensors and values differ between two checkpoints, tensor by tensor
(one tensor in memory at a time per checkpoint)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import str_to_dtype
from .collectives import Comm
from .loading import load_checkpoint
from .metadata import CheckpointMetadata, read_metadata
from .state import saved_leaves
from .storage import Storage
from .types import Shard

__all__ = ["Difference", "diff_checkpoints", "read_full_tensor"]


@dataclass(frozen=True)
class Difference:
    """One differing key: ``kind`` is missing_in_a / missing_in_b / dtype / shape / values / object."""

    key: str
    kind: str
    detail: str


def read_full_tensor(path: str, fqn: str, meta: CheckpointMetadata | None = None,
                     storage_options: dict | None = None) -> torch.Tensor:
    """The whole (unsharded) tensor ``fqn`` of checkpoint ``path``, read in this process only."""
    meta = meta or read_metadata(Storage(path, storage_options), path)
    t = meta.tensors[meta.aliases.get(fqn, fqn)]
    out = torch.empty(t.shape, dtype=str_to_dtype(t.dtype))
    state: dict = {}
    node = state
    parts = fqn.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = Shard(out, t.shape, offsets=(0,) * len(t.shape))
    load_checkpoint(Comm.solo(), path, state, strict=False, storage_options=storage_options, redistribute=False)
    return out


def diff_checkpoints(a: str, b: str, *, atol: float = 0.0, storage_options: dict | None = None) -> list[Difference]:
    """Compare two checkpoints key by key. Values are compared bitwise unless ``atol`` > 0 (then
    ``max |a - b| <= atol`` in float64 passes); every differing tensor reports its max abs diff."""
    meta_a = read_metadata(Storage(a, storage_options), a)
    meta_b = read_metadata(Storage(b, storage_options), b)
    keys_a = set(meta_a.tensors) | set(meta_a.aliases)
    keys_b = set(meta_b.tensors) | set(meta_b.aliases)
    out = [Difference(k, "missing_in_b", "tensor") for k in sorted(keys_a - keys_b)]
    out += [Difference(k, "missing_in_a", "tensor") for k in sorted(keys_b - keys_a)]
    for key in sorted(keys_a & keys_b):
        ta = meta_a.tensors[meta_a.aliases.get(key, key)]
        tb = meta_b.tensors[meta_b.aliases.get(key, key)]
        if ta.dtype != tb.dtype:
            out.append(Difference(key, "dtype", f"{ta.dtype} vs {tb.dtype}"))
            continue
        if ta.shape != tb.shape:
            out.append(Difference(key, "shape", f"{list(ta.shape)} vs {list(tb.shape)}"))
            continue
        xa, xb = read_full_tensor(a, key, meta_a, storage_options), read_full_tensor(b, key, meta_b, storage_options)
        if xa.numel() == 0:
            continue
        same_bits = torch.equal(xa.reshape(-1).view(torch.uint8), xb.reshape(-1).view(torch.uint8)) \
            if xa.dtype.itemsize else torch.equal(xa, xb)
        if same_bits:
            continue
        try:
            diff = (xa.to(torch.float64) - xb.to(torch.float64)).abs().max().item()
        except (RuntimeError, TypeError):  # dtypes without float conversion
            diff = float("nan")
        if not (atol > 0 and diff <= atol):
            n = int((xa != xb).sum().item()) if xa.dtype != torch.bool else int((xa ^ xb).sum().item())
            out.append(Difference(key, "values", f"max |a-b| = {diff:.6g}, {n} of {xa.numel()} elements differ"))
    _, _, obj_a = saved_leaves(meta_a.state_tree)
    _, _, obj_b = saved_leaves(meta_b.state_tree)
    for key in sorted(set(obj_a) | set(obj_b)):
        if obj_a.get(key) != obj_b.get(key):
            kind = "missing_in_b" if key not in obj_b else "missing_in_a" if key not in obj_a else "object"
            out.append(Difference(key, kind, f"{str(obj_a.get(key))[:60]} vs {str(obj_b.get(key))[:60]}"))
    return out
