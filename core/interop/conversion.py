"""Conversions between a unickpt checkpoint and another framework's file layout, by name:
``unickpt export PATH OUT --to NAME`` and ``unickpt import SRC OUT --to NAME``.

A :class:`Conversion` is registered by a plugin under the entry-point group ``unickpt.conversions``
(``hf-llama`` and ``megatron`` by :mod:`unickpt.megatron.hf`), so this module names no framework.
Call order: the tool (:mod:`unickpt.tools.export` / :mod:`unickpt.tools.importers`) looks the conversion up
(:func:`get_conversion`), calls ``run`` once on the caller's thread, then writes what the plan says.

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
from typing import Callable, Literal, Protocol, TypeVar, cast

import torch

from ..errors import UnickptError
from ..format.dtypes import dtype_to_str
from ..format.metadata import CheckpointMetadata
from ..plan.mapping import Mapping, Resolved, Rule
from . import entry_points

__all__ = ["Conversion", "ExportPlan", "ImportPlan", "StoredCheckpoint", "ExportRun", "ImportRun", "conversions", "get_conversion", "materialize", "box_of",
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


class StoredCheckpoint(Protocol):
    """What an export conversion reads of the checkpoint (a :class:`unickpt.tools.reader.CheckpointReader`):
    its path, its metadata and (through :class:`~unickpt.interop.StoredParams`) its parameters by name."""

    path: str
    meta: CheckpointMetadata


_P = TypeVar("_P", "ExportPlan", "ImportPlan")

ExportRun = Callable[[StoredCheckpoint, dict], ExportPlan]
"""``run(checkpoint, model_config) -> ExportPlan`` of an export conversion."""
ImportRun = Callable[[dict, dict, str], ImportPlan]
"""``run(state, model_config, src) -> ImportPlan`` of an import conversion (``src``: the source's path)."""


@dataclass(frozen=True)
class Conversion:
    """A named conversion (entry-point group ``unickpt.conversions``).

    Attributes:
        name: the ``--to`` value.
        kind: ``"export"`` (``run`` is an :data:`ExportRun`) or ``"import"`` (an :data:`ImportRun`).
        description: one line for ``--help`` and errors.
        run: the function; raises UnickptError / StateMismatchError naming what does not fit.
    """

    name: str
    kind: Literal["export", "import"]
    description: str
    run: ExportRun | ImportRun

    def __post_init__(self) -> None:
        if self.kind not in ("export", "import"):
            raise ValueError(f"conversion {self.name!r}: kind must be 'export' or 'import', not {self.kind!r}")

    def export(self, checkpoint: StoredCheckpoint, model_config: dict) -> ExportPlan:
        """Run an export conversion. Raises TypeError for an import one, or when ``run`` returns no ExportPlan."""
        self._expect("export")
        return self._checked(cast(ExportRun, self.run)(checkpoint, model_config), ExportPlan)

    def import_(self, state: dict, model_config: dict, src: str) -> ImportPlan:
        """Run an import conversion. Raises TypeError for an export one, or when ``run`` returns no ImportPlan."""
        self._expect("import")
        return self._checked(cast(ImportRun, self.run)(state, model_config, src), ImportPlan)

    def _expect(self, kind: str) -> None:
        if self.kind != kind:
            raise TypeError(f"conversion {self.name!r} is an {self.kind} conversion, not an {kind} one")

    def _checked(self, plan: object, cls: type[_P]) -> _P:
        if not isinstance(plan, cls):
            raise TypeError(f"conversion {self.name!r} returned {type(plan).__name__}, not a {cls.__name__}")
        return plan


@functools.lru_cache(maxsize=1)
def conversions() -> dict[tuple[str, str], Conversion]:
    """The installed conversions, by ``(kind, name)``; a plugin that cannot be imported is left out.
    Raises TypeError for an entry point that is not a Conversion (or a list of them)."""
    out: dict[tuple[str, str], Conversion] = {}
    for name, found in entry_points.load_all("unickpt.conversions").items():
        for conv in found if isinstance(found, (list, tuple)) else [found]:
            if not isinstance(conv, Conversion):
                raise TypeError(f"the unickpt.conversions entry point {name!r} holds {conv!r}, not a unickpt Conversion")
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
