"""Dtype names as the format stores them (``"bfloat16"``, ``"float32"``: torch's names)."""
from __future__ import annotations

import torch

__all__ = ["dtype_to_str", "str_to_dtype"]


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``. Raises ValueError for a name torch does not know."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in checkpoint (this torch is {torch.__version__})")
    return dtype
