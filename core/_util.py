"""Small helpers with no place of their own in the layers (imported by several of them)."""
from __future__ import annotations

import contextlib
import gc
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

__all__ = ["gc_paused", "host_bytes"]


def host_bytes(tensor: "torch.Tensor") -> memoryview:
    """The memory of a CPU ``tensor`` (contiguous) as a writable, byte-typed (``"B"``) memoryview, no copy.
    Raises TypeError for a tensor not on the CPU (``Tensor.numpy``)."""
    array = tensor.numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # numpy's stubs lack __buffer__


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for an allocation-heavy pure computation (planning,
    metadata parsing, the caller's part of a save). They create millions of small acyclic objects;
    each generation-2 pass walks every live object, which made planning ~2x slower and grows with
    the heap (measured in benchmarks/plan_sim.py). Reference counting still frees everything; the
    collector resumes after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
