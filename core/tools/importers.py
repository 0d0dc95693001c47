"""``import_checkpoint``: bring an existing checkpoint into unickpt format.

Sources (``detect_source`` tells them apart):

=============  =============================================================  ==============
source         what                                                           needs pickle
=============  =============================================================  ==============
safetensors    one ``.safetensors`` file                                      never
hf             a Hugging Face model folder: ``model.safetensors`` or          ``.bin`` only
               ``model.safetensors.index.json`` + shards, else
               ``pytorch_model.bin`` or ``pytorch_model.bin.index.json``
torch          a ``torch.save`` file (nested dicts, tensors, plain values)    arbitrary classes
dcp            a ``torch.distributed.checkpoint`` directory (``.metadata``)   always
megatron       a Megatron-core ``torch_dist`` checkpoint: a DCP directory     always
               plus ``common.pt`` and a ``metadata.json`` naming the backend
deepspeed      a DeepSpeed ZeRO checkpoint (``save_dir`` with ``latest``, or  always
               one tag directory); model weights consolidated to fp32
               (:mod:`unickpt.deepspeed.zero_import`, a plugin source)
=============  =============================================================  ==============

Framework plugins add sources through the entry-point group ``unickpt.sources`` (a :class:`Source`
each), so this module names no framework.

"needs pickle": reading it runs Python's unpickler, which can execute code, so it is refused unless
``allow_pickle=True`` (``--allow-pickle``). ``.bin`` and ``torch`` files are read with
``torch.load(weights_only=True)`` (tensors, containers and numbers only) without it.

The source state is read whole (safetensors files and zip-format torch files memory-mapped, so
their pages are read as the save stages them), then saved with :func:`unickpt.save` in this process. Keys keep their source names; ``prefix`` nests
everything under one key (``prefix="model"`` gives fqns ``model.<name>``, to load with
``unickpt.load(path, {"model": module})``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UnickptError, UnsafeObjectError
from ..format.layout import METADATA_FILE
from ..format.metadata import FORMAT_NAME
from .export import SAFETENSORS_DTYPES

__all__ = ["SOURCES", "Source", "plugin_sources", "ImportResult", "detect_source", "read_source",
           "import_checkpoint", "load_safetensors", "trainer_state_files"]

log = logging.getLogger("unickpt")

BUILTIN_SOURCES = ("safetensors", "hf", "torch", "dcp", "megatron")
_PICKLE_ONLY = {"dcp": "its .metadata file is a pickle", "megatron": "its .metadata and common.pt are pickles"}


@dataclass(frozen=True)
class Source:
    """A checkpoint kind that a framework plugin teaches ``unickpt import`` (entry-point group
    ``unickpt.sources``; the entry point names a :class:`Source` object).

    Attributes:
        name: the kind (``--source`` value).
        detect: ``detect(src) -> bool``: whether the directory ``src`` holds this kind.
        read: ``read(src, tag) -> dict``: the state (tensors on the CPU, plain values).
        needs_pickle: why reading it runs the unpickler (None: it never does).
    """

    name: str
    detect: Any
    read: Any
    needs_pickle: str | None = None


def plugin_sources() -> dict[str, Source]:
    """The :class:`Source` objects of the installed plugins (entry-point group ``unickpt.sources``); a
    plugin whose framework is not installed is left out."""
    from importlib.metadata import entry_points

    out: dict[str, Source] = {}
    for ep in entry_points(group="unickpt.sources"):
        try:
            source = ep.load()
        except ImportError:
            continue
        out[source.name] = source
    return out


def _sources() -> tuple[str, ...]:
    return BUILTIN_SOURCES + tuple(sorted(set(plugin_sources()) - set(BUILTIN_SOURCES)))


def __getattr__(name: str) -> Any:
    if name == "SOURCES":  # every source kind: the built-in ones, then the plugins'
        return _sources()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class ImportResult:
    """``source`` (kind), ``src``, ``out``, ``tensors`` (count), ``tensor_bytes``, ``objects`` (plain values),
    ``not_imported`` (names of files in ``src`` that were not imported: :func:`trainer_state_files`)."""

    source: str
    src: str
    out: str
    tensors: int
    tensor_bytes: int
    objects: int
    not_imported: list[str] = field(default_factory=list)  # files of ``src`` left behind (a Trainer's training state)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _json_file(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def detect_source(src: str) -> str:
    """The kind of checkpoint at ``src`` (one of :data:`SOURCES`). Raises UnickptError naming what
    was looked for when it is none of them, or when ``src`` is already a unickpt checkpoint."""
    if not os.path.exists(src):
        raise UnickptError(f"{src!r} does not exist")
    if os.path.isfile(src):
        return "safetensors" if src.endswith(".safetensors") else "torch"
    names = set(os.listdir(src))
    meta = _json_file(os.path.join(src, METADATA_FILE)) if METADATA_FILE in names else None
    if isinstance(meta, dict) and meta.get("format") == FORMAT_NAME:
        raise UnickptError(f"{src!r} is already a unickpt checkpoint")
    if isinstance(meta, dict) and "sharded_backend" in meta:
        return "megatron"
    if ".metadata" in names:
        return "dcp"
    if names & {"model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"}:
        return "hf"
    plugins = plugin_sources()
    for name, source in plugins.items():
        if source.detect(src):
            return name
    raise UnickptError(f"{src!r}: not a checkpoint this tool can import (looked for a .safetensors or torch.save file, "
                       "a DCP .metadata, a Megatron metadata.json, HF model files"
                       + "".join(f", {n}" for n in sorted(plugins)) + ")")


def _torch_load(path: str, allow_pickle: bool) -> Any:
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


def _read_hf(src: str, allow_pickle: bool) -> dict:
    for index, single, loader in (("model.safetensors.index.json", "model.safetensors", load_safetensors),
                                  ("pytorch_model.bin.index.json", "pytorch_model.bin",
                                   lambda p: _torch_load(p, allow_pickle))):
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


def _read_dcp(src: str) -> dict:
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


def _read_megatron(src: str) -> dict:
    """Sharded tensors and objects (DCP part, keys as Megatron stored them) plus ``common.pt`` under ``common``."""
    meta = _json_file(os.path.join(src, METADATA_FILE)) or {}
    backend = meta.get("sharded_backend")
    if backend != "torch_dist":
        raise UnickptError(f"{src}: Megatron sharded_backend {backend!r} is not supported (only 'torch_dist'; "
                           "zarr checkpoints need megatron-core < 0.16 to convert first)")
    state = _read_dcp(src)
    common = os.path.join(src, "common.pt")
    if os.path.exists(common):
        if "common" in state:
            raise UnickptError(f"{src}: a sharded key is named 'common', which would clash with common.pt")
        state["common"] = _torch_load(common, allow_pickle=True)
    return state


_TRAINER_FILES = re.compile(r"(optimizer|scheduler|scaler)(_\d+)?\.(pt|bin)|rng_state(_\d+)?\.pth|trainer_state\.json"
                            r"|training_args\.bin")


def trainer_state_files(src: str) -> list[str]:
    """The training state a Hugging Face ``Trainer`` saves beside the weights of a ``checkpoint-<N>`` folder
    (``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state[_<r>].pth``, ``trainer_state.json``,
    ``training_args.bin``), by name: the ``hf`` source imports the weights only, and says so."""
    return sorted(n for n in os.listdir(src) if _TRAINER_FILES.fullmatch(n)) if os.path.isdir(src) else []


def read_source(src: str, source: str | None = None, *, allow_pickle: bool = False, tag: str | None = None) -> dict:
    """The state held by checkpoint ``src`` as a dict (tensors on the CPU, plain values).

    Args:
        source: one of :data:`SOURCES`; None detects it.
        allow_pickle: allow reading pickles (see the module docstring); without it a source that
            needs them raises UnsafeObjectError.
        tag: DeepSpeed only: the tag (sub-directory) to read instead of the one ``latest`` names.
    """
    src = os.fspath(src)
    kind = source or detect_source(src)
    plugin = plugin_sources().get(kind) if kind not in BUILTIN_SOURCES else None
    if kind not in BUILTIN_SOURCES and plugin is None:
        raise ValueError(f"source {kind!r} is not one of {', '.join(_sources())}")
    why = plugin.needs_pickle if plugin is not None else _PICKLE_ONLY.get(kind)
    if why and not allow_pickle:
        raise UnsafeObjectError(f"{src}: reading a {kind} checkpoint runs the unpickler ({why}), "
                                "which can execute code; rerun with --allow-pickle (allow_pickle=True) if you trust it")
    if kind == "safetensors":
        return load_safetensors(src)
    if kind == "hf":
        return _read_hf(src, allow_pickle)
    if kind == "torch":
        state = _torch_load(src, allow_pickle)
        if not isinstance(state, dict):
            state = {"value": state}
        return state
    if kind == "dcp":
        return _read_dcp(src)
    if kind == "megatron":
        return _read_megatron(src)
    assert plugin is not None
    return plugin.read(src, tag)


def _count(state: Any) -> tuple[int, int, int]:
    """(tensors, tensor bytes, other leaves) of a nested state, for the report."""
    if isinstance(state, torch.Tensor):
        return 1, state.numel() * state.element_size(), 0
    if isinstance(state, dict):
        parts = [_count(v) for v in state.values()]
    elif isinstance(state, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in state):
        parts = [_count(v) for v in state]
    else:
        return 0, 0, 1
    return tuple(sum(p[i] for p in parts) for i in range(3))  # type: ignore[return-value]


def import_checkpoint(src: str, out: str, *, source: str | None = None, allow_pickle: bool = False,
                      prefix: str | None = None, step: int | None = None, tag: str | None = None,
                      storage_options: dict | None = None, to: str | None = None,
                      model_config: dict | None = None) -> ImportResult:
    """Read checkpoint ``src`` (see :func:`read_source`) and save it as the unickpt checkpoint ``out``.

    ``prefix`` nests the whole state under that key; ``step`` is recorded in ``metadata.json``
    (default: ``N`` when ``out`` is named ``step_<N>``, and then ``latest`` of its root is updated
    as after a :class:`~unickpt.Checkpointer` save; another ``step`` than ``N`` is an error).
    Plain values only pickle can express (e.g. an ``argparse.Namespace`` in Megatron's
    ``common.pt``) are stored as pickles when ``allow_pickle`` (loading them needs it again), else
    the save raises UnsafeObjectError naming the key. Raises UnickptError / UnsafeObjectError as
    :func:`read_source`, CheckpointExistsError if ``out`` is a committed checkpoint. Of a Hugging Face
    ``Trainer`` ``checkpoint-<N>`` folder only the model weights are imported; the Trainer's training
    state beside them (:func:`trainer_state_files`) is named in a warning (logger ``unickpt``) and in
    ``ImportResult.not_imported``.

    ``to`` names a conversion (entry-point group ``unickpt.conversions``, e.g. ``"megatron"`` from
    :mod:`unickpt.megatron.hf`): the source state is turned into that framework's layout (tensors
    renamed, fused, permuted; ``model_config`` overrides the source's settings) and saved into
    ``out/<subdir>``, with the framework's own files around it written after the commit (its commit
    marker last). Not with ``prefix``.
    """
    if to is not None:
        return _import_as(src, out, to, source=source, allow_pickle=allow_pickle, prefix=prefix, step=step, tag=tag,
                          storage_options=storage_options, model_config=model_config)
    from ..api import save
    from ..lifecycle.root import CheckpointRoot, step_of
    from ..storage import open_storage

    out = os.fspath(out)
    local = open_storage(out, storage_options).is_local
    root, dir_step = step_of(os.path.abspath(out) if local else out)  # a relative `step_5` has a root too
    name = out.rstrip("/").rpartition("/")[2]
    padded = re.fullmatch(r"step_0+(\d+)", name)  # `latest`, ls and load name it step_<N>: never step_0100
    if padded:
        raise UnickptError(f"{out!r}: name it step_{int(padded.group(1))}; a run's checkpoints are step_<N> without "
                           "leading zeros")
    if step is not None and dir_step is not None and step != dir_step:
        raise UnickptError(f"--step {step} contradicts the directory name step_{dir_step} of {out!r}, by which "
                           "`ls`, `latest` and Checkpointer.load know it; drop --step or rename the target")
    kind = source or detect_source(os.fspath(src))
    state = read_source(src, kind, allow_pickle=allow_pickle, tag=tag)
    if prefix:
        state = {prefix: state}
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the report (--json)
        save(out, state, storage_options=storage_options, step=dir_step if step is None else step,
             allow_pickle=allow_pickle).wait()
    if dir_step is not None and root:  # it joined a run's root: keep `latest` right
        CheckpointRoot(root, storage_options).update_latest()
    n, nbytes, objects = _count(state)
    return ImportResult(kind, os.fspath(src), out, n, nbytes, objects, _left_behind(os.fspath(src), kind))


def _left_behind(src: str, kind: str) -> list[str]:
    """The Trainer files of an ``hf`` source (:func:`trainer_state_files`), with a warning naming them."""
    left = trainer_state_files(src) if kind == "hf" else []
    if left:
        log.warning("unickpt import: %s is a Hugging Face Trainer checkpoint; imported its model weights only, not "
                    "%s (the Trainer's training state: its optimizer state is keyed by parameter index, not by name; "
                    "resume training from the folder itself, Trainer.train(resume_from_checkpoint=...))",
                    src, ", ".join(left))
    return left


def _import_as(src: str, out: str, to: str, *, source: str | None, allow_pickle: bool, prefix: str | None,
               step: int | None, tag: str | None, storage_options: dict | None, model_config: dict | None
               ) -> ImportResult:
    """:func:`import_checkpoint` through the import conversion ``to``."""
    from ..engine import get_engine
    from ..storage import open_storage
    from .convert import get_conversion

    if prefix:
        raise UnickptError("--prefix nests the state under a key; with --to the conversion names the tensors")
    conv = get_conversion("import", to)
    kind = source or detect_source(os.fspath(src))
    state = read_source(src, kind, allow_pickle=allow_pickle, tag=tag)
    plan = conv.run(state, dict(model_config or {}), os.fspath(src))
    storage = open_storage(out, storage_options)
    target = storage.join(out, plan.subdir) if plan.subdir else out
    if plan.files and any(storage.exists(storage.join(out, f)) for f in plan.files):
        raise UnickptError(f"{out!r} already holds {', '.join(f for f in plan.files if storage.exists(storage.join(out, f)))}; "
                           "import into a new directory")
    with contextlib.redirect_stdout(sys.stderr):
        get_engine(None).save(target, plan.state, storage_options=storage_options, step=step, framework=plan.framework,
                              extra=plan.extra, allow_pickle=allow_pickle).wait()
    for name, data in plan.files.items():  # after the commit; the last one is the outer framework's marker
        storage.write_atomic(storage.join(out, name), data)
    n, nbytes, objects = _count(plan.state)
    return ImportResult(f"{kind}->{to}", os.fspath(src), out, n, nbytes, objects, _left_behind(os.fspath(src), kind))
