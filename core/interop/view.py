"""Cross-framework loads: a view of a stored checkpoint in the names of the state being loaded.

:func:`build_view` matches the roles (:mod:`unickpt.interop.layouts`) of the target state with the
stored ones, through the caller's :class:`~unickpt.plan.mapping.Mapping` rules (parameter-name space)
and the stored layout's own, and returns a :class:`View`: per target tensor the pieces of stored
tensors covering it (the loader reads through them, each rank only the byte ranges its own shard
needs), per target plain value its new value. Everything is checked first (keys, shapes, dtypes,
optimizer keys, param groups, schedulers); a mismatch raises
:class:`~unickpt.errors.StateMismatchError` naming the key and both values, before any byte lands.
See docs/cross-framework.md.

Pure functions on metadata and the target's flattened state; no I/O, no collective (the loader
calls :func:`build_view` on every rank with the same metadata, so every rank raises the same error).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

from ..errors import StateMismatchError
from ..format.dtypes import dtype_to_str
from ..format.metadata import CheckpointMetadata
from ..geometry import Box
from ..plan.mapping import Mapping, Piece, Resolved, Rule, Unresolved
from ..state.flat import FlatState
from .layouts import MASTER, PARAM, Layout, SourceNames, TargetNames, normalize, source_layout, wrappers

__all__ = ["View", "build_view", "as_mapping", "StoredParams"]


def as_mapping(mapping: Any) -> Mapping | None:
    """``None`` / ``"auto"`` / a :class:`Mapping` -> None or a Mapping. Raises TypeError otherwise."""
    if mapping is None:
        return None
    if mapping == "auto":
        return Mapping()
    if isinstance(mapping, Mapping):
        return mapping
    raise TypeError(f"mapping must be None, 'auto' or a unickpt.Mapping, got {mapping!r}")


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


def build_view(meta: CheckpointMetadata, flat: FlatState, mapping: Mapping, *, strict: bool, path: str) -> View:
    """Match the target state ``flat`` with the checkpoint ``meta`` through ``mapping``.

    Raises StateMismatchError (before anything is read) for a target entry no stored one serves, a
    shape or dtype that differs, optimizers or schedulers that differ and, with ``strict``, stored
    model tensors no target takes, stored optimizer state or a scheduler the target has no place for
    (when it has an optimizer), master weights or a loss scaler that cannot move; ValueError for rules
    that do not fit the stored shapes.
    """
    layout = source_layout(meta)
    src = layout.source(meta)
    # Mapping.target is typed object (plan/ sits below interop/): a Layout here
    tgt = (cast(Layout, mapping.target) if mapping.target is not None else Layout()).target(flat)
    wrap = wrappers()
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


def _plain(view: View, tgt: TargetNames, src: SourceNames, flat: FlatState, who: str, errors: list[str]) -> None:
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
        wrap = wrappers()
        self.meta, self.role, self.rules, self.plain = meta, role, list(src.rules), dict(src.plain)
        self._index = {normalize(name, wrap): fqn for (r, name), fqn in src.tensors.items() if r == role}
        self.names = sorted(self._index)
        self.fqns = sorted(set(self._index.values()))

    def resolver(self, rules: Sequence[Rule] = ()) -> Callable[[str], Resolved]:
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
