"""FSDP model and optimizer state as unickpt state leaves.

:func:`model_state` / :func:`optimizer_state` return what to put into a ``unickpt.save`` /
``unickpt.load`` state for a model and its optimizer, whatever the FSDP flavour:

- FSDP2 (``fully_shard``) and HSDP (a 2-D mesh): parameters are DTensors, which the core already
  saves and reshards; the module and optimizer are returned unchanged. FSDP2 over a tensor-parallel
  dim (``_StridedShard`` placements) goes through :class:`StridedModelState`.
- FSDP1 (``FullyShardedDataParallel``), ``mode="flat"`` (default): :class:`FlatModelState` /
  :class:`FlatOptimizerState` describe each rank's slice of every flat parameter (and of the
  optimizer's moments, which have the flat parameter's layout) as flat ranges of the original
  parameters (:class:`unickpt.Shard` with ``flat_range``). Nothing is all-gathered; each rank writes
  its own bytes, and the engine stores them as flat ranges or merges them into row boxes
  (``unickpt.save(..., options=unickpt.SaveOptions(flat_ranges="merge"))``). Loading fills the local flat shard in place
  from whatever layout was saved (FSDP1 at any world size, FSDP2, a single process).
- FSDP1, ``mode="sharded"`` / ``"full"``: FSDP's own SHARDED_STATE_DICT (``ShardedTensor`` row
  blocks, converted to box shards) or FULL_STATE_DICT (whole tensors on every rank, written once),
  through ``torch.distributed.checkpoint.state_dict``.

The fqns are the same in every mode and flavour (``model.state_dict()`` names; optimizer state as
``state.<param fqn>.<key>`` and ``param_groups`` with fqns, the layout of
``get_optimizer_state_dict``), so a checkpoint saved by one loads into any other.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from unickpt import Shard, ext

from .flat_param import FlatUnit, ParamSlice, fsdp1_units, is_fsdp1, module_buffers, unmanaged_params

__all__ = ["model_state", "optimizer_state", "state", "FlatModelState", "FlatOptimizerState", "StateDictModelState",
           "StateDictOptimizerState", "StridedModelState", "StridedOptimizerState", "MODES"]

MODES = ("auto", "flat", "sharded", "full")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")


def model_state(model: nn.Module, mode: str = "auto") -> Any:
    """The state leaf for ``model``.

    Args:
        model: an FSDP1-wrapped module, an FSDP2 (``fully_shard``) module, or any module.
        mode: ``"auto"``: ``"flat"`` for FSDP1, the module itself otherwise; ``"flat"``: FSDP1 flat
            parameter slices (no all-gather); ``"sharded"`` / ``"full"``: FSDP1's SHARDED / FULL state
            dict through ``torch.distributed.checkpoint.state_dict``.

    Raises ValueError for an unknown mode or an FSDP1 mode on a model without FSDP1 units.
    """
    _check_mode(mode)
    fsdp1 = is_fsdp1(model)
    if mode != "auto" and not fsdp1:
        raise ValueError(f"mode={mode!r} is for FSDP1 (FullyShardedDataParallel) models; this model has no FSDP1 "
                         "unit (use mode='auto': FSDP2 / DTensor modules are saved as they are)")
    if not fsdp1:
        return StridedModelState(model) if _has_strided(model) else model
    if mode in ("auto", "flat"):
        return FlatModelState(model)
    return StateDictModelState(model, full=mode == "full")


def optimizer_state(model: nn.Module, optim: torch.optim.Optimizer, mode: str = "auto", process_group: Any = None) -> Any:
    """The state leaf for ``optim`` (which trains ``model``); same modes as :func:`model_state`.

    ``process_group``: the group ``unickpt.save`` / ``load`` run over (default: world); FSDP1 with
    ``use_orig_params=True`` exchanges one small object over it per save or load (which optimizer
    state keys exist, and the ``step`` of parameters a rank holds no element of).
    """
    _check_mode(mode)
    fsdp1 = is_fsdp1(model)
    if mode != "auto" and not fsdp1:
        raise ValueError(f"mode={mode!r} is for FSDP1 (FullyShardedDataParallel) models; this model has no FSDP1 unit")
    if not fsdp1:
        return StridedOptimizerState(model, optim) if _has_strided(model) else optim
    if mode in ("auto", "flat"):
        return FlatOptimizerState(model, optim, process_group)
    return StateDictOptimizerState(model, optim, full=mode == "full")


def state(model: nn.Module, optim: torch.optim.Optimizer | None = None, mode: str = "auto",
          process_group: Any = None) -> dict:
    """``{"model": model_state(model), "optim": optimizer_state(model, optim)}`` (no ``"optim"`` without one)."""
    out = {"model": model_state(model, mode)}
    if optim is not None:
        out["optim"] = optimizer_state(model, optim, mode, process_group)
    return out


# ---------------------------------------------------------------------------------------------- #
# FSDP1, flat parameters
# ---------------------------------------------------------------------------------------------- #
def _flat_shard(view: torch.Tensor, s: ParamSlice) -> Shard:
    return Shard(view, s.shape, flat_range=(s.start, s.length))


class FlatModelState:
    """An FSDP1 model's parameters as this rank's flat-parameter slices (no all-gather).

    ``state_dict()`` maps each original parameter fqn to a :class:`unickpt.Shard` whose tensor is a
    view of the rank's local flat shard and whose ``flat_range`` is where that view lies in the
    parameter's row-major elements; tied parameters map to the same view (stored once, as an
    alias); persistent buffers and parameters outside every FSDP unit are whole tensors. Loading
    fills those views in place, so ``load_state_dict`` has nothing left to do but check.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        units = fsdp1_units(self.model)
        out: dict[str, Any] = {}
        for u in units:
            local = u.local_shard()
            for s in u.slices:
                view = u.view(local, s)
                out[s.fqn] = _flat_shard(view, s)
                for tied in s.shared:
                    out[tied] = _flat_shard(view, s)
        for fqn, p in unmanaged_params(self.model, units):
            out[fqn] = p.detach()
        for fqn, b in module_buffers(self.model):
            out[fqn] = b
        return out

    def load_state_dict(self, sd: dict) -> None:
        for fqn, v in sd.items():
            if not isinstance(v, (Shard, torch.Tensor)):
                raise TypeError(f"{fqn!r}: expected a tensor for an FSDP1 parameter or buffer, got {type(v).__name__}")


_StateKey = tuple  # ("flat", dtype) | ("value", tensor) | ("plain", value)


class FlatOptimizerState:
    """An FSDP1 optimizer's state as flat-range shards of the original parameters.

    Moments (state tensors laid out like the parameter's local flat shard) become flat-range
    :class:`unickpt.Shard` views, written without any gather; scalar state (``step``) becomes a
    whole tensor per parameter; ``param_groups`` keep their hyper-parameters with parameter fqns.
    The layout equals ``get_optimizer_state_dict``'s, so FSDP2 and FSDP1 checkpoints interchange.

    With ``use_orig_params=False`` the optimizer holds one state per flat parameter, shared by its
    original parameters; with ``use_orig_params=True`` one per original parameter, and a rank that
    holds no element of a parameter has no state for it (FSDP sets its gradient to None): its keys
    and ``step`` come from the ranks that do, through one ``all_gather_object``.
    For a load, an empty optimizer is initialised first with a zero-gradient, zero-learning-rate step
    (``torch.distributed.checkpoint.state_dict._init_optim_state``, as ``set_optimizer_state_dict``
    does), so that its moments exist to load into; a save leaves it as it is
    (:func:`unickpt.ext.StateTools.optimizers_untouched`) and records an empty ``state``.
    """

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, process_group: Any = None):
        self.model, self.optim, self.group = model, optim, process_group
        self._targets: dict[str, tuple[list, str]] = {}

    # which optimizer state dict (by param object) holds a slice's state, and the slice's view of it
    @staticmethod
    def _param(u: FlatUnit, s: ParamSlice) -> Any:
        if not u.use_orig_params:
            return u.flat_param
        params = u.flat_param._params
        assert params is not None  # FSDP keeps the original parameters with use_orig_params=True
        return params[s.index]

    def _local_entries(self, units: list[FlatUnit]) -> dict[str, dict[str, _StateKey]]:
        """fqn -> {key: descriptor} for the parameters this rank holds elements of."""
        out: dict[str, dict[str, _StateKey]] = {}
        for u in units:
            for s in u.slices:
                st = self.optim.state.get(self._param(u, s))
                if not st or (s.length == 0 and u.use_orig_params):
                    continue
                desc: dict[str, _StateKey] = {}
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() == 0:
                        desc[k] = ("value", v.detach().clone().cpu())
                    elif isinstance(v, torch.Tensor):
                        desc[k] = ("flat", v.dtype)
                    else:
                        desc[k] = ("plain", v)
                out[s.fqn] = desc
        return out

    def _all_entries(self, units: list[FlatUnit]) -> dict[str, dict[str, _StateKey]]:
        local = self._local_entries(units)
        if not any(u.use_orig_params for u in units) or not dist.is_initialized():
            return local
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, local, group=self.group)
        merged: dict[str, dict[str, _StateKey]] = {}
        for entries in gathered:  # lowest rank first: its scalar values win (all holders agree)
            for fqn, desc in entries.items():
                merged.setdefault(fqn, dict(desc))
        return merged

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(self.optim)
        units = fsdp1_units(self.model)
        entries = self._all_entries(units)
        state: dict[str, dict[str, Any]] = {}
        self._targets = {}
        for u in units:
            for s in u.slices:
                if s.fqn not in entries:
                    continue
                st = self.optim.state.get(self._param(u, s)) or {}
                out = state[s.fqn] = {}
                for k, (kind, v) in entries[s.fqn].items():
                    if kind == "flat":
                        holds = s.length > 0 or not u.use_orig_params
                        held = st.get(k) if holds else None
                        if held is None:
                            if holds:
                                raise RuntimeError(f"optimizer state {s.fqn!r}.{k!r}: other ranks have it, this rank "
                                                   "holds elements of the parameter but no such state")
                            view = torch.empty(0, dtype=v)
                        else:
                            view = u.view(held, s) if not u.use_orig_params else held.detach().view(-1)
                        out[k] = _flat_shard(view, s)
                    elif kind == "value":
                        local = st.get(k) if (s.length or not u.use_orig_params) else None
                        out[k] = (local if local is not None else v).detach().clone()
                    else:
                        out[k] = v
        for fqn, p in unmanaged_params(self.model, units):  # ignored modules: whole state on every rank
            st = self.optim.state.get(p)
            if st:
                state[fqn] = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
        groups = []
        names = self._param_names(units)
        for g in self.optim.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [f for p in g["params"] for f in names.get(id(p), ())]
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def _param_names(self, units: list[FlatUnit]) -> dict[int, list[str]]:
        names: dict[int, list[str]] = {}
        for u in units:
            for s in u.slices:
                names.setdefault(id(self._param(u, s)), []).append(s.fqn)
        for fqn, p in unmanaged_params(self.model, units):
            names.setdefault(id(p), []).append(fqn)
        return names

    def load_state_dict(self, sd: dict) -> None:
        """Put loaded scalar and plain state and the param groups' hyper-parameters back (the moments
        were filled in place). Raises ValueError when the param groups hold other parameters than
        the checkpoint's, or the original parameters of one flat parameter have different steps."""
        units = fsdp1_units(self.model)
        saved_groups = sd["param_groups"]
        if len(saved_groups) != len(self.optim.param_groups):
            raise ValueError(f"optimizer: the checkpoint has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.optim.param_groups)}")
        names = self._param_names(units)
        for i, (g, saved) in enumerate(zip(self.optim.param_groups, saved_groups)):
            mine = {f for p in g["params"] for f in names.get(id(p), ())}
            theirs = set(saved["params"])
            if mine != theirs:
                raise ValueError(f"optimizer param group {i}: the checkpoint's parameters differ from this optimizer's "
                                 f"(only in checkpoint: {sorted(theirs - mine)[:5]}, only here: {sorted(mine - theirs)[:5]})")
        state = sd["state"]
        # a parameter the checkpoint has no state for (an optimizer saved before its first step) has none
        # after the load either, as with ``optimizer.load_state_dict``
        stateful = {id(self._param(u, s)) for u in units for s in u.slices if s.fqn in state}
        stateful |= {id(p) for fqn, p in unmanaged_params(self.model, units) if fqn in state}
        for p in [p for g in self.optim.param_groups for p in g["params"] if id(p) not in stateful]:
            self.optim.state.pop(p, None)
        for u in units:
            flat_values: dict[str, tuple[str, Any]] = {}
            for s in u.slices:
                if s.fqn not in state:
                    continue
                p = self._param(u, s)
                if u.use_orig_params and s.length == 0:
                    self.optim.state.pop(p, None)  # as in training: FSDP gives it no gradient on this rank
                    continue
                st = self.optim.state.setdefault(p, {})
                for k, v in state[s.fqn].items():
                    if isinstance(v, Shard):
                        continue
                    if isinstance(v, torch.Tensor) and u.use_orig_params:
                        _set_scalar(st, k, v)
                    elif isinstance(v, torch.Tensor):
                        if k in flat_values and not torch.equal(flat_values[k][1], v):
                            raise ValueError(
                                f"optimizer state {k!r}: {flat_values[k][0]!r} has {flat_values[k][1].item()}, "
                                f"{s.fqn!r} has {v.item()}; FSDP1 with use_orig_params=False keeps one value per "
                                "flat parameter, so they must be equal")
                        flat_values.setdefault(k, (s.fqn, v))
                        _set_scalar(st, k, v)
                    else:
                        st[k] = v
        for fqn, p in unmanaged_params(self.model, units):  # tensors were filled in place
            st = self.optim.state.get(p)
            for k, v in (state.get(fqn) or {}).items():
                if st is not None and not isinstance(v, torch.Tensor):
                    st[k] = v
        for g, saved in zip(self.optim.param_groups, saved_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})


def _set_scalar(st: dict, k: str, v: torch.Tensor) -> None:
    cur = st.get(k)
    if isinstance(cur, torch.Tensor) and cur.shape == v.shape and cur.dtype == v.dtype:
        cur.copy_(v)
    else:
        st[k] = v.to(cur.device) if isinstance(cur, torch.Tensor) else v


# ---------------------------------------------------------------------------------------------- #
# FSDP1, SHARDED_STATE_DICT / FULL_STATE_DICT
# ---------------------------------------------------------------------------------------------- #
def _is_strided(x: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(x, DTensor) and any(isinstance(p, _StridedShard) for p in x.placements)


def _has_strided(model: nn.Module) -> bool:
    """True when a parameter is a DTensor with a ``_StridedShard`` placement (FSDP2 over a
    tensor-parallel dim: FSDP shards the TP shard again along the same dim)."""
    return any(_is_strided(p) for p in model.parameters())


def _to_leaves(sd: Any, fqn: str = "") -> Any:
    """Replace ``ShardedTensor`` values (FSDP1 SHARDED_STATE_DICT) and DTensors with ``_StridedShard``
    placements (FSDP2 + TP) by box :class:`unickpt.Shard` s over their local tensors."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if _is_strided(sd):
        # the local shard of FSDP2-over-TP is one box of rows; torch computes where it lies
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(sd.shape, sd.device_mesh, sd.placements)
        local = sd.to_local()
        if tuple(local.shape) != tuple(shape):
            raise ValueError(f"{fqn!r}: local shard of shape {list(local.shape)} is not the box {list(shape)} at "
                             f"{list(offset)} of placements {sd.placements}")
        return Shard(local, tuple(sd.shape), offsets=tuple(offset))

    if isinstance(sd, ShardedTensor):
        return ext.StateTools.sharded_tensor_shard(sd, fqn)
    if isinstance(sd, dict):
        return {k: _to_leaves(v, f"{fqn}.{k}" if fqn else str(k)) for k, v in sd.items()}
    return sd


def _from_leaves(sd: Any, original: Any) -> Any:
    if isinstance(sd, dict) and isinstance(original, dict):
        return {k: _from_leaves(v, original.get(k)) for k, v in sd.items()}
    if isinstance(sd, Shard):
        return original  # the ShardedTensor whose local shard was filled in place
    return sd


class StateDictModelState:
    """An FSDP1 model through its SHARDED (``full=False``) or FULL (``full=True``) state dict
    (``get_model_state_dict`` / ``set_model_state_dict``). FULL all-gathers every parameter on every
    rank; unickpt writes each once."""

    def __init__(self, model: nn.Module, full: bool):
        self.model, self.full = model, full
        self._original: Any = None

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=self.full)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self._original = get_model_state_dict(self.model, options=self._options())
        return _to_leaves(self._original)

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, _from_leaves(sd, self._original), options=self._options())


class StridedModelState(StateDictModelState):
    """An FSDP2 model with ``_StridedShard`` DTensors (FSDP2 + tensor parallel on a 2-D mesh): its
    sharded state dict, the strided DTensors given to the engine as the row boxes they hold."""

    def __init__(self, model: nn.Module):
        super().__init__(model, full=False)


class StateDictOptimizerState(StateDictModelState):
    """An FSDP1 optimizer through ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, full: bool):
        super().__init__(model, full)
        self.optim = optim

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        self._original = get_optimizer_state_dict(self.model, self.optim, options=self._options())
        return _to_leaves(self._original)

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optim, _from_leaves(sd, self._original), options=self._options())


class StridedOptimizerState(StateDictOptimizerState):
    """The optimizer of a :class:`StridedModelState` model (sharded optimizer state dict)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer):
        super().__init__(model, optim, full=False)
