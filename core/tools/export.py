"""``export_checkpoint``: a unickpt checkpoint as a full, unsharded model in Hugging Face's layout.

Output (the layout of ``transformers``' ``save_pretrained`` and ``huggingface_hub``'s
``save_torch_state_dict``):

- ``safetensors``: ``model.safetensors`` when everything fits in one shard, else
  ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``;
- ``torch``: ``pytorch_model.bin``, or ``pytorch_model-00001-of-0000N.bin`` ... plus
  ``pytorch_model.bin.index.json``.

The index is ``{"metadata": {"total_size": <tensor bytes>}, "weight_map": {name: file}}``.
Shards are filled greedily in name order; a tensor larger than ``max_shard_size`` gets a shard of
its own (as in ``huggingface_hub.split_torch_state_dict_into_shards``).

Memory: safetensors files are written by this module directly (the format is an 8-byte
little-endian header length, a JSON header, then the raw bytes; see
https://github.com/huggingface/safetensors#format), header first, then tensor by tensor, so at most
one tensor (plus its cast copy) is in memory. ``torch`` shards are ``torch.save``'d dicts, so one
shard (at most ``max_shard_size``, or one larger tensor) is in memory. Each shard is written to a
temporary name and renamed; the index is written last.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import CheckpointNotFoundError, UnickptError
from ..format.dtypes import str_to_dtype
from ..interop.sources import SAFETENSORS_DTYPES
from ..loading.checks import not_a_checkpoint
from ..storage import open_storage
from .reader import CheckpointReader

__all__ = ["ExportResult", "export_checkpoint", "parse_size", "parse_dtype", "select_keys", "SAFETENSORS_DTYPES"]


_DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
                "fp64": torch.float64, "float64": torch.float64}

_LAYOUT = {"safetensors": ("model", ".safetensors"), "torch": ("pytorch_model", ".bin")}


@dataclass
class ExportResult:
    """What an export wrote: ``files`` (shard names, in order), ``index`` (the index file name, or
    None for a single shard), ``weight_map`` (output name -> shard file), ``total_bytes`` (tensor
    bytes written, after any dtype cast), ``extra_files`` (a conversion's other files: ``config.json``)."""

    out: str
    format: str
    files: list[str] = field(default_factory=list)
    index: str | None = None
    weight_map: dict[str, str] = field(default_factory=dict)
    total_bytes: int = 0
    extra_files: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"500MiB"`` -> 500 * 2**20, ``1000`` -> 1000 (bytes), as
    ``transformers.utils.convert_file_size_to_int``. Raises ValueError for anything else or a size < 1."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ValueError(f"max shard size {size!r} is not a size like 5GB, 500MB, 2GiB or a number of bytes")
        unit = (m.group(2) or "B").upper()
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
        n = int(float(m.group(1)) * scale)
    if n < 1:
        raise ValueError(f"max shard size must be at least 1 byte, got {size!r}")
    return n


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16`` (floating dtypes
    only); None stays None. Raises ValueError naming the accepted names."""
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPE_NAMES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(sorted(_DTYPE_NAMES))}") from None


def select_keys(keys: list[str], prefix: str | None, strip: bool = True) -> dict[str, str]:
    """``{output name: fqn}`` for the fqns equal to ``prefix`` or under ``prefix.`` (all when None),
    the prefix removed from the name when ``strip``. Raises UnickptError when nothing matches or
    when two fqns would get the same name."""
    if prefix is None or prefix.strip(".") == "":
        return {k: k for k in keys}
    p = prefix.rstrip(".")
    chosen: dict[str, str] = {}
    for k in keys:
        if k == p or k.startswith(p + "."):
            name = k[len(p) + 1 :] if strip and k != p else k
            if name in chosen:  # {"model": t, "model.model": u}: both would be named "model"
                raise UnickptError(f"{chosen[name]!r} and {k!r} would both be exported as {name!r}; "
                                   "use --keep-prefix or a longer --keys prefix")
            chosen[name] = k
    if not chosen:
        sample = ", ".join(sorted({k.split(".")[0] for k in keys})[:8])
        raise UnickptError(f"no tensor fqn starts with {p!r}; top-level keys are: {sample}")
    return chosen


def _plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, n in sizes:
        if current and used + n > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current or not shards:
        shards.append(current)
    return shards


def _cast(t: torch.Tensor, dtype: torch.dtype | None, fqn: str) -> torch.Tensor:
    """``t`` cast to ``dtype`` when both are floating point. Raises UnickptError naming ``fqn`` when
    a finite value overflows to +-inf in ``dtype`` (e.g. 1e5 in float16, whose max is 65504):
    the cast is asked for, its overflow is not."""
    if dtype is None or not t.is_floating_point() or t.dtype == dtype:
        return t
    out = t.to(dtype)
    try:
        finite = torch.isfinite(t)
    except (RuntimeError, TypeError):  # float8_*: no isfinite kernel; a widening copy has one
        finite = torch.isfinite(t.to(torch.float64))
    bad = finite & ~torch.isfinite(out)
    if bad.any():
        first = int(bad.reshape(-1).nonzero()[0, 0])
        index = [int(i) for i in torch.unravel_index(torch.tensor(first), t.shape)] if t.dim() else []
        raise UnickptError(f"{fqn!r}: {int(bad.sum())} value(s) overflow {dtype} (max {torch.finfo(dtype).max:g}), "
                           f"e.g. {t.reshape(-1)[first].item()!r} at {index}; export with a wider --dtype or none")
    return out


def _out_dtype(src: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and src.is_floating_point else src


class _Tensors:
    """The tensors an export writes, by output name: stored tensors (``{name: fqn}``) or, for a
    conversion, :class:`~unickpt.plan.mapping.Resolved` pieces of stored tensors."""

    def __init__(self, reader: CheckpointReader, names: dict[str, str] | None = None, resolved: dict | None = None):
        self.reader, self.names, self.resolved = reader, names or {}, resolved or {}

    def keys(self) -> list[str]:
        return sorted(self.names or self.resolved)

    def label(self, n: str) -> str:
        return self.names.get(n, n)

    def shape(self, n: str) -> tuple[int, ...]:
        return tuple(self.resolved[n].shape) if n in self.resolved else tuple(self.reader.tensor_meta(self.names[n]).shape)

    def dtype(self, n: str) -> torch.dtype:
        return str_to_dtype(self.resolved[n].dtype) if n in self.resolved else self.reader.dtype(self.names[n])

    def read(self, n: str) -> torch.Tensor:
        return self.reader.read_resolved(self.resolved[n]) if n in self.resolved else self.reader.read(self.names[n])


def _open_reader(path: str, storage_options: dict | None, verify: bool) -> CheckpointReader:
    """The reader of ``path``; a path without ``metadata.json`` that is a file or a checkpoint root says so
    (:func:`~unickpt.loading.checks.not_a_checkpoint`)."""
    try:
        return CheckpointReader(path, storage_options, verify=verify)
    except (CheckpointNotFoundError, NotADirectoryError):
        better = not_a_checkpoint(open_storage(path, storage_options), path)
        if better is None:
            raise
        raise better from None


def export_checkpoint(path: str, out: str, *, format: str = "safetensors", max_shard_size: int | str = "5GB",
                      dtype: str | torch.dtype | None = None, keys: str | None = None, strip_prefix: bool = True,
                      storage_options: dict | None = None, verify: bool = True,
                      progress: Callable[[int, int], None] | None = None, to: str | None = None,
                      model_config: dict | None = None) -> ExportResult:
    """Write the tensors of checkpoint ``path`` as one full model in Hugging Face's layout in ``out``.

    Args:
        path: a committed unickpt checkpoint (any world size, any sharding: tensors are assembled whole).
        out: a local directory, created if missing; it must not already hold model files.
        format: ``"safetensors"`` or ``"torch"``.
        max_shard_size: bytes per shard, e.g. ``"5GB"`` (10**9 bytes per GB, as in transformers).
        dtype: cast floating-point tensors to this dtype (``"bf16"``, ``"fp16"``, ``"fp32"``); integer
            and bool tensors are never cast. None: stored dtypes.
        keys: export only fqns under this prefix (e.g. ``"model"``), named without it unless
            ``strip_prefix=False``. None: every tensor (a tied tensor is written under each of its names).
        verify: check every chunk against its checksum while reading.
        progress: ``progress(done, total)`` (bytes written so far, bytes to write), after each tensor.
        to: a conversion (entry-point group ``unickpt.conversions``, e.g. ``"hf-llama"`` from
            :mod:`unickpt.megatron.hf`): the tensors are renamed, split, fused and permuted as it says and
            its files (``config.json``) are written too; ``path`` may then be a framework's own handle of
            a checkpoint (a Megatron checkpoint directory). Not with ``keys``.
        model_config: what the conversion needs beyond the stored shapes (e.g. ``num_attention_heads``).

    Returns an :class:`ExportResult`. Raises UnickptError (no tensor or no matching key, existing
    output files, ``out`` inside the checkpoint, a dtype safetensors cannot store, a value overflowing
    the ``dtype`` cast), ValueError (bad size or dtype), and the reader's errors; on any error the
    shards already written by this call are removed again.
    """
    if format not in _LAYOUT:
        raise ValueError(f"export format {format!r} is not one of {', '.join(_LAYOUT)}")
    max_bytes = parse_size(max_shard_size)
    cast = parse_dtype(dtype)
    extra_files: dict[str, bytes] = {}
    if to is not None:
        from ..interop.conversion import get_conversion
        from ..interop.locate import locate_checkpoint

        if keys is not None:
            raise UnickptError("--keys selects stored names; with --to the conversion names the tensors")
        conv = get_conversion("export", to)
        path = locate_checkpoint(path, open_storage(path, storage_options))
        reader = _open_reader(path, storage_options, verify)
        plan = conv.export(reader, dict(model_config or {}))
        tensors, extra_files = _Tensors(reader, resolved=plan.tensors), dict(plan.files)
    else:
        reader = _open_reader(path, storage_options, verify)
        tensors = _Tensors(reader, names=select_keys(reader.keys(), keys, strip_prefix))
    order = tensors.keys()
    if not order:
        raise UnickptError(f"{path!r} holds no tensors (only plain values); there is nothing to export")
    if format == "safetensors" and "__metadata__" in order:  # the header's reserved key
        raise UnickptError(f"{tensors.label('__metadata__')!r} would be exported as '__metadata__', which safetensors "
                           "reserves; use --keep-prefix or --format torch")
    out_dtypes = {n: _out_dtype(tensors.dtype(n), cast) for n in order}
    for n in order:  # before writing anything: a conversion torch does not have (packed float4)
        src = tensors.dtype(n)
        if out_dtypes[n] != src:
            try:
                torch.empty(1, dtype=src).to(out_dtypes[n])
            except (RuntimeError, TypeError):
                raise UnickptError(f"{tensors.label(n)!r}: torch cannot cast {src} to {out_dtypes[n]}; "
                                   "export without --dtype, or select other tensors with --keys") from None
    if format == "safetensors":
        bad = sorted(n for n in order if out_dtypes[n] not in SAFETENSORS_DTYPES)
        if bad:
            raise UnickptError(f"{tensors.label(bad[0])!r}: dtype {out_dtypes[bad[0]]} cannot be stored in safetensors "
                               f"({len(bad)} such tensor(s)); export with --format torch")
    sizes = [(n, math.prod(tensors.shape(n)) * out_dtypes[n].itemsize) for n in order]
    shards = _plan_shards(sizes, max_bytes)
    stem, ext = _LAYOUT[format]
    files = [f"{stem}{ext}"] if len(shards) == 1 else \
        [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}" for i in range(len(shards))]
    index = f"{stem}{ext}.index.json" if len(shards) > 1 else None
    if os.path.isdir(path):
        real_out, real_ckpt = os.path.realpath(out), os.path.realpath(path)
        if os.path.commonpath([real_out, real_ckpt]) == real_ckpt:
            raise UnickptError(f"output directory {out!r} is inside the checkpoint {path!r}; "
                               "a committed checkpoint is never modified: export elsewhere")
    created = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    clash = sorted(f for f in os.listdir(out) if (f.startswith(stem) and (f.endswith(ext) or f.endswith(".index.json")))
                   or f in extra_files)
    if clash:  # also an earlier export with another shard count: never mix two models' shards
        raise UnickptError(f"{os.path.join(out, clash[0])} already exists; export into an empty directory")
    result = ExportResult(out=out, format=format, files=files, index=index)
    size_of = dict(sizes)
    total = sum(size_of.values())
    written = [0]

    def advance(nbytes: int) -> None:
        written[0] += nbytes
        if progress:
            progress(written[0], total)

    done: list[str] = []  # shards renamed into place: removed again if a later one fails
    try:
        for file, shard in zip(files, shards):
            final = os.path.join(out, file)
            tmp = f"{final}.tmp-{os.getpid()}"  # concurrent exports into one directory never share a file
            try:
                if format == "safetensors":
                    _write_safetensors(tmp, tensors, shard, out_dtypes, cast, advance)
                else:
                    sd = {}
                    for n in shard:
                        sd[n] = _cast(tensors.read(n), cast, tensors.label(n))
                        advance(size_of[n])
                    torch.save(sd, tmp)
                    del sd
                os.replace(tmp, final)
                done.append(final)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            for n in shard:
                result.weight_map[n] = file
            result.total_bytes += sum(size_of[n] for n in shard)
        for name, data in extra_files.items():  # config.json, ... (before the index, which comes last)
            final = os.path.join(out, name)
            with open(final + ".tmp", "wb") as f:
                f.write(data)
            os.replace(final + ".tmp", final)
            done.append(final)
            result.extra_files.append(name)
        if index is not None:
            doc = {"metadata": {"total_size": result.total_bytes}, "weight_map": dict(sorted(result.weight_map.items()))}
            with open(os.path.join(out, index), "w") as index_file:
                json.dump(doc, index_file, indent=2)
                index_file.write("\n")
    except BaseException:  # never leave part of a model behind (shards without their index)
        for final in done:
            with contextlib.suppress(OSError):
                os.remove(final)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out)  # only when empty
        raise
    return result


def _write_safetensors(file: str, tensors: _Tensors, shard: list[str], out_dtypes: dict[str, torch.dtype],
                       cast: torch.dtype | None, advance: Callable[[int], None]) -> None:
    """Header first (every shape and dtype is known from the metadata), then each tensor's bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for n in shard:
        shape = list(tensors.shape(n))
        nbytes = math.prod(shape) * out_dtypes[n].itemsize
        header[n] = {"dtype": SAFETENSORS_DTYPES[out_dtypes[n]], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for n in shard:
            t = _cast(tensors.read(n), cast, tensors.label(n)).contiguous()
            if t.dtype != out_dtypes[n]:  # cannot happen: guards the header's promise
                raise UnickptError(f"{tensors.label(n)!r}: read as {t.dtype}, the header says {out_dtypes[n]}")
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # its bytes, not copied
            advance(header[n]["data_offsets"][1] - header[n]["data_offsets"][0])
            del t
        f.flush()
        os.fsync(f.fileno())
