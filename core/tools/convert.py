"""Conversions between a unickpt checkpoint and another framework's file layout, by name:
``unickpt export PATH OUT --to NAME`` and ``unickpt import SRC OUT --to NAME``.

A :class:`Conversion` is registered by a plugin under the entry-point group ``unickpt.conversions``
(``hf-llama`` and ``megatron`` by :mod:`unickpt.megatron.hf`), so this module names no framework.

- An **export** conversion gets the checkpoint (a :class:`~unickpt.tools.reader.CheckpointReader`) and the
  caller's model configuration and returns an :class:`ExportPlan`: every output tensor as a
  :class:`~unickpt.plan.mapping.Resolved` over stored fqns (rules applied: renames, splits, fusions,
  permutations), plus extra files (``config.json``). :func:`unickpt.tools.export.export_checkpoint`
  writes the tensors, one at a time, reading only the stored chunks each one needs.
- An **import** conversion gets the source state (tensors in memory, memory-mapped where the source
  allows) and returns an :class:`ImportPlan`: the state to save, the ``framework`` and ``extra`` to
  record, the subdirectory it goes in and the files around it (written after the commit).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import UnickptError
from ..format.dtypes import dtype_to_str
from ..plan.mapping import Mapping, Resolved, Rule

__all__ = ["Conversion", "ExportPlan", "ImportPlan", "conversions", "get_conversion", "materialize", "box_of",
           "dict_resolver"]


@dataclass
class ExportPlan:
    """``tensors``: output name -> :class:`Resolved` over the checkpoint's stored fqns (in output order);
    ``files``: other files of the output (``{"config.json": bytes}``)."""

    tensors: dict[str, Resolved]
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass
class ImportPlan:
    """``state`` to save (tensors, plain values) into ``<out>/<subdir>`` with ``framework`` and ``extra``
    recorded in ``metadata.json``; ``files``: paths relative to ``<out>`` -> bytes, written after the
    commit, in order (the last one is the outer framework's commit marker, if it has one)."""

    state: dict
    framework: str | None = None
    extra: dict = field(default_factory=dict)
    subdir: str = ""
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Conversion:
    """A named conversion (entry-point group ``unickpt.conversions``).

    Attributes:
        name: the ``--to`` value.
        kind: ``"export"`` (``run(reader, model_config) -> ExportPlan``) or ``"import"``
            (``run(state, model_config, src) -> ImportPlan``).
        description: one line for ``--help`` and errors.
        run: the function.
    """

    name: str
    kind: str
    description: str
    run: Callable[..., Any]


@functools.lru_cache(maxsize=1)
def conversions() -> dict[tuple[str, str], Conversion]:
    """The installed conversions, by ``(kind, name)``; a plugin that cannot be imported is left out."""
    from importlib.metadata import entry_points

    out: dict[tuple[str, str], Conversion] = {}
    for ep in entry_points(group="unickpt.conversions"):
        try:
            found = ep.load()
        except ImportError:
            continue
        for conv in found if isinstance(found, (list, tuple)) else [found]:
            out[(conv.kind, conv.name)] = conv
    return out


def get_conversion(kind: str, name: str) -> Conversion:
    """The conversion ``name`` of ``kind``. Raises UnickptError naming the installed ones."""
    found = conversions().get((kind, name))
    if found is None:
        names = sorted(n for k, n in conversions() if k == kind)
        raise UnickptError(f"no {kind} conversion named {name!r} (installed: {', '.join(names) or 'none'}; "
                           "they come with the framework plugins, e.g. unickpt[megatron])")
    return found


def dict_resolver(tensors: dict[str, torch.Tensor], rules: list[Rule]) -> Callable[[str], Resolved]:
    """``resolve(name)`` over an in-memory dict of tensors through ``rules`` (see :class:`Mapping`)."""
    def lookup(name: str):
        t = tensors.get(name)
        return None if t is None else (tuple(t.shape), dtype_to_str(t.dtype))
    return Mapping(tuple(rules)).resolver(lookup)


def materialize(res: Resolved, read: Callable[[str, tuple, tuple], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of ``res.shape`` and ``dtype`` filled piece by piece: ``read(source, offsets, lengths)``
    returns that box of a source tensor."""
    out = torch.empty(res.shape, dtype=dtype)
    for p in res.pieces:
        region = tuple(slice(o, o + n) for o, n in zip(p.region.offsets, p.region.lengths))
        out[region] = read(p.source, p.offsets, p.region.lengths)
    return out


def box_of(tensors: dict[str, torch.Tensor]) -> Callable[[str, tuple, tuple], torch.Tensor]:
    """A ``read`` for :func:`materialize` over an in-memory dict of tensors."""
    def read(name: str, offsets: tuple, lengths: tuple) -> torch.Tensor:
        return tensors[name][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    return read
