"""Tagged JSON for non-tensor state: python containers, numbers, small tensors, numpy arrays.

JSON keeps what python's ``json`` would lose by tagging it: tuples, dicts with non-string keys, OrderedDicts,
bytes, sets, complex numbers, ``torch.dtype``/``torch.Size``/``torch.device``, small tensors and
numpy arrays (raw bytes, base64). Reading it never executes code. A value of any other class is
stored as a pickle *only* so that the save does not fail; loading it needs ``allow_pickle=True``
(else :class:`~unickpt.errors.UnsafeObjectError` names the key and the class).
"""
from __future__ import annotations

import base64
import collections
import pickle
from typing import Any

import numpy as np
import torch

from ..errors import UnsafeObjectError
from ..format.dtypes import dtype_to_str, str_to_dtype

__all__ = ["encode", "decode", "dtype_to_str", "str_to_dtype", "TENSOR_REF", "PER_RANK_REF", "STATEFUL_REF"]

TENSOR_REF = "__unickpt_tensor__"
PER_RANK_REF = "__unickpt_per_rank__"
STATEFUL_REF = "__unickpt_stateful__"  # wraps the state dict of a module / optimizer / stateful object
_TAGS = {STATEFUL_REF, "__tuple__", "__dict__", "__odict__", "__bytes__", "__set__", "__frozenset__", "__complex__", "__dtype__",
         "__size__", "__device__", "__tensor__", "__ndarray__", "__npscalar__", "__pickle__", TENSOR_REF, PER_RANK_REF}


def _b64(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def encode(value: Any, *, allow_pickle: bool = True, key: str = "") -> Any:
    """Turn ``value`` into JSON-serialisable data (see module docstring).

    A value of a class JSON cannot express is pickled only with ``allow_pickle``; otherwise
    :class:`~unickpt.errors.UnsafeObjectError` names the class and the value's key path: ``key``
    followed by the dict keys and list / tuple indices down to it (``"hparams.optim.1"``).
    """
    return _encode(value, allow_pickle, key)


# values JSON stores as they are, by exact type (``np.float64`` is a float subclass: it is tagged)
JSON_SCALARS = frozenset((str, int, float, bool, type(None)))


def _sub(key: str, part: Any) -> str:
    return f"{key}.{part}" if key else str(part)


def _encode(value: Any, allow_pickle: bool, key: str) -> Any:
    def encode(v: Any, part: Any = None) -> Any:
        if type(v) in JSON_SCALARS:  # the common element: no key path to build
            return v
        return _encode(v, allow_pickle, key if part is None else _sub(key, part))

    if isinstance(value, np.generic) and value.dtype.kind in "biufc":  # before float: np.float64 is a float
        return {"__npscalar__": {"dtype": value.dtype.str, "data": _b64(value.tobytes())}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(v, i) for i, v in enumerate(value)]
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"__tuple__": [encode(v, i) for i, v in enumerate(value)]}
    if type(value) is collections.OrderedDict:
        return {"__odict__": [[encode(k), encode(v, k)] for k, v in value.items()]}
    if isinstance(value, dict) and type(value) is dict:
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: encode(v, k) for k, v in value.items()}
        return {"__dict__": [[encode(k), encode(v, k)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": _b64(value)}
    if isinstance(value, (set, frozenset)):
        tag = "__set__" if isinstance(value, set) else "__frozenset__"
        return {tag: [encode(v) for v in value]}
    if isinstance(value, complex):
        return {"__complex__": [value.real, value.imag]}
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_to_str(value)}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if type(value) is torch.Tensor:
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": {"dtype": dtype_to_str(t.dtype), "shape": list(t.shape), "data": _b64(raw)}}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        a = np.ascontiguousarray(value)
        return {"__ndarray__": {"dtype": a.dtype.str, "shape": list(a.shape), "data": _b64(a.tobytes())}}
    cls = type(value)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not allow_pickle:
        raise UnsafeObjectError(
            f"{key!r}: a value of class {name} has no JSON or tensor form; storing it needs pickle, which "
            "is opt-in: pass allow_pickle=True to save (and to load), or store its state_dict() instead"
        )
    return {"__pickle__": {"type": name, "data": _b64(pickle.dumps(value))}}


def decode(data: Any, *, allow_pickle: bool = False, key: str = "") -> Any:
    """Inverse of :func:`encode`. ``key`` names the value in errors (with the key path below it, as
    :func:`encode` does)."""
    if isinstance(data, list):
        return [decode(v, allow_pickle=allow_pickle, key=_sub(key, i)) if isinstance(v, (dict, list)) else v
                for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, body), = data.items()
        if tag == "__tuple__":
            return tuple(decode(v, allow_pickle=allow_pickle, key=_sub(key, i)) for i, v in enumerate(body))
        if tag == "__odict__":
            return collections.OrderedDict(_decode_items(body, allow_pickle, key))
        if tag == "__dict__":
            return dict(_decode_items(body, allow_pickle, key))
        if tag == "__bytes__":
            return base64.b64decode(body)
        if tag in ("__set__", "__frozenset__"):
            items = (decode(v, allow_pickle=allow_pickle, key=key) for v in body)
            return set(items) if tag == "__set__" else frozenset(items)
        if tag == "__complex__":
            return complex(body[0], body[1])
        if tag == "__dtype__":
            return str_to_dtype(body)
        if tag == "__size__":
            return torch.Size(body)
        if tag == "__device__":
            return torch.device(body)
        if tag == "__tensor__":
            dtype, shape = str_to_dtype(body["dtype"]), body["shape"]
            raw = bytearray(base64.b64decode(body["data"]))
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()
        if tag == "__ndarray__":
            a = np.frombuffer(base64.b64decode(body["data"]), dtype=np.dtype(body["dtype"]))
            return a.reshape(body["shape"]).copy()
        if tag == "__npscalar__":
            return np.frombuffer(base64.b64decode(body["data"]), dtype=np.dtype(body["dtype"]))[0]
        if tag == "__pickle__":
            if not allow_pickle:
                raise UnsafeObjectError(
                    f"{key!r}: stored object of class {body['type']} can only be restored by unpickling, "
                    "which can execute code; pass allow_pickle=True if you trust this checkpoint"
                )
            return pickle.loads(base64.b64decode(body["data"]))
    return {k: decode(v, allow_pickle=allow_pickle, key=_sub(key, k)) for k, v in data.items()}


def _decode_items(body: list, allow_pickle: bool, key: str) -> list[tuple[Any, Any]]:
    out = []
    for k, v in body:
        dk = decode(k, allow_pickle=allow_pickle, key=key)
        out.append((dk, decode(v, allow_pickle=allow_pickle, key=_sub(key, dk))))
    return out
