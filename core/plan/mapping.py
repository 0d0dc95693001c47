"""Mapping rules: a tensor of one framework's naming as *pieces* of tensors stored under another's.

A rule says how a *target* tensor is made of *source* tensors, in parameter-name space (the names of
``model.named_parameters()`` without wrapper prefixes); the loader applies it to a parameter's weights
and to every optimizer moment of it alike (:mod:`unickpt.interop.view`). Four kinds:

- :class:`Rename` ``(target, source)``: the target is the source;
- :class:`Split` ``(target, source, dim, sections, index)``: part ``index`` of the source cut along
  ``dim`` (``sections``: a number of equal parts, or the list of their sizes, as ``numpy.split``);
- :class:`Fuse` ``(target, sources, dim)``: the sources concatenated along ``dim``;
- :class:`Permute` ``(target, source, dim, block, order)``: block ``j`` (of ``block`` elements along
  ``dim``) of the target is block ``order[j]`` of the source; ``order`` is a permutation.

Names are templates: ``{x}`` matches one or more characters and is substituted into the sources
(``Rename("model.layers.{i}.mlp.down_proj.weight", "decoder.layers.{i}.mlp.linear_fc2.weight")``). A
source may itself be the target of a rule (intermediate names conventionally begin with ``~``).

Every rule maps boxes of the target to boxes of a source by a translation, so any composition is a
list of :class:`Piece` objects, ``(region of the target, stored name, offsets of that region in the stored
tensor)``, covering the target exactly. That is what keeps resharding intact: a rank intersects its
own shard with the regions and reads only the stored byte ranges those intersections need. Pure
(no torch, no I/O): every rank resolves the same names to the same pieces.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from ..geometry import Box, intersect

__all__ = ["Piece", "Resolved", "Rule", "Rename", "Split", "Fuse", "Permute", "Mapping", "Unresolved"]

Lookup = Callable[[str], "tuple[tuple[int, ...], str] | None"]
"""``lookup(name) -> (shape, dtype name)`` of a stored (leaf) tensor, or None when there is none."""


@dataclass(frozen=True)
class Piece:
    """Elements ``region`` (a box of the target) are the elements of the stored tensor ``source``
    at ``offsets`` (the region's first element there) with the region's lengths."""

    region: Box
    source: str
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class Resolved:
    """A name resolved: its global ``shape``, ``dtype`` (name, as in ``metadata.json``) and the
    ``pieces`` of stored tensors covering it exactly."""

    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def sources(self) -> list[str]:
        """The stored names used, in first-use order."""
        return list(dict.fromkeys(p.source for p in self.pieces))


class Unresolved(KeyError):
    """No stored tensor serves ``name``; ``missing`` are the stored names that were looked for."""

    def __init__(self, name: str, missing: list[str]):
        super().__init__(name)
        self.name, self.missing = name, missing


def _full(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


@functools.lru_cache(maxsize=4096)
def _template(pattern: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", pattern)
    out = []
    for i, part in enumerate(parts):
        out.append(re.escape(part) if i % 2 == 0 else f"(?P<{part}>.+?)")
    return re.compile("".join(out))


def _fill(template: str, binding: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1) not in binding:
            raise ValueError(f"rule source {template!r} names {{{m.group(1)}}}, which its target does not bind")
        return binding[m.group(1)]
    return re.sub(r"\{(\w+)\}", sub, template)


@dataclass(frozen=True)
class Rule:
    """Base class of the rules; ``target`` is a name template (see the module docstring)."""

    target: str

    def match(self, name: str) -> dict[str, str] | None:
        """The placeholder values for which ``target`` is ``name``, or None."""
        m = _template(self.target).fullmatch(name)
        return None if m is None else m.groupdict()

    def source_names(self, binding: dict[str, str]) -> list[str]:
        raise NotImplementedError

    def layout(self, name: str, shapes: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[Box, int, tuple]]]:
        """The target's shape and its *local* pieces ``(region, source index, offsets in that source)``,
        from the sources' shapes. Raises ValueError naming the rule and ``name`` for shapes that do not fit."""
        raise NotImplementedError

    def _error(self, name: str, why: str) -> ValueError:
        return ValueError(f"mapping rule {self!r} for {name!r}: {why}")


@dataclass(frozen=True)
class Rename(Rule):
    """The target is the tensor ``source``."""

    source: str = ""

    def source_names(self, binding):
        return [_fill(self.source, binding)]

    def layout(self, name, shapes):
        return shapes[0], [(_full(shapes[0]), 0, (0,) * len(shapes[0]))]


@dataclass(frozen=True)
class Split(Rule):
    """The target is part ``index`` of ``source`` cut along ``dim``: ``sections`` equal parts (an int)
    or parts of the listed sizes, as ``numpy.split``."""

    source: str = ""
    dim: int = 0
    sections: int | tuple[int, ...] = 2
    index: int = 0

    def source_names(self, binding):
        return [_fill(self.source, binding)]

    def layout(self, name, shapes):
        shape = shapes[0]
        if not 0 <= self.dim < len(shape):
            raise self._error(name, f"dim {self.dim} does not exist in the source's shape {list(shape)}")
        n = shape[self.dim]
        if isinstance(self.sections, int):
            if self.sections < 1 or n % self.sections:
                raise self._error(name, f"{n} elements along dim {self.dim} do not split into {self.sections} equal parts")
            sizes = [n // self.sections] * self.sections
        else:
            sizes = [int(s) for s in self.sections]
            if sum(sizes) != n or min(sizes, default=0) < 0:
                raise self._error(name, f"sections {sizes} do not add up to the {n} elements along dim {self.dim}")
        if not 0 <= self.index < len(sizes):
            raise self._error(name, f"index {self.index} is not one of the {len(sizes)} sections")
        out = shape[: self.dim] + (sizes[self.index],) + shape[self.dim + 1:]
        offsets = tuple(sum(sizes[: self.index]) if d == self.dim else 0 for d in range(len(shape)))
        return out, [(_full(out), 0, offsets)]


@dataclass(frozen=True)
class Fuse(Rule):
    """The target is ``sources`` concatenated along ``dim`` (they agree on every other dim and on dtype)."""

    sources: tuple[str, ...] = ()
    dim: int = 0

    def source_names(self, binding):
        return [_fill(s, binding) for s in self.sources]

    def layout(self, name, shapes):
        if not shapes:
            raise self._error(name, "no sources to fuse")
        first = shapes[0]
        if not 0 <= self.dim < len(first):
            raise self._error(name, f"dim {self.dim} does not exist in the sources' shape {list(first)}")
        for s in shapes[1:]:
            if len(s) != len(first) or any(a != b for d, (a, b) in enumerate(zip(s, first)) if d != self.dim):
                raise self._error(name, f"the sources' shapes {[list(x) for x in shapes]} differ outside dim {self.dim}")
        pieces, at = [], 0
        for k, s in enumerate(shapes):
            region = Box(tuple(at if d == self.dim else 0 for d in range(len(s))), s)
            pieces.append((region, k, (0,) * len(s)))
            at += s[self.dim]
        return first[: self.dim] + (at,) + first[self.dim + 1:], pieces


@dataclass(frozen=True)
class Permute(Rule):
    """``source`` cut along ``dim`` into blocks of ``block`` elements; block ``j`` of the target is
    block ``order[j]`` of the source (``order`` is a permutation of the block indices)."""

    source: str = ""
    dim: int = 0
    block: int = 1
    order: tuple[int, ...] = ()

    def source_names(self, binding):
        return [_fill(self.source, binding)]

    def layout(self, name, shapes):
        shape = shapes[0]
        if not 0 <= self.dim < len(shape) or self.block < 1 or shape[self.dim] % self.block:
            raise self._error(name, f"the source's shape {list(shape)} is not made of blocks of {self.block} "
                                    f"along dim {self.dim}")
        n = shape[self.dim] // self.block
        if sorted(self.order) != list(range(n)):
            raise self._error(name, f"order {list(self.order)} is not a permutation of the {n} blocks")
        pieces = []
        for j, o in enumerate(self.order):
            off = tuple(j * self.block if d == self.dim else 0 for d in range(len(shape)))
            src = tuple(o * self.block if d == self.dim else 0 for d in range(len(shape)))
            lengths = tuple(self.block if d == self.dim else n_ for d, n_ in enumerate(shape))
            pieces.append((Box(off, lengths), 0, src))
        return shape, pieces


def _compose(local: list[tuple[Box, int, tuple]], sources: list[Resolved]) -> list[Piece]:
    """The rule's local pieces (over its sources) expressed over the stored tensors the sources resolve to."""
    out: list[Piece] = []
    for region, k, offsets in local:
        shifted = Box(tuple(offsets), region.lengths)  # the region, in source k's coordinates
        for p in sources[k].pieces:
            inter = intersect(shifted, p.region)
            if inter is None:
                continue
            target = Box(tuple(i - o + r for i, o, r in zip(inter.offsets, offsets, region.offsets)), inter.lengths)
            stored = tuple(i - pr + po for i, pr, po in zip(inter.offsets, p.region.offsets, p.offsets))
            out.append(Piece(target, p.source, stored))
    return _merged(out)


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of one stored tensor that are adjacent there too, joined (a permutation that
    keeps runs of blocks in order gives one piece per run)."""
    out: list[Piece] = []
    for p in sorted(pieces, key=lambda p: p.region.offsets):
        last = out[-1] if out else None
        if last is not None and last.source == p.source:
            diff = [d for d in range(len(p.region.offsets))
                    if (last.region.offsets[d], last.region.lengths[d]) != (p.region.offsets[d], p.region.lengths[d])]
            if len(diff) == 1:
                d = diff[0]
                same_src = all(last.offsets[e] == p.offsets[e] for e in range(len(p.offsets)) if e != d)
                if (same_src and last.region.offsets[d] + last.region.lengths[d] == p.region.offsets[d]
                        and last.offsets[d] + last.region.lengths[d] == p.offsets[d]):
                    lengths = tuple(a + b if e == d else a for e, (a, b) in
                                    enumerate(zip(last.region.lengths, p.region.lengths)))
                    out[-1] = Piece(Box(last.region.offsets, lengths), last.source, last.offsets)
                    continue
        out.append(p)
    return out


@dataclass(frozen=True)
class Mapping:
    """Declared renames for a cross-framework load (``unickpt.load(..., mapping=Mapping(...))``).

    Args:
        rules: :class:`Rule` objects, tried in order: the first whose target matches a name and whose
            sources all resolve wins; a name no rule serves is looked up in the checkpoint as it is.
        target: the :class:`~unickpt.interop.Layout` of the state being loaded into (None: the generic
            layout of a state holding a module and its optimizer; plugins pass their own).

    ``unickpt.load(..., mapping="auto")`` is ``Mapping()``: wrapper prefixes normalised, nothing renamed.
    """

    rules: tuple[Rule, ...] = ()
    target: object = None

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(self.rules))
        for r in self.rules:
            if not isinstance(r, Rule):
                raise TypeError(f"Mapping rules must be Rename / Split / Fuse / Permute, got {r!r}")

    def resolver(self, lookup: Lookup, extra: Sequence[Rule] = ()) -> Callable[[str], Resolved]:
        """A function ``resolve(name) -> Resolved`` over the stored tensors ``lookup`` knows, applying
        these rules and then ``extra`` (a layout's own). Raises :class:`Unresolved` naming the stored
        names looked for, ValueError for shapes a rule cannot take or rules that loop."""
        rules = list(self.rules) + list(extra)
        memo: dict[str, Resolved] = {}

        def resolve(name: str, stack: tuple = ()) -> Resolved:
            if name in memo:
                return memo[name]
            first_missing: list[str] | None = None
            for i, rule in enumerate(rules):
                binding = rule.match(name)
                if binding is None:
                    continue
                if (i, name) in stack:
                    raise ValueError(f"mapping rules loop at {name!r}: {' <- '.join(n for _, n in stack)} <- {name}")
                try:
                    sources = [resolve(s, stack + ((i, name),)) for s in rule.source_names(binding)]
                except Unresolved as e:
                    first_missing = first_missing if first_missing is not None else e.missing
                    continue
                dtypes = {s.dtype for s in sources}
                if len(dtypes) > 1:
                    raise ValueError(f"mapping rule {rule!r} for {name!r}: its sources have dtypes {sorted(dtypes)}")
                shape, local = rule.layout(name, [s.shape for s in sources])
                memo[name] = Resolved(tuple(shape), sources[0].dtype, tuple(_compose(local, sources)))
                return memo[name]
            found = lookup(name)
            if found is None:
                raise Unresolved(name, first_missing if first_missing is not None else [name])
            shape, dtype = found
            memo[name] = Resolved(tuple(shape), dtype, (Piece(_full(tuple(shape)), name, (0,) * len(shape)),))
            return memo[name]

        return resolve
