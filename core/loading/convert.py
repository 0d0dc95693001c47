"""Cross-framework loads: a view of a stored checkpoint in the names of the state being loaded.

A checkpoint written under one framework names its tensors its own way (``module.<p>`` and
``optimizer.state.exp_avg.<p>`` from DeepSpeed, ``models.0.<p>`` from Accelerate, ...). A
:class:`Layout` reads those names as *roles* of parameters (``param``, the fp32 ``master`` copy,
``state.<key>`` for an optimizer's per-parameter state) and its plain values as a few canonical ones
(``optim.param_groups``, ``optim.step``, ``scheduler``, ``scaler``, ``step``, ``epoch``). The
core's generic layout reads the states :func:`unickpt.save` builds from modules, optimizers and LR
schedulers (their ``__unickpt_stateful__`` nodes); framework plugins register their own under the
entry-point group ``unickpt.layouts`` by the ``framework`` name their saves record in
``metadata.json``.

:func:`build_view` matches the roles of the target state with the stored ones, through the caller's
:class:`~unickpt.plan.mapping.Mapping` rules (parameter-name space) and the stored layout's own, and
returns a :class:`View`: per target tensor the pieces of stored tensors covering it (the loader reads
through them, each rank only the byte ranges its own shard needs), per target plain value its new
value. Everything is checked first (keys, shapes, dtypes, optimizer keys, param groups, schedulers);
a mismatch raises :class:`~unickpt.errors.StateMismatchError` naming the key and both values, before
any byte lands. See docs/cross-framework.md.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from ..errors import StateMismatchError
from ..format.dtypes import dtype_to_str
from ..format.layout import METADATA_FILE
from ..format.metadata import CheckpointMetadata
from ..geometry import Box
from ..plan.mapping import Mapping, Piece, Resolved, Rule, Unresolved
from ..state import codec
from ..state.flat import saved_leaves

__all__ = ["PARAM", "MASTER", "SourceNames", "TargetNames", "Layout", "View", "registered_layouts", "source_layout",
           "locate_checkpoint", "build_view", "as_mapping", "CANONICAL", "StoredParams"]

log = logging.getLogger("unickpt")

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

    def target(self, flat: Any) -> TargetNames:
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


# -- the registry -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _entry_points(group: str) -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=group)}


@functools.lru_cache(maxsize=None)
def _load(group: str, name: str) -> Any:
    ep = _entry_points(group).get(name)
    if ep is None:
        return None
    try:
        return ep.load()
    except ImportError as e:  # the plugin's framework is not installed
        log.debug("unickpt: %s %s not available: %s", group, name, e)
        return None


def registered_layouts() -> list[str]:
    """The framework names of the installed plugins' layouts (entry-point group ``unickpt.layouts``),
    in registration order. A layout is imported only when it is used (:func:`source_layout`)."""
    return list(_entry_points("unickpt.layouts"))


def source_layout(meta: CheckpointMetadata) -> Layout:
    """The layout of the framework that wrote ``meta`` (the generic one when none is registered for it)."""
    return _load("unickpt.layouts", meta.framework or "") or Layout()


@functools.lru_cache(maxsize=1)
def _wrappers() -> tuple[frozenset, frozenset]:
    """The wrapper components of every installed plugin (entry-point group ``unickpt.wrappers``: a
    tuple of components each, ``"^module"`` meaning the first component only), dropped from parameter
    names on both sides of a cross-framework load. A separate group, so that reading them imports no
    layout module (Megatron's package imports megatron-core)."""
    anywhere, leading = set(), set()
    for name in _entry_points("unickpt.wrappers"):
        for w in _load("unickpt.wrappers", name) or ():
            (leading if w.startswith("^") else anywhere).add(w.lstrip("^"))
    return frozenset(anywhere), frozenset(leading)


def normalize(name: str, wrappers: tuple[frozenset, frozenset]) -> str:
    """``name`` without the wrapper components of every registered layout."""
    anywhere, leading = wrappers
    parts = name.split(".")
    if len(parts) > 1 and parts[0] in leading:
        parts = parts[1:]
    kept = [p for p in parts if p not in anywhere]
    return ".".join(kept) if kept else name


SUBDIR = "unickpt"
"""Plugins that keep unickpt's data beside a framework's own files put it in a subdirectory of this name
(Accelerate's ``checkpoint_<N>/unickpt/``: a root; Megatron's ``<iter dir>/unickpt``: a checkpoint)."""


def locate_checkpoint(path: str, storage: Any) -> str:
    """The unickpt checkpoint directory ``path`` names: ``path`` itself when it holds unickpt's
    ``metadata.json``; else ``path/unickpt``; else the checkpoint ``latest`` names in ``path`` or
    ``path/unickpt`` (a DeepSpeed ``save_dir``, an Accelerate folder, a checkpoint root); else what an
    installed locator finds (entry-point group ``unickpt.locators``: ``locate(path, storage) -> str |
    None``, e.g. Lightning's pointer files; a locator raises StateMismatchError for a checkpoint of its
    framework that cannot move, e.g. Lightning's full-dict packs, and that error is raised here); else
    ``path`` (the read then reports it)."""
    import json

    from ..format.metadata import FORMAT_NAME
    from ..lifecycle.root import CheckpointRoot

    def is_ours(p: str) -> bool:
        try:
            doc = json.loads(storage.read_bytes(storage.join(p, METADATA_FILE)))
        except (OSError, ValueError):
            return False
        return isinstance(doc, dict) and doc.get("format") == FORMAT_NAME

    def latest(root: str) -> str | None:
        try:
            name = CheckpointRoot(root, storage=storage).read_latest()
        except (OSError, ValueError):
            return None
        return storage.join(root, name) if name else None

    inner = storage.join(path, SUBDIR)
    for candidate in (path, inner, latest(path), latest(inner)):
        if candidate is not None and is_ours(candidate):
            return candidate
    for name in _entry_points("unickpt.locators"):
        locate = _load("unickpt.locators", name)
        try:
            found = locate(path, storage) if locate is not None else None
        except StateMismatchError:  # a checkpoint the locator knows and refuses (a Lightning full-dict pack)
            raise
        except (OSError, ValueError):
            found = None
        if found is not None and is_ours(found):
            return found
    return path


def as_mapping(mapping: Any) -> Mapping | None:
    """``None`` / ``"auto"`` / a :class:`Mapping` -> None or a Mapping. Raises TypeError otherwise."""
    if mapping is None:
        return None
    if mapping == "auto":
        return Mapping()
    if isinstance(mapping, Mapping):
        return mapping
    raise TypeError(f"mapping must be None, 'auto' or a unickpt.Mapping, got {mapping!r}")


# -- the view ---------------------------------------------------------------------------------------
@dataclass
class View:
    """A load through a mapping: per target tensor the pieces of stored tensors covering it
    (``(region, stored fqn, offsets)``), per target tensor filled from a plain value that value, per
    target plain value its new value, the checkpoint's canonical plain values (``source_plain``: for a
    plugin that rebuilds its own bookkeeping from them) and a report (``LoadStats.conversion``)."""

    tensors: dict[str, list[Piece]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    source_plain: dict[str, Any] = field(default_factory=dict)
    report: dict = field(default_factory=dict)


def _show(names: list[str], n: int = 12) -> str:
    names = sorted(names)
    return ", ".join(repr(x) for x in names[:n]) + (f" ... ({len(names)} in all)" if len(names) > n else "")


def build_view(meta: CheckpointMetadata, flat: Any, mapping: Mapping, *, strict: bool, path: str) -> View:
    """Match the target state ``flat`` with the checkpoint ``meta`` through ``mapping``.

    Raises StateMismatchError (before anything is read) for a target entry no stored one serves, a
    shape or dtype that differs, optimizers or schedulers that differ and, with ``strict``, stored
    model tensors no target takes, stored optimizer state or a scheduler the target has no place for
    (when it has an optimizer), master weights or a loss scaler that cannot move; ValueError for rules
    that do not fit the stored shapes.
    """
    layout = source_layout(meta)
    src = layout.source(meta)
    tgt = (mapping.target if mapping.target is not None else Layout()).target(flat)
    wrap = _wrappers()
    who = f"{path!r} (written by {meta.framework or 'unickpt.save'})"
    if src.index_keyed:
        raise StateMismatchError(f"{who}: {src.index_keyed[0]!r} is optimizer state keyed by parameter index (a "
                                 "Lightning full-dict or torch optimizer.state_dict()), which names no parameter; "
                                 "it cannot be mapped onto another framework's parameters")
    index: dict[tuple[str, str], str] = {}
    for (role, name), fqn in src.tensors.items():
        key = (role, normalize(name, wrap))
        if key in index and index[key] != fqn:
            raise StateMismatchError(f"{who}: {index[key]!r} and {fqn!r} are both the {role} of {key[1]!r} once "
                                     "wrapper prefixes are dropped")
        index[key] = fqn

    def stored(fqn: str):
        return meta.tensors[meta.aliases.get(fqn, fqn)]

    resolvers: dict[str, Any] = {}

    def resolver(role: str):
        if role not in resolvers:
            def lookup(name: str, role=role):
                fqn = index.get((role, name))
                if fqn is None:
                    return None
                t = stored(fqn)
                return tuple(t.shape), t.dtype
            resolvers[role] = mapping.resolver(lookup, src.rules)
        return resolvers[role]

    def resolve(role: str, name: str) -> Resolved | None:
        try:
            return resolver(role)(name)
        except Unresolved:
            return None

    def missing(role: str, name: str) -> list[str]:
        try:
            resolver(role)(name)
            return []
        except Unresolved as e:
            return e.missing

    view = View()
    consumed: set[str] = set()
    errors: list[str] = []
    unserved: list[str] = []  # targets no stored tensor serves
    differ: list[tuple] = []  # (target fqn, stored names, stored dtype, stored shape, target dtype, target shape)
    has_optimizer = bool(tgt.optimizers)
    target_keys = sorted({role[6:] for role, _ in tgt.tensors.values() if role.startswith("state.") and role != "state.step"})
    source_keys = sorted({role[6:] for role, _ in index if role.startswith("state.") and role != "state.step"})
    if has_optimizer and target_keys and source_keys and target_keys != source_keys:
        raise StateMismatchError(f"{who}: the checkpoint's optimizer keeps {source_keys} per parameter, the optimizer "
                                 f"to load into keeps {target_keys} (another optimizer?)")
    leaves = flat.tensors
    for fqn, (role, raw) in sorted(tgt.tensors.items()):
        name = normalize(raw, wrap)
        leaf = leaves[fqn]
        want_dtype, want_shape = dtype_to_str(leaf.dtype), tuple(leaf.global_shape)
        if role == "state.step":
            got = _step_source(resolve, index, name, src)
            if got is None:
                errors.append(f"{fqn!r}: the checkpoint has no optimizer step for {name!r}")
            elif isinstance(got, str):
                t = stored(got)
                if (t.dtype, tuple(t.shape)) != (want_dtype, want_shape):
                    differ.append((fqn, [got], t.dtype, tuple(t.shape), want_dtype, want_shape))
                view.tensors[fqn] = [Piece(Box((0,) * len(want_shape), want_shape), got, (0,) * len(want_shape))]
                consumed.add(got)
            else:
                value = _as_tensor_value(got, leaf, fqn, errors)
                if value is not None:
                    view.values[fqn] = value
            continue
        used_role, res = role, resolve(role, name)
        if role == PARAM:  # the fp32 master copy when the target has its dtype (exact), else the weights
            master = resolve(MASTER, name)
            if master is not None and master.dtype == want_dtype:
                used_role, res = MASTER, master
        if res is None:
            looked = missing(role, name)
            wrapped = [n for n in looked if normalize(n, wrap) != n]
            hint = (f"; rule sources name stored tensors without wrapper prefixes: {wrapped[0]!r} is stored as "
                    f"{normalize(wrapped[0], wrap)!r}") if wrapped else ""
            unserved.append(f"{fqn!r} ({role} of {name!r}; looked for "
                            f"{_show([index.get((role, n), n) for n in looked], 4)}{hint})")
            continue
        names = [index[(used_role, s)] for s in res.sources]
        if res.dtype != want_dtype or res.shape != want_shape:
            differ.append((fqn, names, res.dtype, res.shape, want_dtype, want_shape))
            continue
        view.tensors[fqn] = [Piece(p.region, meta.aliases.get(index[(used_role, p.source)], index[(used_role, p.source)]),
                                   p.offsets) for p in res.pieces]
        consumed.update(names)
    if unserved:
        errors.append(f"{len(unserved)} tensor(s) of the state no stored tensor serves: " + ", ".join(unserved[:6])
                      + (" ..." if len(unserved) > 6 else ""))
    if differ:
        kinds = sorted({(d[2], d[4]) for d in differ})
        errors.append(f"{len(differ)} tensor(s) differ in dtype or shape (never cast or reshaped; stored -> state: "
                      + ", ".join(f"{a} -> {b}" for a, b in kinds) + "): "
                      + ", ".join(f"{t!r} <- {_show(n, 2)} ({sd} {list(ss)} -> {td} {list(ts)})"
                                  for t, n, sd, ss, td, ts in differ[:4]) + (" ..." if len(differ) > 4 else ""))
    _plain(view, tgt, src, flat, who, errors)
    if strict and not (unserved or differ):  # otherwise the stored tensors left over are a consequence
        _leftovers(index, consumed, src, tgt, has_optimizer, who, errors)
    if errors:
        raise StateMismatchError(f"{who} does not load into this state: " + "; ".join(errors[:12])
                                 + (f" ... ({len(errors)} problems in all)" if len(errors) > 12 else ""))
    view.source_plain = dict(src.plain)
    view.report = {"from": meta.framework or "unickpt.save", "tensors": len(view.tensors) + len(view.values),
                   "values": sorted(view.objects), "left_behind": src.private, "kept": tgt.private}
    return view


def _step_source(resolve, index: dict, name: str, src: SourceNames) -> Any:
    """Where the optimizer step of parameter ``name`` comes from: a stored per-parameter step tensor
    (its fqn) of the (first) stored parameter it maps to, or the checkpoint's plain ``optim.step``."""
    res = resolve(PARAM, name) or resolve(MASTER, name)
    if res is not None:
        for s in res.sources:
            if ("state.step", s) in index:
                return index[("state.step", s)]
    if ("state.step", name) in index:
        return index[("state.step", name)]
    return src.plain.get("optim.step")


def _as_tensor_value(value: Any, leaf: Any, fqn: str, errors: list[str]) -> Any:
    import torch

    if not torch.is_tensor(value):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and leaf.local.dim() == 0:
            value = torch.tensor(value, dtype=leaf.dtype)
            if float(value) != float(value.item()):
                errors.append(f"{fqn!r}: the stored step {value!r} does not fit {leaf.dtype}")
            return value
        errors.append(f"{fqn!r}: the checkpoint's optimizer step is {value!r}, not a tensor")
        return None
    if value.dtype != leaf.dtype or tuple(value.shape) != tuple(leaf.global_shape):
        errors.append(f"{fqn!r}: the checkpoint's optimizer step has dtype {value.dtype} shape {list(value.shape)}, the "
                      f"state to load into has dtype {leaf.dtype} shape {list(leaf.global_shape)} (no implicit cast)")
        return None
    return value


def _plain(view: View, tgt: TargetNames, src: SourceNames, flat: Any, who: str, errors: list[str]) -> None:
    for fqn, canon in sorted(tgt.plain.items()):
        container, key = flat.objects[fqn]
        current = container[key]
        if canon not in src.plain:
            if canon in ("optim.step", "epoch", "step"):
                if canon == "step" and "optim.step" in src.plain:
                    view.objects[fqn] = _number(src.plain["optim.step"])
                continue  # left as it is (reported): not every framework counts these
            errors.append(f"{fqn!r} ({canon}): the checkpoint has none")
            continue
        value = src.plain[canon]
        if canon == "optim.param_groups":
            value = _groups(fqn, value, current, errors)
        elif canon in ("scheduler", "scaler") and isinstance(current, dict):
            if not isinstance(value, dict) or set(value) != set(current):
                errors.append(f"{fqn!r}: the checkpoint's {canon} state has keys {sorted(value) if isinstance(value, dict) else value!r}, "
                              f"this one {sorted(current)} (another {canon} class?)")
                continue
        elif canon == "step":
            value = _number(value)
        if value is not None:
            view.objects[fqn] = value


def _number(value: Any) -> Any:
    import torch

    return int(value.item()) if torch.is_tensor(value) and value.numel() == 1 else value


def _groups(fqn: str, saved: Any, current: Any, errors: list[str]) -> Any:
    """The target's param groups with the checkpoint's hyper-parameters (the target keeps its ``params``)."""
    if not isinstance(saved, list) or not isinstance(current, list) or len(saved) != len(current):
        errors.append(f"{fqn!r}: the checkpoint has {len(saved) if isinstance(saved, list) else saved!r} param groups, "
                      f"the optimizer to load into {len(current) if isinstance(current, list) else current!r}")
        return None
    out = []
    for i, (s, c) in enumerate(zip(saved, current)):
        # ``initial_lr`` is an LR scheduler's bookkeeping: a scheduler that cannot move is reported by itself
        sk, ck = set(s) - {"params", "initial_lr"}, set(c) - {"params", "initial_lr"}
        if sk != ck:
            errors.append(f"{fqn!r} group {i}: hyper-parameters differ: only in the checkpoint {sorted(sk - ck)}, only "
                          f"in the optimizer to load into {sorted(ck - sk)}")
            return None
        group = {k: v for k, v in s.items() if k != "params" and (k != "initial_lr" or k in c)}
        out.append({**group, **({"initial_lr": c["initial_lr"]} if "initial_lr" in c and "initial_lr" not in s else {}),
                    "params": c.get("params")})
    return out


def _leftovers(index: dict, consumed: set[str], src: SourceNames, tgt: TargetNames, has_optimizer: bool, who: str,
               errors: list[str]) -> None:
    used_params = {name for (role, name), fqn in index.items() if fqn in consumed and role in (PARAM, MASTER)}
    unused_model = sorted(fqn for (role, name), fqn in index.items()
                          if role == PARAM and fqn not in consumed and name not in used_params)
    if unused_model:
        errors.append(f"model tensors in the checkpoint that no tensor of the state takes: {_show(unused_model)}")
    if has_optimizer:
        lost = sorted(fqn for (role, name), fqn in index.items() if role == MASTER and fqn not in consumed)
        if lost:
            errors.append(f"the checkpoint's fp32 master weights {_show(lost, 3)} have no place in this run (its "
                          "parameters have another dtype and it keeps no master copy); loading would lose their "
                          "precision")
        unused = sorted(fqn for (role, name), fqn in index.items() if role.startswith("state.") and fqn not in consumed)
        if unused:
            errors.append(f"optimizer state in the checkpoint that no tensor of the state takes: {_show(unused)}")
        for canon, what in (("scheduler", "an LR scheduler"), ("scaler", "an fp16 loss scaler")):
            if canon in src.plain and canon not in tgt.plain.values():
                errors.append(f"{canon!r}: the checkpoint holds {what} ({_show(sorted(src.plain[canon]) if isinstance(src.plain[canon], dict) else [], 5)}), "
                              f"the state to load into has none; it cannot move (strict=False leaves it behind)")


class StoredParams:
    """The parameters of a stored checkpoint by name (its layout's names, wrappers dropped), for tools
    that read them through rules (``unickpt export --to``).

    Attributes:
        names: the parameter names the checkpoint stores for ``role`` (before the layout's own rules).
        fqns: their stored fqns.
        rules: the layout's own rules (Megatron's SwiGLU slabs, ...).
        plain: the checkpoint's canonical plain values.
    """

    def __init__(self, meta: CheckpointMetadata, role: str = PARAM):
        src = source_layout(meta).source(meta)
        wrap = _wrappers()
        self.meta, self.role, self.rules, self.plain = meta, role, list(src.rules), dict(src.plain)
        self._index = {normalize(name, wrap): fqn for (r, name), fqn in src.tensors.items() if r == role}
        self.names = sorted(self._index)
        self.fqns = sorted(set(self._index.values()))

    def resolver(self, rules: list[Rule] = ()) -> Any:
        """``resolve(name) -> Resolved`` whose pieces name stored fqns, through ``rules`` then the
        layout's own. Raises :class:`~unickpt.plan.mapping.Unresolved` / ValueError as the rules do."""
        meta = self.meta

        def lookup(name: str):
            fqn = self._index.get(name)
            if fqn is None:
                return None
            t = meta.tensors[meta.aliases.get(fqn, fqn)]
            return tuple(t.shape), t.dtype

        inner = Mapping(tuple(rules)).resolver(lookup, self.rules)

        def resolve(name: str) -> Resolved:
            r = inner(name)
            return Resolved(r.shape, r.dtype, tuple(
                Piece(p.region, meta.aliases.get(self._index[p.source], self._index[p.source]), p.offsets)
                for p in r.pieces))

        return resolve
