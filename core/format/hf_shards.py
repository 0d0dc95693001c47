"""Hugging Face safetensors shards as a save's data files (``SaveOptions.safetensors``).

The tensors of one fqn group (a prefix, such as ``"model."``) are written as the files that
``from_pretrained`` and ``safetensors.safe_open`` read, named as Hugging Face names them::

    model.safetensors                                  one writer
    model-00001-of-00003.safetensors ...               one file per writer (n writers)
    model.safetensors.index.json                       n > 1: {"metadata": {"total_size"}, "weight_map"}

Each file is the safetensors format (https://github.com/huggingface/safetensors, "Format"): an
8-byte little-endian header length ``N``, ``N`` bytes of JSON (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {"format": "pt"}}``, offsets relative to the byte
after the header), then the tensors back to back, no gap, the file ending at the last one. The JSON
is padded with spaces so that ``8 + N`` is a multiple of :data:`HEADER_ALIGN` (the format allows
trailing spaces, and its own writer pads to 8): the tensor bytes then start on an ``O_DIRECT``
boundary, and the writer sends them straight from the staging ring. ``metadata.json`` indexes the
same bytes by (file, offset), so ``unickpt.load``, ``from_pretrained`` and ``safe_open`` read one copy.

Pure functions: the save plan (:mod:`unickpt.plan.save_plan`) builds the headers and the index at
plan time, on every rank alike.
"""
from __future__ import annotations

import json
import struct

__all__ = ["HEADER_ALIGN", "INDEX_NAME", "ENTRY_PATTERN", "SAFETENSORS_DTYPES", "shard_name", "header", "index_json"]

HEADER_ALIGN = 4096
"""``8 + header length`` is a multiple of this: ``unickpt.storage.local.DIRECT_ALIGN`` (tested equal)."""

INDEX_NAME = "model.safetensors.index.json"

SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}
"""unickpt's dtype names (:func:`unickpt.format.dtypes.dtype_to_str`) -> safetensors' dtype names."""

ENTRY_PATTERN = r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
"""A regular expression of the names these files have in a checkpoint directory."""


def shard_name(k: int, n: int) -> str:
    """The file of writer ``k`` (0-based) of ``n``: ``model.safetensors`` when ``n == 1``, else
    ``model-0000{k+1}-of-0000{n}.safetensors`` (Hugging Face's ``SAFE_WEIGHTS_NAME`` pattern)."""
    if not 0 <= k < n:
        raise ValueError(f"shard {k} of {n}")
    return "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def header(entries: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """The head of one shard file: length prefix + JSON, padded to :data:`HEADER_ALIGN` bytes.

    Args:
        entries: ``(name, unickpt dtype name, shape, nbytes)`` in file order (the tensors follow
            back to back in this order).

    Raises ValueError naming the tensor for a dtype safetensors cannot store (``"complex128"``,
    ``"float8_e4m3fnuz"`` ...) and for a duplicate name.
    """
    doc: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        st = SAFETENSORS_DTYPES.get(dtype)
        if st is None:
            raise ValueError(f"{name!r}: dtype {dtype} has no safetensors name (stored as safetensors: "
                             f"{sorted(SAFETENSORS_DTYPES)})")
        if name in doc:
            raise ValueError(f"{name!r}: two tensors of one safetensors file have this name")
        doc[name] = {"dtype": st, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    total = -(-(8 + len(body)) // HEADER_ALIGN) * HEADER_ALIGN
    body += b" " * (total - 8 - len(body))
    return struct.pack("<Q", len(body)) + body


def index_json(weight_map: dict[str, str], total_size: int) -> bytes:
    """``model.safetensors.index.json``: ``{"metadata": {"total_size": bytes}, "weight_map": {name:
    file}}`` (names sorted, as ``transformers``' ``save_pretrained`` writes it)."""
    doc = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()
