"""Worker-side helpers for the distributed tests: deterministic global tensors laid out on a rank.

Every function here runs inside :class:`unickpt.testing.DistPool` workers (gloo, CPU).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

import unickpt

# name -> (global shape, dtype). Odd sizes so that shards are uneven, some ranks get empty shards.
TENSORS = {
    "a": ((7, 6), torch.float32),
    "b": ((5, 3, 4), torch.bfloat16),
    "c": ((9,), torch.float64),
    "d": ((3, 5), torch.float8_e4m3fn),
    "e": ((2, 1), torch.float16),
}
LAYOUTS = ["replicated", "shard0", "shard1", "replicate_dt", "mesh2d", "flat", "box_rows"]
_MESHES: dict = {}


def global_tensor(name: str) -> torch.Tensor:
    """The reference value of tensor ``name``: same on every rank and every world size."""
    shape, dtype = TENSORS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    t = torch.randn(shape, generator=g, dtype=torch.float32) * 3
    return t.to(dtype)


def mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk-like split of n into parts: (start, length) of part i (trailing parts may be empty)."""
    step = math.ceil(n / parts) if n else 0
    start = min(i * step, n)
    return start, min(step, n - start)


def layout_leaf(name: str, layout: str, value: torch.Tensor | None = None):
    """Rank's leaf for ``name`` in ``layout``; data from ``value`` (default: the reference), else zeros."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = global_tensor(name) if value is None else value
    ws, rank = dist.get_world_size(), dist.get_rank()
    nd = full.dim()
    if layout == "replicated" or (nd == 0 and layout != "flat"):
        return full.clone()
    if layout == "shard0":
        return distribute_tensor(full, mesh((ws,)), [Shard(0)], src_data_rank=None)
    if layout == "shard1":
        return distribute_tensor(full, mesh((ws,)), [Shard(min(1, nd - 1))], src_data_rank=None)
    if layout == "replicate_dt":
        return distribute_tensor(full, mesh((ws,)), [Replicate()], src_data_rank=None)
    if layout == "mesh2d":
        shape = (ws // 2, 2) if ws % 2 == 0 else (ws, 1)
        places = [Shard(0), Shard(min(1, nd - 1))] if nd > 1 else [Replicate(), Shard(0)]
        return distribute_tensor(full, mesh(shape), places, src_data_rank=None)
    if layout == "flat":
        start, length = _split(full.numel(), ws, ws - 1 - rank)  # reversed order: rank 0 holds the tail
        return unickpt.Shard(full.reshape(-1)[start : start + length].clone(), full.shape, flat_range=(start, length))
    if layout == "box_rows":
        start, length = _split(full.shape[0], ws, rank)
        offs = (start,) + (0,) * (nd - 1)
        return unickpt.Shard(full.narrow(0, start, length).clone(), full.shape, offsets=offs)
    raise ValueError(layout)


def local_of(leaf) -> torch.Tensor:
    if isinstance(leaf, unickpt.Shard):
        return leaf.tensor
    if hasattr(leaf, "to_local"):
        return leaf.to_local()
    return leaf


def expected_local(name: str, layout: str) -> torch.Tensor:
    return local_of(layout_leaf(name, layout)).contiguous()


def empty_like_layout(name: str, layout: str):
    shape, dtype = TENSORS[name]
    return layout_leaf(name, layout, torch.zeros(shape, dtype=dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers so that comparisons are bitwise (NaN-safe, fp8-safe)."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.float32)
