"""The checks of a load, on the caller's thread before any byte is read: the keys of the state against
the checkpoint's (``strict``), each target tensor against its stored dtype and shape (never cast or
reshaped), and the one exception to the key rules: an optimizer saved before its first step.
Each raises :class:`~unickpt.errors.StateMismatchError` naming the key and both values.
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointNotFoundError, StateMismatchError
from ..format.dtypes import dtype_to_str
from ..format.metadata import CheckpointMetadata, TensorMeta, read_metadata
from ..lifecycle.root import CheckpointRoot, step_name
from ..state import codec
from ..storage.base import StorageBackend

__all__ = ["read_committed", "not_a_checkpoint", "check_target", "check_memory", "take_saved_empty_optimizer_states",
           "drop_states_the_checkpoint_lacks", "saved_param_groups", "check_param_groups", "check_keys"]


def read_committed(storage: StorageBackend, path: str) -> CheckpointMetadata:
    """``read_metadata(storage, path)``, saying what ``path`` is when it holds no ``metadata.json``
    (:func:`not_a_checkpoint`: a file, or a checkpoint root). Raises CheckpointNotFoundError,
    FormatVersionError, IntegrityError (malformed metadata)."""
    try:
        return read_metadata(storage, path)
    except (CheckpointNotFoundError, NotADirectoryError):
        better = not_a_checkpoint(storage, path)
        if better is None:
            raise
        raise better from None


def not_a_checkpoint(storage: StorageBackend, path: str) -> CheckpointNotFoundError | None:
    """The error for a ``path`` without ``metadata.json`` that is not an unfinished save: a file (no
    checkpoint directory), or a checkpoint root (``step_<N>`` directories: its newest committed step is
    named, as ``unickpt inspect`` does); None for anything else (an unfinished save, a wrong path)."""
    try:
        if storage.exists(path) and not storage.isdir(path):
            return CheckpointNotFoundError(
                f"{path!r} is a file, not a unickpt checkpoint directory (a checkpoint is a directory holding "
                "metadata.json; `unickpt import` converts other checkpoint files)")
        steps = CheckpointRoot(path, storage=storage).list()
    except OSError:
        return None
    if not steps:
        return None
    committed = [s for s, ok in steps if ok]
    if not committed:
        return CheckpointNotFoundError(f"{path!r} is a checkpoint root, not a checkpoint, and none of its "
                                       f"{len(steps)} step_<N> directories is committed (saves that never finished)")
    newest = storage.join(path, step_name(max(committed)))
    return CheckpointNotFoundError(
        f"{path!r} is a checkpoint root, not a checkpoint: its newest committed step is {max(committed)} "
        f"({newest!r}); pass a step_<N> directory (`unickpt ls {path}` lists them), or load the newest with "
        f"unickpt.Checkpointer({path!r}).load(state)")


def check_target(leaf: Any, tmeta: TensorMeta) -> None:
    """Raise StateMismatchError unless ``leaf`` can take the stored tensor as it is."""
    fqn = leaf.fqn
    got_dtype, got_shape = dtype_to_str(leaf.dtype), tuple(leaf.global_shape)
    if (got_dtype, got_shape) != (tmeta.dtype, tmeta.shape):
        raise StateMismatchError(
            f"{fqn!r}: checkpoint has dtype {tmeta.dtype} shape {list(tmeta.shape)}, the state to "
            f"load into has dtype {got_dtype} shape {list(got_shape)} (no implicit cast or reshape)"
        )
    check_memory(leaf)


def check_memory(leaf: Any) -> None:
    """Raise StateMismatchError unless ``leaf``'s tensor is dense strided memory that bytes can be loaded into."""
    fqn, t = leaf.fqn, leaf.local
    if t.device.type == "meta":
        raise StateMismatchError(f"{fqn!r}: the tensor to load into is on the meta device (no storage); "
                                 "materialize it first (e.g. model.to_empty(device=...))")
    if t.layout != torch.strided:
        raise StateMismatchError(f"{fqn!r}: tensor layout {t.layout} is not supported (dense tensors only)")
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise StateMismatchError(f"{fqn!r}: the tensor to load into is an expanded view (stride 0, "
                                 f"shape {list(t.shape)}, stride {list(t.stride())}); its elements share memory")


def take_saved_empty_optimizer_states(flat, saved_objects: dict) -> None:
    """An optimizer saved before its first step is ``{"state": {}, "param_groups": [...]}`` (one plain
    value), while the target optimizer's state has tensors (torch initialises an empty one so that
    there is something to load into). When the saved param groups match the target's (as many, the
    same hyper-parameter names, the same parameters), the saved state dict replaces the target's
    whole and ``load_state_dict`` empties the optimizer's state again: exactly the saved state comes
    back. Anything else (another optimizer class, other groups) is left to the key check, which
    raises StateMismatchError."""
    for fqn, (holder, key) in flat.optimizer_states.items():
        if fqn not in saved_objects:
            continue
        try:
            saved = codec.decode(saved_objects[fqn])
        except Exception:  # the key check and the object decoding report it
            continue
        target = holder[key]
        if not (isinstance(saved, dict) and saved.keys() == target.keys() and saved["state"] == {}
                and _groups_match(saved["param_groups"], target["param_groups"])):
            continue
        inner = fqn + "."
        for entries in (flat.tensors, flat.objects, flat.per_rank, flat.aliases):
            for name in [n for n in entries if n.startswith(inner)]:
                del entries[name]
        flat.objects[fqn] = (holder, key)


def drop_states_the_checkpoint_lacks(flat, saved_groups: dict, saved_tensors: set, saved_per_rank: set,
                                     saved_objects: dict) -> None:
    """A parameter that had no gradient at any step before the save has no optimizer state in the
    checkpoint (torch's optimizers create a parameter's state at its first step with a gradient: an
    unused layer, an expert that got no tokens), while a load into an optimizer without state has
    created state for every parameter, to have tensors to load into. For such an optimizer
    (``flat.created_states``), a parameter none of whose state entries the checkpoint holds gets no
    state, exactly what ``optimizer.load_state_dict`` of the saved state dict gives; its entries
    leave the load's targets. Only parameters that the saved param groups list (``saved_groups``,
    :func:`saved_param_groups`: the saved optimizer held them); an optimizer that had state before the load, or a parameter with some of
    its entries saved, is left to the key check (StateMismatchError names what is missing)."""
    saved = saved_tensors | saved_per_rank | set(saved_objects)
    for fqn in flat.created_states:
        if fqn in flat.objects:  # replaced whole by its saved empty state (take_saved_empty_optimizer_states)
            continue
        holder, key = flat.optimizer_states[fqn]
        state = holder[key].get("state")
        # only parameters the saved optimizer held (its param groups name them): one it never held is
        # another optimizer's checkpoint, which the key check reports
        groups = saved_groups.get(fqn)
        if groups is None or not isinstance(state, dict):  # nothing is dropped, the key check reports
            continue
        held = {p for g in groups for p in g}
        for pfqn, entries in list(state.items()):
            if str(pfqn) not in held or not isinstance(entries, dict) \
                    or any(isinstance(v, (dict, list, tuple)) for v in entries.values()):
                continue
            names = [f"{fqn}.state.{pfqn}.{k}" for k in entries]
            if any(n in saved for n in names):
                continue
            for n in names:
                for table in (flat.tensors, flat.objects, flat.per_rank, flat.aliases):
                    table.pop(n, None)
            del state[pfqn]


def check_param_groups(flat, saved_groups: dict, path: str) -> None:
    """Each optimizer's saved param groups hold the same parameters as the state's, group by group
    (as many groups; the same parameter fqns in each, in any order). torch's
    ``optimizer.load_state_dict`` refuses other groups (ValueError); torch's
    ``set_optimizer_state_dict`` would map them by name and leave a group without its
    hyper-parameters. ``saved_groups``: :func:`saved_param_groups`. Raises StateMismatchError naming
    the optimizer and both groupings."""
    for fqn, (holder, key) in flat.optimizer_states.items():
        saved = saved_groups.get(fqn)
        if saved is None or not isinstance(holder[key], dict):
            continue
        try:
            target = [sorted(map(str, g["params"])) for g in holder[key]["param_groups"]]
        except Exception:  # not groups of params: the object decoding and the key check report it
            continue
        if saved != target:
            def show(groups: list) -> str:
                return "; ".join(f"group {i}: {', '.join(ps[:6])}{' ...' if len(ps) > 6 else ''} ({len(ps)})"
                                 for i, ps in enumerate(groups))
            raise StateMismatchError(f"{path!r}: {fqn!r}: the checkpoint's optimizer has {len(saved)} param "
                                     f"group(s) [{show(saved)}], the state's has {len(target)} [{show(target)}]; "
                                     "build the optimizer with the same parameter groups")


def saved_param_groups(flat, saved_objects: dict) -> dict[str, list[list[str]] | None]:
    """For each optimizer of the state (``flat.optimizer_states``), the parameter fqns of each of its
    saved param groups (sorted), or None when the checkpoint has none (decoded once per load)."""
    return {fqn: _saved_group_params(saved_objects, fqn) for fqn in flat.optimizer_states}


def _saved_group_params(saved_objects: dict, fqn: str) -> list[list[str]] | None:
    """The groups are one plain value, or, when a group holds a tensor (a tensor learning rate), a
    list whose groups' ``params`` are values of their own."""
    try:
        whole = saved_objects.get(f"{fqn}.param_groups")
        if whole is not None:
            return [sorted(map(str, g["params"])) for g in codec.decode(whole)]
        out: list[list[str]] = []
        while f"{fqn}.param_groups.{len(out)}.params" in saved_objects:
            out.append(sorted(map(str, codec.decode(saved_objects[f"{fqn}.param_groups.{len(out)}.params"]))))
        return out or None
    except Exception:  # not groups of params: the object decoding and the key check report it
        return None


def _groups_match(saved: Any, target: Any) -> bool:
    if not isinstance(saved, list) or not isinstance(target, list) or len(saved) != len(target):
        return False
    for s, t in zip(saved, target):
        if not isinstance(s, dict) or not isinstance(t, dict) or s.keys() != t.keys():
            return False
        if sorted(map(str, s.get("params", []))) != sorted(map(str, t.get("params", []))):
            return False
    return True


def check_keys(flat, saved_tensors: set, saved_per_rank: set, saved_objects: dict, strict: bool, path: str) -> None:
    kinds_target = {**{f: "tensor" for f in flat.tensors}, **{f: "per-rank object" for f in flat.per_rank},
                    **{f: "object" for f in flat.objects}}
    kinds_saved = {**{f: "tensor" for f in saved_tensors}, **{f: "per-rank object" for f in saved_per_rank},
                   **{f: "object" for f in saved_objects}}
    wrong_kind = [f"{f!r} (checkpoint: {kinds_saved[f]}, state: {k})" for f, k in kinds_target.items()
                  if f in kinds_saved and kinds_saved[f] != k]
    if wrong_kind:
        raise StateMismatchError(f"{path!r}: entries of another kind: " + ", ".join(sorted(wrong_kind)[:20]))
    if not strict:
        return
    missing = sorted(set(kinds_target) - set(kinds_saved))
    unexpected = sorted(set(kinds_saved) - set(kinds_target))
    if missing or unexpected:
        def show(keys: list[str]) -> str:
            return ", ".join(repr(k) for k in keys[:20]) + (f" ... ({len(keys)} in all)" if len(keys) > 20 else "")
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {show(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state: {show(unexpected)}")
        raise StateMismatchError(f"{path!r}: keys differ (strict=True); " + "; ".join(parts))
