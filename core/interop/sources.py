"""Checkpoint sources of ``unickpt import``: what a plugin implements to teach it a kind of checkpoint,
and the readers of the formats every source builds on (safetensors, ``torch.save``, Hugging Face model
folders, torch DCP directories).

A plugin registers a :class:`Source` under the entry-point group ``unickpt.sources``
(:mod:`unickpt.interop.entry_points`). Call order (:mod:`unickpt.tools.importers`): ``detect(src)`` for each
installed source, in registration order, before the built-in kinds; then, once the caller allowed
unpickling where ``needs_pickle`` says it is needed, ``read(src, tag)`` on the caller's thread; the
state it returns is saved with :func:`unickpt.save`. No collective.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import UnickptError, UnsafeObjectError
from . import entry_points

__all__ = ["Source", "plugin_sources", "SAFETENSORS_DTYPES", "torch_load", "load_safetensors", "read_hf", "read_dcp"]


@dataclass(frozen=True)
class Source:
    """A checkpoint kind that a framework plugin teaches ``unickpt import`` (entry-point group
    ``unickpt.sources``; the entry point names a :class:`Source` object).

    Attributes:
        name: the kind (``--source`` value).
        detect: ``detect(src) -> bool``: whether the directory ``src`` holds this kind (reads names and
            small files only; never unpickles).
        read: ``read(src, tag) -> dict``: the state (tensors on the CPU, plain values); ``tag`` is the
            caller's ``--tag`` (None: the source's default).
        needs_pickle: why reading it runs the unpickler (None: it never does).
    """

    name: str
    detect: Callable[[str], bool]
    read: Callable[[str, "str | None"], dict]
    needs_pickle: str | None = None


def plugin_sources() -> dict[str, Source]:
    """The :class:`Source` objects of the installed plugins (entry-point group ``unickpt.sources``), in
    registration order; a plugin whose framework is not installed is left out. Raises TypeError for an
    entry point that is not a Source."""
    out: dict[str, Source] = {}
    for name, found in entry_points.load_all("unickpt.sources").items():
        if not isinstance(found, Source):
            raise TypeError(f"the unickpt.sources entry point {name!r} is {found!r}, not a unickpt Source")
        out[found.name] = found
    return out


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.complex64: "C64",
}
"""torch dtype -> safetensors dtype name (the table of ``safetensors.torch`` 0.8)."""


def _json_file(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def torch_load(path: str, allow_pickle: bool) -> Any:
    """``torch.load`` on the CPU, memory-mapped when the file is in the zip format.

    Raises UnickptError naming ``path`` when it is not a ``torch.save`` file (neither a zip archive
    nor a pickle stream; checked before any unpickling) or cannot be read as one (truncated, corrupt),
    UnsafeObjectError when it holds objects beyond tensors and containers and not ``allow_pickle``."""
    with open(path, "rb") as f:
        head = f.read(4)
    # torch.save writes a zip archive (PK\x03\x04; torch >= 1.6) or, legacy, pickles starting with PROTO (0x80)
    if head != b"PK\x03\x04" and head[:1] != b"\x80":
        raise UnickptError(f"{path}: not a torch.save file (it starts with {head!r}, not a zip archive or a pickle)")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except Exception as e:
        if not allow_pickle and type(e).__name__ == "UnpicklingError":
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnsafeObjectError(f"{path}: holds objects beyond tensors and containers ({first[:160]}); "
                                    "rerun with --allow-pickle (allow_pickle=True) if you trust the file") from None
        first = " ".join(str(e).split())[:200]
        raise UnickptError(f"{path}: cannot be read as a torch.save file ({type(e).__name__}: {first})") from e



def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, memory-mapped (copy-on-write), so that importing a model
    larger than memory reads it page by page while it is saved. Format: an 8-byte little-endian
    header length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``
    (offsets relative to the end of the header), the raw little-endian bytes
    (https://github.com/huggingface/safetensors#format). Raises UnickptError for a malformed file."""
    import numpy as np

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise UnickptError(f"{path}: not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise UnickptError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    base = 8 + n
    data = np.memmap(path, dtype=np.uint8, mode="c") if size > base else np.zeros(0, dtype=np.uint8)
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    out = {}
    for name, info in header.items():
        dtype = names.get(info.get("dtype"))
        begin, end = info.get("data_offsets", (None, None))
        if dtype is None or not isinstance(begin, int) or not isinstance(end, int):
            raise UnickptError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r} / offsets "
                               f"{info.get('data_offsets')!r}, which this reader does not know")
        numel = math.prod(info["shape"])
        if not 0 <= begin <= end <= size - base or end - begin != numel * dtype.itemsize:
            raise UnickptError(f"{path}: tensor {name!r} ({dtype}, shape {info['shape']}) has data_offsets "
                               f"[{begin}, {end}], which do not fit it or the file's {size - base} data bytes")
        raw = torch.from_numpy(data[base + begin : base + end]) if numel else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(info["shape"])
    return out



def read_hf(src: str, allow_pickle: bool) -> dict:
    for index, single, loader in (("model.safetensors.index.json", "model.safetensors", load_safetensors),
                                  ("pytorch_model.bin.index.json", "pytorch_model.bin",
                                   lambda p: torch_load(p, allow_pickle))):
        if os.path.exists(os.path.join(src, index)):
            doc = _json_file(os.path.join(src, index))
            if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
                raise UnickptError(f"{os.path.join(src, index)}: no weight_map (not a Hugging Face index)")
            state: dict = {}
            for file in sorted(set(doc["weight_map"].values())):
                part = loader(os.path.join(src, file))
                state.update(part)
            missing = sorted(set(doc["weight_map"]) - set(state))
            if missing:
                raise UnickptError(f"{src}: the index names {missing[0]!r} ({len(missing)} in all), which its shards lack")
            return state
        if os.path.exists(os.path.join(src, single)):
            return dict(loader(os.path.join(src, single)))
    raise UnickptError(f"{src!r}: no model.safetensors(.index.json) or pytorch_model.bin(.index.json)")



def read_dcp(src: str) -> dict:
    """Every tensor (whole, whatever the saved sharding) and object of a DCP directory, as
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` reads them (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise UnickptError(f"{src!r} is not a DCP checkpoint directory: it has no .metadata file")
    try:  # first on its own: torch's loader logs each failed attempt's traceback on the root logger
        FileSystemReader(src).read_metadata()
    except Exception as e:  # noqa: BLE001 - a corrupt pickle raises anything
        raise UnickptError(f"{os.path.join(src, '.metadata')}: not readable as DCP metadata "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from e
    state: dict = {}
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except Exception as e:  # noqa: BLE001 - below
        raise UnickptError(f"{src}: reading the DCP checkpoint failed: {' '.join(str(e).split())[:300]}") from e
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        lines = [line for line in str(e).splitlines() if line.strip() and not line.startswith(" ")]
        raise UnickptError(f"{src}: reading the DCP checkpoint failed: {(lines or [type(e).__name__])[-1][:300]}") from e
    return state

