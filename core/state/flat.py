"""State traversal: a caller's nested state <-> flat ``fqn -> leaf`` maps (the canonical state).

Leaves:
- ``torch.Tensor``: replicated over the group (every rank holds the whole tensor);
- ``DTensor``: its local shard, an N-d box computed from mesh and placements (Shard/Replicate);
- :class:`~unickpt.Shard`: a box or flat range given by a plugin;
- :class:`~unickpt.PerRank`: per-rank state, stored per rank;
- ``nn.Module`` / ``torch.optim.Optimizer``: expanded with ``torch.distributed.checkpoint.state_dict``
  (``get_model_state_dict`` / ``get_optimizer_state_dict``; one ``get_state_dict`` call for a model
  with exactly one optimizer in the state: the same dicts), so DDP and FSDP2 models work; a save
  reuses the previous save's state dicts while nothing they depend on changed
  (:mod:`unickpt.state.sd_cache`);
- other objects with ``state_dict()`` / ``load_state_dict()``: expanded with ``state_dict()``;
- anything else: a plain value (global: rank 0's copy is saved, every rank gets it back).

Containers (dicts, lists, tuples) are descended into only when they hold a tensor, per-rank or
stateful leaf; a container of plain values is one leaf, replaced whole on load. The fqn of a leaf
joins the keys on its path with ``.``; two paths giving one fqn are an error.
"""
from __future__ import annotations

import collections
import contextlib
import math
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..geometry import Box, ChunkSpec
from . import codec, sd_cache
from .writeback import set_module_state
from .leaves import PerRank, Shard

__all__ = ["TensorLeaf", "FlatState", "flatten", "tensor_leaf", "saved_leaves", "dtensor_box", "check_leaf_fits",
           "optimizers_untouched", "undone_on_error"]


@dataclass
class TensorLeaf:
    """One tensor leaf: ``local`` holds the elements of ``spec`` of a global ``dtype`` tensor."""

    fqn: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    local: torch.Tensor
    spec: ChunkSpec
    storage_ptr: int | None = None  # ``local``'s storage address (None: empty or meta), set by :func:`flatten`


@dataclass
class FlatState:
    """A state reduced to flat maps, plus what is needed to put loaded values back."""

    tensors: dict[str, TensorLeaf] = field(default_factory=dict)
    objects: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # fqn -> (container, key)
    per_rank: dict[str, PerRank] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # fqn -> fqn it shares storage with
    skeleton: Any = None  # the expanded tree, encoded, with tensor / per-rank references
    optimizers: list = field(default_factory=list)  # the torch optimizers in the state, in walk order
    appliers: list[Callable[[], None]] = field(default_factory=list)  # load_state_dict calls, inner first
    optimizer_states: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # loads: fqn -> (holder, key)
    # of each optimizer state dict ({"state", "param_groups"}) with tensors, so that one saved before
    # its optimizer's first step (``state == {}``) can replace it whole (see loading)
    created_states: set[str] = field(default_factory=set)  # loads: those of optimizer_states whose
    # optimizer had no state before the load (created to have tensors to load into; see loading.checks)


_UNTOUCHED = threading.local()


def _install_optim_init_guard() -> None:
    """Wrap torch's ``state_dict._init_optim_state`` (once per process) so that it does nothing on a
    thread inside :func:`optimizers_untouched`; elsewhere it runs unchanged."""
    import torch.distributed.checkpoint.state_dict as torch_sd

    original = torch_sd._init_optim_state
    if getattr(original, "_unickpt_guard", False):
        return

    def _init_optim_state(optim: torch.optim.Optimizer) -> None:
        if getattr(_UNTOUCHED, "depth", 0):
            return
        original(optim)

    _init_optim_state._unickpt_guard = True  # type: ignore[attr-defined]
    torch_sd._init_optim_state = _init_optim_state


@contextlib.contextmanager
def optimizers_untouched():
    """Within this context, on this thread, torch's ``get_state_dict`` / ``get_optimizer_state_dict``
    (and code calling ``torch.distributed.checkpoint.state_dict._init_optim_state``) leave an optimizer
    that has no state yet as it is, instead of running a zero-gradient, lr=0 ``optimizer.step()`` to
    create its state (which makes Adam's step count 0 -> 1, allocates the moments and marks the step
    as taken for LR schedulers). Such an optimizer's state dict then has an empty ``state``, exactly
    what ``optimizer.state_dict()`` gives. Saves run inside it: a save never changes the state it saves.
    """
    _install_optim_init_guard()
    _UNTOUCHED.depth = getattr(_UNTOUCHED, "depth", 0) + 1
    try:
        yield
    finally:
        _UNTOUCHED.depth -= 1


_CREATED = threading.local()  # per thread: the records of the open undone_on_error() contexts
_ABSENT = object()


@contextlib.contextmanager
def undone_on_error():
    """A load's guard (on this thread): :func:`flatten` with ``for_load=True`` creates the state of an
    optimizer that has none (:func:`create_adam_state`, or torch's zero step), to have tensors to load
    into. If the body raises, each optimizer that had no state when a flatten inside it reached it gets
    its state emptied again (the same ``optimizer.state`` object, empty) and torch's LR-scheduler flag
    ``_opt_called`` back as it was: a refused or failed load leaves such an optimizer exactly as it was.
    The error is re-raised unchanged."""
    record: list[tuple[torch.optim.Optimizer, Any]] = []
    stack = _CREATED.__dict__.setdefault("stack", [])
    stack.append(record)
    try:
        yield
    except BaseException:
        for optim, called in record:
            optim.state.clear()
            if called is _ABSENT:
                optim.__dict__.pop("_opt_called", None)
            else:
                optim._opt_called = called  # type: ignore[attr-defined]
        raise
    finally:
        stack.pop()  # this context's record: contexts on one thread close innermost first


def _note_stateless(optim: torch.optim.Optimizer) -> None:
    """Remember, for the innermost :func:`undone_on_error`, an optimizer without state (before a load creates it)."""
    stack = getattr(_CREATED, "stack", None)
    if stack and not optim.state and all(o is not optim for o, _ in stack[-1]):
        stack[-1].append((optim, optim.__dict__.get("_opt_called", _ABSENT)))


def create_adam_state(optim: torch.optim.Optimizer) -> bool:
    """Loads: give an ``Adam`` / ``AdamW`` that has no state yet the per-parameter state its first step
    would create (``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq`` as
    ``zeros_like(param)``: DTensors for DTensor parameters; ``step`` a 0-d CPU tensor of torch's scalar
    dtype, float32 or float64 under a float64 default: torch's ``Adam._init_group``), so that the load has tensors to fill in place. torch's ``get_state_dict``
    creates them by running a zero-gradient, lr=0 ``optimizer.step()`` instead
    (``_init_optim_state``): on a restart that step is most of the load call (1.0 of 1.29 s for a
    0.1 GB FSDP2 state on one CPU rank: every op dispatched through DTensor, and ``sqrt``, ``mul_``,
    ``addcdiv_`` over every element). Returns whether it created the state; False (nothing done, torch's
    own path then runs) for any other optimizer class, one with state, gradients present (torch's path
    leaves the state empty then), or ``fused`` / ``capturable`` / ``differentiable`` groups. Every value
    created here is overwritten by the load, except the state of a parameter the checkpoint has none
    for (``strict=False``): its step is 0, where torch's path leaves 1."""
    if type(optim) not in (torch.optim.Adam, torch.optim.AdamW) or optim.state:
        return False
    groups = optim.param_groups
    if any(g.get("fused") or g.get("capturable") or g.get("differentiable") for g in groups):
        return False
    if any(p.grad is not None for g in groups for p in g["params"]):
        return False
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for g in groups:
        for p in g["params"]:
            if not p.requires_grad:
                continue
            state = {"step": torch.tensor(0.0, dtype=scalar),
                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if g.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optim.state[p] = state
    return True


def dtensor_box(dt: Any, fqn: str) -> Box:
    """The global box of a DTensor's local shard. Raises ValueError for Partial/strided placements.

    Cached by the DTensor's spec (mesh, placements, global shape; its hash is cached by torch) and this
    process's mesh coordinate: the computation costs ~0.2 ms per DTensor and is the same for every save
    of a layout."""
    spec = getattr(dt, "_spec", None)
    # the box also depends on this process's place in the mesh, which equal specs do not pin down (a
    # process group re-created with other ranks, as an in-process elastic restart does)
    key = None if spec is None else (spec, tuple(dt.device_mesh.get_coordinate() or ()))
    box = _BOX_BY_SPEC.get(key) if key is not None else None
    if box is not None:
        return box
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in dt.placements:
        if type(p) not in (DShard, Replicate):
            raise ValueError(
                f"{fqn!r}: DTensor placement {p} is not supported (expected Shard(d) or Replicate; "
                "reduce Partial placements before saving)"
            )
    local_shape, offset = compute_local_shape_and_global_offset(tuple(dt.shape), dt.device_mesh,
                                                                tuple(dt.placements))
    box = Box(tuple(int(o) for o in offset), tuple(int(n) for n in local_shape))
    if key is not None:
        if len(_BOX_BY_SPEC) >= 4096:
            _BOX_BY_SPEC.clear()
        _BOX_BY_SPEC[key] = box
    return box


_BOX_BY_SPEC: dict[tuple, Box] = {}


def _is_dtensor(x: Any) -> bool:
    # no import: until torch.distributed.tensor has been imported (~40 MB, 500 modules), no DTensor exists
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(x, cls)


def _is_tensor_leaf(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, Shard))


def _is_stateful(x: Any) -> bool:
    return callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))


def _has_special(x: Any) -> bool:
    """True if ``x`` is or holds a leaf that is not a plain value (tensor, per-rank, stateful)."""
    if type(x) in codec.JSON_SCALARS:
        return False
    if _is_tensor_leaf(x) or isinstance(x, (PerRank, nn.Module, torch.optim.Optimizer)):
        return True
    if isinstance(x, dict):
        return any(_has_special(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_special(v) for v in x)
    return _is_stateful(x)


def _is_sharded_tensor(x: Any) -> bool:
    # no import: without torch.distributed._shard loaded, no ShardedTensor exists
    mod = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    cls = getattr(mod, "ShardedTensor", None) if mod is not None else None
    return cls is not None and isinstance(x, cls)


def sharded_tensor_shard(st: Any, fqn: str) -> Shard:
    """The :class:`~unickpt.Shard` of this rank's part of a ``ShardedTensor`` (what FSDP1's
    ``SHARDED_STATE_DICT``, and so ``get_state_dict`` of an FSDP1 model, hold): its one local shard as
    a box at the shard's offsets, or an empty box when this rank holds none. Raises ValueError for
    several local shards on one rank (a box per rank is what a tensor leaf holds; give each shard as
    its own :class:`~unickpt.Shard` under its own key)."""
    shape = tuple(st.size())
    shards = st.local_shards()
    if len(shards) > 1:
        raise ValueError(f"{fqn!r}: a ShardedTensor with {len(shards)} local shards on this rank "
                         "(expected one, as FSDP1 gives); save each shard as its own unickpt.Shard")
    if not shards:  # this rank holds no element: an empty box
        empty = torch.empty((0,) + shape[1:] if shape else (0,), dtype=st.dtype)
        return Shard(empty, shape, offsets=(0,) * len(shape))
    return Shard(shards[0].tensor, shape, offsets=tuple(int(o) for o in shards[0].metadata.shard_offsets))


def tensor_leaf(fqn: str, x: Any) -> TensorLeaf:
    if _is_sharded_tensor(x):
        x = sharded_tensor_shard(x, fqn)
    t = x.tensor if isinstance(x, Shard) else x
    if t.layout != torch.strided or getattr(t, "is_quantized", False):
        raise ValueError(f"{fqn!r}: tensor layout {t.layout}{' (quantized)' if t.is_quantized else ''} is not "
                         "supported; unickpt stores dense tensors (convert with .to_dense() / .dequantize())")
    if isinstance(x, Shard):
        return TensorLeaf(fqn, x.tensor.dtype, x.global_shape, x.tensor, x.spec)
    if _is_dtensor(x):
        # the local shard itself (what ``to_local()`` returns, without its autograd node: ~10x cheaper)
        local = getattr(x, "_local_tensor", None)
        return TensorLeaf(fqn, x.dtype, tuple(x.shape), x.to_local() if local is None else local,
                          dtensor_box(x, fqn))
    shape = tuple(x.shape)
    return TensorLeaf(fqn, x.dtype, shape, x, Box((0,) * len(shape), shape))


def _alias_key(leaf: TensorLeaf) -> tuple | None:
    t = leaf.local
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            t.is_conj(), t.is_neg(), leaf.global_shape, leaf.spec)


def _module_for(optim: torch.optim.Optimizer, modules: list[nn.Module]) -> nn.Module | None:
    """The first module in ``modules`` that holds one of ``optim``'s parameters, else None."""
    ids = {id(p) for g in optim.param_groups for p in g["params"]}
    for m in modules:
        if any(id(p) in ids for p in m.parameters()):
            return m
    return None


def _collect_modules(x: Any, modules: list, optimizers: list) -> None:
    if isinstance(x, nn.Module):
        modules.append(x)
    elif isinstance(x, torch.optim.Optimizer):
        optimizers.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _collect_modules(v, modules, optimizers)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect_modules(v, modules, optimizers)


def _encode_key_dict(d: dict, items: list[tuple[Any, Any]]) -> Any:
    if all(isinstance(k, str) and k not in codec._TAGS for k in d):
        return {k: v for k, v in items}
    return {"__dict__": [[codec.encode(k), v] for k, v in items]}


def flatten(state: dict, *, for_load: bool, allow_pickle: bool = False) -> FlatState:
    """Reduce ``state`` to a :class:`FlatState`.

    Modules, optimizers and stateful objects are expanded with their state dicts; for a load the
    returned ``appliers`` push the loaded values back into them (call them after the tensors have
    been filled in place; a module's is skipped when it would only copy each tensor onto itself,
    :mod:`unickpt.state.writeback`). For a save, plain values that only pickle can store raise
    UnsafeObjectError unless ``allow_pickle``. Raises ValueError on an fqn collision or an unsupported leaf.

    A save leaves every optimizer as it is (:func:`optimizers_untouched`: one that has not stepped
    is saved with an empty ``state``). A load lets torch initialise an empty optimizer's state first,
    so that its moments exist as tensors to load into (torch's own load path does the same); inside
    :func:`undone_on_error` that state is emptied again if the load fails.
    """
    if not for_load:
        with optimizers_untouched():
            return _flatten(state, for_load=False, allow_pickle=allow_pickle)
    return _flatten(state, for_load=True, allow_pickle=allow_pickle)


def _flatten(state: dict, *, for_load: bool, allow_pickle: bool) -> FlatState:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_optimizer_state_dict,
    )

    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    out = FlatState()
    modules: list[nn.Module] = []
    optimizers = out.optimizers
    _collect_modules(state, modules, optimizers)
    seen_alias: dict[tuple, str] = {}
    paths: dict[str, tuple] = {}
    had_state = {id(o): bool(o.state) for o in optimizers} if for_load else {}  # before any is created
    if for_load:  # the moments to load into, without torch's zero step (create_adam_state)
        for o in optimizers:
            _note_stateless(o)
            create_adam_state(o)
    # a module with exactly one optimizer: both state dicts from one ``get_state_dict`` call (it
    # verifies the model once; two separate calls cost ~1.5x as much, all of it in the caller's stall)
    owner = {o: _module_for(o, modules) for o in optimizers}  # optimizers hash by identity
    optims_of = collections.Counter(id(m) for m in owner.values() if m is not None)
    combined: dict[int, Any] = {}
    for o, m in owner.items():
        if m is not None and optims_of[id(m)] == 1:
            # a save reuses the last save's state dicts while nothing they depend on changed (sd_cache)
            combined[id(m)], combined[id(o)] = get_state_dict(m, o) if for_load else sd_cache.state_dicts(m, o)

    def claim(fqn: str, path: tuple) -> None:
        if fqn in paths:
            raise ValueError(f"two entries of the state map to the fqn {fqn!r}: {paths[fqn]} and {path}; rename one")
        paths[fqn] = path

    def expand(x: Any, fqn: str) -> tuple[Any, Callable[[Any], None]] | None:
        """State dict of a module / optimizer / stateful object and how to load it back, else None."""
        if isinstance(x, nn.Module):
            sd = combined.pop(id(x), None)
            if sd is None:
                sd = get_model_state_dict(x) if for_load else sd_cache.state_dicts(x, None)[0]
            return sd, lambda sd, m=x: set_module_state(m, sd)  # skipped when it would copy onto itself
        if isinstance(x, torch.optim.Optimizer):
            model = owner[x] if x in owner else _module_for(x, modules)  # one inside a stateful object
            if model is None:
                raise ValueError(f"{fqn!r}: no nn.Module in the state holds this optimizer's parameters; "
                                 "put the model in the same state dict as its optimizer")
            sd = combined.pop(id(x), None)
            if sd is None and for_load:
                _note_stateless(x)  # one inside a stateful object: torch's zero step may create its state
            return ((get_optimizer_state_dict(model, x) if sd is None else sd),
                    # not strict: the load's key check has compared the state with the checkpoint;
                    # torch's would also refuse a parameter without saved state, which
                    # optimizer.load_state_dict accepts (one that never had a gradient)
                    lambda sd, m=model, o=x: set_optimizer_state_dict(
                        m, o, sd, options=StateDictOptions(strict=False)))
        if not isinstance(x, (PerRank, torch.Tensor, Shard)) and _is_stateful(x):
            return x.state_dict(), x.load_state_dict
        return None

    def walk(x: Any, path: tuple, fqn: str, container: Any, key: Any) -> Any:
        if type(x) in codec.JSON_SCALARS:  # the common leaf: a step count, a learning rate, a name
            if not path:
                raise TypeError("state must be a dict")
            claim(fqn, path)
            out.objects[fqn] = (container, key)
            return x
        if _is_tensor_leaf(x):
            claim(fqn, path)
            leaf = tensor_leaf(fqn, x)
            akey = _alias_key(leaf)
            leaf.storage_ptr = None if akey is None else akey[0]
            if akey is not None and akey in seen_alias:
                out.aliases[fqn] = seen_alias[akey]
            elif akey is not None:
                seen_alias[akey] = fqn
            out.tensors[fqn] = leaf
            return {codec.TENSOR_REF: fqn}
        expanded = expand(x, fqn)
        if expanded is not None:
            sd, load_fn = expanded
            holder = [sd]  # loaded plain values replace holder[0] itself when sd is not a container
            if for_load and path and isinstance(sd, dict) and sd.keys() == {"state", "param_groups"}:
                out.optimizer_states[fqn] = (holder, 0)
                if isinstance(x, torch.optim.Optimizer) and not had_state.get(id(x), True):
                    out.created_states.add(fqn)
            enc = walk(sd, path, fqn, holder, 0)
            if for_load:
                out.appliers.append(lambda: load_fn(holder[0]))
            return {codec.STATEFUL_REF: enc}
        if isinstance(x, PerRank):
            claim(fqn, path)
            out.per_rank[fqn] = x
            return {codec.PER_RANK_REF: fqn}
        prefix = fqn + "." if path else ""
        if isinstance(x, dict) and (not path or _has_special(x)):
            items = [(k, walk(v, path + (k,), prefix + str(k), x, k)) for k, v in x.items()]
            return _encode_key_dict(x, items)
        if isinstance(x, (list, tuple)) and _has_special(x):
            enc = [walk(v, path + (i,), prefix + str(i), x, i) for i, v in enumerate(x)]
            return enc if isinstance(x, list) else {"__tuple__": enc}
        if not path:
            raise TypeError("state must be a dict")
        claim(fqn, path)
        out.objects[fqn] = (container, key)
        return codec.encode(x, allow_pickle=allow_pickle or for_load, key=fqn)

    out.skeleton = walk(state, (), "", None, None)
    return out


def saved_leaves(skeleton: Any) -> tuple[set[str], set[str], dict[str, Any]]:
    """Walk a saved (encoded) skeleton: ``(tensor fqns, per-rank fqns, {object fqn: encoded value})``.

    Mirrors :func:`flatten`: containers are descended into only when they hold a reference.
    """
    tensors: set[str] = set()
    per_rank: set[str] = set()
    objects: dict[str, Any] = {}

    def has_ref(e: Any) -> bool:
        if isinstance(e, dict):
            if codec.TENSOR_REF in e or codec.PER_RANK_REF in e or codec.STATEFUL_REF in e:
                return True
            return any(has_ref(v) for v in e.values())
        if isinstance(e, list):
            return any(has_ref(v) for v in e)
        return False

    def walk(e: Any, path: tuple) -> None:
        fqn = ".".join(str(p) for p in path)
        if isinstance(e, dict) and len(e) == 1:
            (tag, body), = e.items()
            if tag == codec.TENSOR_REF:
                tensors.add(body)
                return
            if tag == codec.PER_RANK_REF:
                per_rank.add(body)
                return
            if tag == codec.STATEFUL_REF:
                walk(body, path)
                return
            if tag == "__dict__" and has_ref(body):
                for k, v in body:
                    walk(v, path + (codec.decode(k),))
                return
            if tag == "__tuple__" and has_ref(body):
                for i, v in enumerate(body):
                    walk(v, path + (i,))
                return
            if tag in codec._TAGS:
                objects[fqn] = e
                return
        if isinstance(e, dict) and (not path or has_ref(e)):
            for k, v in e.items():
                walk(v, path + (k,))
            return
        if isinstance(e, list) and has_ref(e):
            for i, v in enumerate(e):
                walk(v, path + (i,))
            return
        objects[fqn] = e

    walk(skeleton, ())
    return tensors, per_rank, objects


def local_nbytes(leaf: TensorLeaf) -> int:
    return leaf.spec.numel * leaf.dtype.itemsize


def check_leaf_fits(leaf: TensorLeaf) -> None:
    """Before a save: raise ValueError, naming the fqn, if the local tensor has no bytes to save (on
    the ``meta`` device: staging would read address 0) or its size does not match its chunk spec."""
    t = leaf.local
    if t.device.type == "meta" and t.numel() > 0:
        raise ValueError(f"{leaf.fqn!r}: a tensor on the meta device has no data to save (shape {list(t.shape)}, "
                         f"{t.dtype}); materialize it first (e.g. model.to_empty(device=...) and initialize)")
    want = leaf.spec.numel
    if leaf.local.numel() != want:
        raise ValueError(f"{leaf.fqn!r}: local tensor has {leaf.local.numel()} elements, its shard spec {leaf.spec} has {want}")
    if isinstance(leaf.spec, Box) and tuple(leaf.local.shape) != leaf.spec.lengths and math.prod(leaf.spec.lengths) > 0:
        raise ValueError(f"{leaf.fqn!r}: local shape {list(leaf.local.shape)} != shard box lengths {list(leaf.spec.lengths)}")

