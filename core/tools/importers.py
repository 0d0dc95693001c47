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
               (:mod:`unickpt.megatron.torch_dist_import`, a plugin source)
deepspeed      a DeepSpeed ZeRO checkpoint (``save_dir`` with ``latest``, or  always
               one tag directory); model weights consolidated to fp32
               (:mod:`unickpt.deepspeed.zero_import`, a plugin source)
=============  =============================================================  ==============

Framework plugins add sources through the entry-point group ``unickpt.sources`` (a
:class:`~unickpt.interop.Source` each; :mod:`unickpt.interop.sources` also holds the readers of the
built-in kinds), so this module names no framework. A plugin's source is detected before the built-in
kinds but Hugging Face folders (a Megatron directory is also a DCP directory; loading the plugins'
sources imports their packages, megatron-core's included, so an HF folder is recognized first).

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
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UnickptError, UnsafeObjectError
from ..lifecycle.directory import CheckpointDir
from ..storage.local import LocalStorage
from ..interop import entry_points
from ..interop.sources import load_safetensors, plugin_sources, read_dcp, read_hf, torch_load

__all__ = ["SOURCES", "ImportResult", "detect_source", "read_source", "import_checkpoint", "load_safetensors",
           "trainer_state_files"]

log = logging.getLogger("unickpt")

BUILTIN_SOURCES = ("safetensors", "hf", "torch", "dcp")
_PICKLE_ONLY = {"dcp": "its .metadata file is a pickle"}


def _sources() -> tuple[str, ...]:
    return BUILTIN_SOURCES + tuple(sorted(set(entry_points.entry_points("unickpt.sources")) - set(BUILTIN_SOURCES)))


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


def detect_source(src: str) -> str:
    """The kind of checkpoint at ``src`` (one of :data:`SOURCES`). Raises UnickptError naming what
    was looked for when it is none of them, or when ``src`` is already a unickpt checkpoint."""
    if not os.path.exists(src):
        raise UnickptError(f"{src!r} does not exist")
    if os.path.isfile(src):
        return "safetensors" if src.endswith(".safetensors") else "torch"
    names = set(os.listdir(src))
    if CheckpointDir(LocalStorage(), src).is_unickpt():
        raise UnickptError(f"{src!r} is already a unickpt checkpoint")
    if names & {"model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"}:
        return "hf"
    plugins = plugin_sources()  # before DCP: a Megatron torch_dist directory is a DCP directory plus its own files
    for name, source in plugins.items():
        if source.detect(src):
            return name
    if ".metadata" in names:
        return "dcp"
    raise UnickptError(f"{src!r}: not a checkpoint this tool can import (looked for a .safetensors or torch.save file, "
                       "a DCP .metadata, HF model files"
                       + "".join(f", {n}" for n in sorted(plugins)) + ")")


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
        return read_hf(src, allow_pickle)
    if kind == "torch":
        state = torch_load(src, allow_pickle)
        if not isinstance(state, dict):
            state = {"value": state}
        return state
    if kind == "dcp":
        return read_dcp(src)
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
    return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)


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
    from ..requests import SaveRequest
    from ..storage import open_storage
    from ..interop.conversion import get_conversion

    if prefix:
        raise UnickptError("--prefix nests the state under a key; with --to the conversion names the tensors")
    conv = get_conversion("import", to)
    kind = source or detect_source(os.fspath(src))
    state = read_source(src, kind, allow_pickle=allow_pickle, tag=tag)
    plan = conv.import_(state, dict(model_config or {}), os.fspath(src))
    storage = open_storage(out, storage_options)
    target = storage.join(out, plan.subdir) if plan.subdir else out
    if plan.files and any(storage.exists(storage.join(out, f)) for f in plan.files):
        raise UnickptError(f"{out!r} already holds {', '.join(f for f in plan.files if storage.exists(storage.join(out, f)))}; "
                           "import into a new directory")
    with contextlib.redirect_stdout(sys.stderr):
        get_engine(None).save(SaveRequest(target, storage_options=storage_options, step=step, framework=plan.framework,
                                          extra=plan.extra, allow_pickle=allow_pickle), plan.state).wait()
    for name, data in plan.files.items():  # after the commit; the last one is the outer framework's marker
        storage.write_atomic(storage.join(out, name), data)
    n, nbytes, objects = _count(plan.state)
    return ImportResult(f"{kind}->{to}", os.fspath(src), out, n, nbytes, objects, _left_behind(os.fspath(src), kind))
