"""The leaves a caller (or a framework plugin) puts into a state: sharded tensors and per-rank state."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ..geometry import Box, ChunkSpec, FlatRange

__all__ = ["Shard", "PerRank", "ReshardFn"]

ReshardFn = Callable[[list, int, int], Any]
"""``reshard(saved_states, rank, world_size) -> state``: per-rank state for ``rank`` of a new world."""


class Shard:
    """One rank's piece of a global tensor, the form framework plugins produce.

    Args:
        tensor: the local data. For a box shard its shape must equal ``lengths``; for a flat shard
            its ``numel()`` must equal ``flat_range[1]`` (any shape; it is read row-major).
        global_shape: shape of the whole (unsharded) tensor.
        offsets: for an N-d box shard, the element offset of ``tensor`` in each dimension of the
            global tensor (``len(offsets) == len(global_shape)``).
        flat_range: for an irregular shard, ``(start, length)`` in elements of the row-major
            flattened global tensor (FSDP1 flat parameters, ZeRO partitions).
        replica_id: 0 for the primary copy; ranks that hold the same box or range are replicas and
            the data is written once, whatever their replica ids.

    Exactly one of ``offsets`` and ``flat_range`` is given. Raises ValueError otherwise, or when the
    shapes do not fit the global shape.
    """

    __slots__ = ("tensor", "global_shape", "spec", "replica_id")

    def __init__(
        self,
        tensor: torch.Tensor,
        global_shape: Sequence[int],
        *,
        offsets: Sequence[int] | None = None,
        flat_range: tuple[int, int] | None = None,
        replica_id: int = 0,
    ):
        if (offsets is None) == (flat_range is None):
            raise ValueError("Shard needs exactly one of offsets= (N-d box) or flat_range= (irregular shard)")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Shard.tensor must be a torch.Tensor, got {type(tensor).__name__}")
        self.tensor = tensor
        self.global_shape = tuple(int(n) for n in global_shape)
        self.replica_id = int(replica_id)
        total = math.prod(self.global_shape)
        if offsets is not None:
            offs = tuple(int(o) for o in offsets)
            if len(offs) != len(self.global_shape) or tensor.dim() != len(self.global_shape):
                raise ValueError(
                    f"Shard: offsets {list(offs)} and tensor shape {list(tensor.shape)} must have "
                    f"{len(self.global_shape)} dims like global_shape {list(self.global_shape)}"
                )
            lens = tuple(tensor.shape)
            for d, (o, l, n) in enumerate(zip(offs, lens, self.global_shape)):
                if o < 0 or o + l > n:
                    raise ValueError(
                        f"Shard: dim {d} spans [{o}, {o + l}) outside global size {n} "
                        f"(global_shape {list(self.global_shape)})"
                    )
            self.spec: ChunkSpec = Box(offs, lens)
        else:
            assert flat_range is not None  # exactly one of the two, checked above
            start, length = (int(x) for x in flat_range)
            if length != tensor.numel():
                raise ValueError(f"Shard: flat_range length {length} != tensor.numel() {tensor.numel()}")
            if start < 0 or start + length > total:
                raise ValueError(
                    f"Shard: flat_range [{start}, {start + length}) outside the {total} elements "
                    f"of global_shape {list(self.global_shape)}"
                )
            self.spec = FlatRange(start, length)

    def __repr__(self) -> str:
        return f"Shard({self.spec}, global_shape={list(self.global_shape)}, dtype={self.tensor.dtype})"


class PerRank:
    """Declares state that differs per rank (RNG, dataloader position) and is restored per rank.

    Args:
        obj: an object with ``state_dict()`` / ``load_state_dict()``, or a plain value (python
            containers, numbers, strings, small tensors, numpy arrays). After a load, a stateful
            ``obj`` has been given its state with ``load_state_dict``; a plain value is replaced in
            :attr:`value`.
        reshard: how to derive this rank's state when the checkpoint was saved at another world
            size: ``reshard(saved_states, rank, world_size)`` gets the list of every saved rank's
            state (index = saved rank). Without it such a load raises
            :class:`~unickpt.errors.PerRankReshardError`.
    """

    how_to_reshard = "PerRank(obj, reshard=fn)"
    """How to give this kind of leaf a ``reshard`` rule (what a :class:`~unickpt.errors.PerRankReshardError` says)."""

    def __init__(self, obj: Any, reshard: ReshardFn | None = None):
        self.value = obj
        self.reshard = reshard

    @property
    def is_stateful(self) -> bool:
        return callable(getattr(self.value, "state_dict", None)) and callable(getattr(self.value, "load_state_dict", None))

    def state_dict(self) -> Any:
        return self.value.state_dict() if self.is_stateful else self.value

    def load_state_dict(self, state: Any) -> None:
        if self.is_stateful:
            self.value.load_state_dict(state)
        else:
            self.value = state

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"
