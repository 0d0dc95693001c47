"""Framework layouts: how a framework names training state in a unickpt checkpoint, by role.

A checkpoint written under one framework names its tensors its own way (``module.<p>`` and
``optimizer.state.exp_avg.<p>`` from DeepSpeed, ``models.0.<p>`` from Accelerate, ...). A
:class:`Layout` reads those names as *roles* of parameters (``param``, the fp32 ``master`` copy,
``state.<key>`` for an optimizer's per-parameter state) and its plain values as a few canonical ones
(``optim.param_groups``, ``optim.step``, ``scheduler``, ``scaler``, ``step``, ``epoch``). The
core's generic layout reads the states :func:`unickpt.save` builds from modules, optimizers and LR
schedulers (their ``__unickpt_stateful__`` nodes); framework plugins register their own under the
entry-point group ``unickpt.layouts`` by the ``framework`` name their saves record in
``metadata.json``.

The installed plugins' layouts and wrapper components come from the entry-point registry
(:mod:`unickpt.interop.entry_points`); :func:`source_layout` picks the one of a checkpoint's framework.
Pure functions on metadata; no I/O, no collective.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from ..errors import StateMismatchError
from ..format.metadata import CheckpointMetadata
from ..plan.mapping import Rule
from ..state import codec
from ..state.flat import FlatState, saved_leaves
from . import entry_points

__all__ = ["PARAM", "MASTER", "CANONICAL", "SourceNames", "TargetNames", "Layout", "registered_layouts",
           "source_layout", "wrappers", "normalize"]

PARAM, MASTER = "param", "master"
"""Roles of a parameter's tensors besides ``state.<key>`` (an optimizer's per-parameter state)."""

CANONICAL = ("optim.param_groups", "optim.step", "scheduler", "scaler", "step", "epoch")
"""The plain values a layout may name: the optimizer's hyper-parameter groups (without ``params``), its
step when it is not a per-parameter tensor, the LR scheduler's and the loss scaler's state dicts, the
training step and epoch."""


@dataclass
class SourceNames:
    """What a stored checkpoint holds, by role (:meth:`Layout.source`).

    Attributes:
        tensors: ``(role, parameter name) -> stored fqn``.
        plain: canonical name (:data:`CANONICAL`) -> value (decoded).
        rules: the layout's own rules (parameter-name space), applied after the caller's.
        private: stored entries no other framework takes (RNG, dataloader positions, ...): reported.
        index_keyed: stored optimizer states keyed by parameter index (not portable): their fqns.
    """

    tensors: dict[tuple[str, str], str] = field(default_factory=dict)
    plain: dict[str, Any] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)
    private: list[str] = field(default_factory=list)
    index_keyed: list[str] = field(default_factory=list)


@dataclass
class TargetNames:
    """What the state being loaded holds, by role (:meth:`Layout.target`).

    Attributes:
        tensors: target tensor fqn -> ``(role, parameter name)``.
        plain: target plain-value fqn -> canonical name.
        private: target entries left as they are (this framework's own: RNG, dataloaders, ...).
        modules, optimizers: the fqns of the modules and optimizers found (for the error messages).
    """

    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)
    plain: dict[str, str] = field(default_factory=dict)
    private: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    optimizers: list[str] = field(default_factory=list)


# -- the generic layout: modules, optimizers, schedulers, scalers as unickpt's flatten stores them -----
def _stateful_nodes(tree: Any) -> list[tuple[str, Any]]:
    """``(fqn, body)`` of every ``__unickpt_stateful__`` node of an encoded state tree (outermost only),
    with fqns built as :func:`unickpt.state.flat.saved_leaves` builds them."""
    out: list[tuple[str, Any]] = []

    def walk(e: Any, path: tuple) -> None:
        if isinstance(e, dict) and len(e) == 1:
            (tag, body), = e.items()
            if tag == codec.STATEFUL_REF:
                out.append((".".join(str(p) for p in path), body))
                return
            if tag == "__dict__" and isinstance(body, list):
                for k, v in body:
                    walk(v, path + (codec.decode(k),))
                return
            if tag == "__tuple__" and isinstance(body, list):
                for i, v in enumerate(body):
                    walk(v, path + (i,))
                return
            if tag in codec._TAGS:
                return
        if isinstance(e, dict):
            for k, v in e.items():
                walk(v, path + (k,))
        elif isinstance(e, list):
            for i, v in enumerate(e):
                walk(v, path + (i,))

    walk(tree, ())
    return out


def _refs(e: Any, path: tuple = ()) -> dict[str, str]:
    """``{relative name: tensor fqn}`` of the tensor references inside an encoded subtree."""
    if isinstance(e, dict) and len(e) == 1:
        (tag, body), = e.items()
        if tag == codec.TENSOR_REF:
            return {".".join(str(p) for p in path): body}
        if tag == "__dict__" and isinstance(body, list):
            return {k: v for kk, vv in body for k, v in _refs(vv, path + (codec.decode(kk),)).items()}
        if tag == "__tuple__" and isinstance(body, list):
            return {k: v for i, vv in enumerate(body) for k, v in _refs(vv, path + (i,)).items()}
        if tag in codec._TAGS:
            return {}
    if isinstance(e, dict):
        return {k: v for kk, vv in e.items() for k, v in _refs(vv, path + (kk,)).items()}
    if isinstance(e, list):
        return {k: v for i, vv in enumerate(e) for k, v in _refs(vv, path + (i,)).items()}
    return {}


def _kind(body: Any) -> str:
    """``optimizer``, ``optimizer-by-index``, ``module``, ``scheduler``, ``scaler`` or ``other``."""
    if isinstance(body, dict) and set(body) == {"state", "param_groups"}:
        state = body["state"]
        return "optimizer-by-index" if isinstance(state, dict) and "__dict__" in state else "optimizer"
    if _refs(body):
        return "module"
    keys = set(body) if isinstance(body, dict) else set()
    if "last_epoch" in keys and ("base_lrs" in keys or "_last_lr" in keys):
        return "scheduler"
    if {"scale", "growth_factor"} <= keys:
        return "scaler"
    return "other"


@dataclass
class _Structure:
    modules: dict[str, dict[str, str]] = field(default_factory=dict)  # fqn -> {param name: tensor fqn}
    optimizers: dict[str, Any] = field(default_factory=dict)  # fqn -> encoded body
    by_index: list[str] = field(default_factory=list)
    schedulers: list[str] = field(default_factory=list)
    scalers: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)


def _structure(tree: Any) -> _Structure:
    out = _Structure()
    for fqn, body in _stateful_nodes(tree):
        kind = _kind(body)
        if kind == "module":
            out.modules[fqn] = _refs(body)
        elif kind == "optimizer":
            out.optimizers[fqn] = body
        elif kind == "optimizer-by-index":
            out.by_index.append(fqn)
        elif kind == "scheduler":
            out.schedulers.append(fqn)
        elif kind == "scaler":
            out.scalers.append(fqn)
        else:
            out.other.append(fqn)
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _one(kind: str, fqns: list[str], where: str) -> str | None:
    if len(fqns) > 1:
        raise StateMismatchError(f"{where} holds {len(fqns)} {kind}s ({', '.join(map(repr, fqns))}); a cross-framework "
                                 f"load moves one {kind} (load each separately, or map them with explicit rules)")
    return fqns[0] if fqns else None


class Layout:
    """How a framework names training state in a unickpt checkpoint, and in the state it loads into.

    The base class is the generic layout of states holding an ``nn.Module``, its optimizer (fqn-keyed,
    ``get_optimizer_state_dict``), an LR scheduler, a ``GradScaler`` and a top-level ``step`` / ``epoch``
    (see the module docstring). A plugin subclasses it for its framework's own names and registers an
    instance under the entry-point group ``unickpt.layouts`` with the name its saves record as
    ``framework`` in ``metadata.json``.

    The path components frameworks insert into parameter names (``module.`` of DDP, ``_orig_mod.``
    of ``torch.compile``, ...) are declared separately, under the entry-point group ``unickpt.wrappers``,
    and dropped from every name on both sides; so are the framework-specific handles of a checkpoint
    (``unickpt.locators``, see :func:`locate_checkpoint`). Both groups are read without importing any
    layout module (Megatron's package imports megatron-core).

    Attributes:
        framework: the ``metadata.json`` ``framework`` this layout reads (None: the generic layout).
    """

    framework: str | None = None

    def source(self, meta: CheckpointMetadata) -> SourceNames:
        """The stored checkpoint's entries by role. Raises StateMismatchError for an ambiguous state
        (several modules or optimizers)."""
        st = _structure(meta.state_tree)
        _, _, objects = saved_leaves(meta.state_tree)
        out = SourceNames(index_keyed=list(st.by_index))
        where = "the checkpoint"
        module = _one("model", list(st.modules), where)
        optim = _one("optimizer", list(st.optimizers), where)
        used: set[str] = set()
        if module is not None:
            for name, fqn in st.modules[module].items():
                out.tensors[(PARAM, name)] = fqn
                used.add(fqn)
        if optim is not None:
            body = st.optimizers[optim]
            steps = []
            for p, entries in (body["state"] or {}).items():
                for key, value in _refs(entries).items():
                    out.tensors[(f"state.{key}", p)] = value
                    used.add(value)
                if isinstance(entries, dict) and "step" in entries and not _refs(entries["step"]):
                    steps.append(codec.decode(entries["step"]))
            out.plain["optim.param_groups"] = codec.decode(objects.get(f"{optim}.param_groups", body["param_groups"]))
            if steps:
                out.plain["optim.step"] = steps[0]
        if module is None:  # a flat dict of tensors (an imported model): every other tensor is a parameter
            for fqn in sorted(set(meta.tensors) | set(meta.aliases)):
                if fqn not in used and not (optim and fqn.startswith(optim + ".")):
                    out.tensors[(PARAM, fqn)] = fqn
                    used.add(fqn)
        sched = _one("LR scheduler", st.schedulers, where)
        if sched is not None:
            out.plain["scheduler"] = codec.decode(objects[sched])
        scaler = _one("loss scaler", st.scalers, where)
        if scaler is not None:
            out.plain["scaler"] = codec.decode(objects[scaler])
        for name in ("step", "global_step", "epoch"):
            if name in objects and isinstance(objects[name], int) and not isinstance(objects[name], bool):
                out.plain["epoch" if name == "epoch" else "step"] = objects[name]
        claimed = {module, optim, sched, scaler, "step", "global_step", "epoch"}
        out.private = sorted(f for f in set(objects) | set(meta.tensors) if f not in used
                             and not any(c and (f == c or f.startswith(c + ".")) for c in claimed))
        return out

    def target(self, flat: FlatState) -> TargetNames:
        """The target state's entries by role (``flat``: :class:`~unickpt.state.flat.FlatState`)."""
        st = _structure(flat.skeleton)
        out = TargetNames(modules=list(st.modules), optimizers=list(st.optimizers))
        where = "the state to load into"
        if st.by_index:
            raise StateMismatchError(f"{where}: {st.by_index[0]!r} is an optimizer state keyed by parameter index; "
                                     "a cross-framework load needs the fqn-keyed state (get_optimizer_state_dict)")
        module = _one("model", list(st.modules), where)
        optim = _one("optimizer", list(st.optimizers), where)
        if module is not None:
            for name, fqn in st.modules[module].items():
                out.tensors[fqn] = (PARAM, name)
        if optim is not None:
            body = st.optimizers[optim]
            for p, entries in (body["state"] or {}).items():
                for key, fqn in _refs(entries).items():
                    out.tensors[fqn] = (f"state.{key}", p)
                if isinstance(entries, dict) and "step" in entries and f"{optim}.state.{p}.step" in flat.objects:
                    out.plain[f"{optim}.state.{p}.step"] = "optim.step"
            out.plain[f"{optim}.param_groups"] = "optim.param_groups"
        if module is None:
            for fqn in flat.tensors:
                if fqn not in out.tensors:
                    out.tensors[fqn] = (PARAM, fqn)
        sched = _one("LR scheduler", st.schedulers, where)
        if sched is not None:
            out.plain[sched] = "scheduler"
        scaler = _one("loss scaler", st.scalers, where)
        if scaler is not None:
            out.plain[scaler] = "scaler"
        for name in ("step", "global_step", "epoch"):
            if name in flat.objects:
                out.plain[name] = "epoch" if name == "epoch" else "step"
        used = set(out.tensors) | set(out.plain)
        out.private = sorted(f for f in (*flat.tensors, *flat.objects, *flat.per_rank) if f not in used)
        return out


# -- the registered layouts and wrappers -----------------------------------------------------------
def registered_layouts() -> list[str]:
    """The framework names of the installed plugins' layouts (entry-point group ``unickpt.layouts``),
    in registration order. A layout is imported only when it is used (:func:`source_layout`)."""
    return list(entry_points.entry_points("unickpt.layouts"))


def source_layout(meta: CheckpointMetadata) -> Layout:
    """The layout of the framework that wrote ``meta`` (the generic one when none is registered for it).
    Raises TypeError when a plugin registered something else than a :class:`Layout`."""
    found = entry_points.load("unickpt.layouts", meta.framework or "")
    if found is None:
        return Layout()
    if not isinstance(found, Layout):
        raise TypeError(f"the unickpt.layouts entry point {meta.framework!r} is {found!r}, not a unickpt Layout")
    return found


@functools.lru_cache(maxsize=1)
def wrappers() -> tuple[frozenset[str], frozenset[str]]:
    """The wrapper components of every installed plugin (entry-point group ``unickpt.wrappers``: a
    tuple of components each, ``"^module"`` meaning the first component only), dropped from parameter
    names on both sides of a cross-framework load: ``(anywhere, leading)``. A separate group, so that
    reading them imports no layout module (Megatron's package imports megatron-core)."""
    anywhere: set[str] = set()
    leading: set[str] = set()
    for found in entry_points.load_all("unickpt.wrappers").values():
        for w in found if isinstance(found, (tuple, list)) else ():
            (leading if w.startswith("^") else anywhere).add(w.lstrip("^"))
    return frozenset(anywhere), frozenset(leading)


def normalize(name: str, wrap: tuple[frozenset[str], frozenset[str]]) -> str:
    """``name`` without the wrapper components ``wrap`` (:func:`wrappers`)."""
    anywhere, leading = wrap
    parts = name.split(".")
    if len(parts) > 1 and parts[0] in leading:
        parts = parts[1:]
    kept = [p for p in parts if p not in anywhere]
    return ".".join(kept) if kept else name
