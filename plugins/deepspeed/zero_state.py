"""DeepSpeed ZeRO optimizer partitions as irregular (flat-range) shards of the original parameters.

Every DeepSpeed optimizer keeps its fp32 master weights, and the optimizer state that has the same
shape (Adam's ``exp_avg`` / ``exp_avg_sq``), in one or more 1-D *flat partitions* per rank. Each flat
partition holds contiguous pieces of the flattened original parameters. This module finds, for this
rank, every piece as a :class:`Fragment` ``(param fqn, start and length in the flattened param,
flat partition index, offset in that partition)``, from DeepSpeed's own bookkeeping (deepspeed 0.19.8):

- ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and the bf16 optimizer (``BF16_Optimizer``): the
  ``param._hp_mapping`` that ``link_hp_params`` attaches to each parameter (``utils/tensor_fragment.py``:
  ``lp_fragment_address`` in the parameter, ``hp_fragment_address`` in the flat partition); these are the
  ``param_slice_mappings`` DeepSpeed writes into its own checkpoints.
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): the sub-group's flat partition is the concatenation of its
  parameters' partitions, each ``param.partition_numel()`` long (``stage3.py``,
  ``_set_fp16_partitioned_groups_flat``); rank ``r`` holds elements ``[r * n, (r + 1) * n)`` of the
  flattened parameter, clipped to ``param.ds_numel`` (``partition_parameters.py``, ``_partition_param``).
- ZeRO-0 with DeepSpeed's FusedAdam in fp16 or bf16 (``FP16_Optimizer``, ``runtime/fp16/fused_optimizer.py``):
  one flat fp32 master per param group, ``fp32_groups_flat[g]``, the concatenation of the group's
  trainable parameters ``fp16_groups[g]`` in order (``_flatten_dense_tensors``, no padding); the base
  optimizer steps the flat tensors.
- ZeRO-0 otherwise: each parameter is its own "flat partition", whole: the module parameter itself (fp32,
  a plain torch optimizer) or its fp32 copy (fp16 / bf16, ``FP16_UnfusedOptimizer.fp32_groups``).

Besides the partitions, the optimizer wrappers keep state of their own that their ``state_dict()`` saves:
the fp16 loss scaler, ``overflow``, ``clip_grad``. :func:`wrapper_state` / :func:`restore_wrapper_state`
save and restore it (fp16 only) as plain values (no pickle), in one form for every wrapper, so it moves
between ZeRO stages too.

Because the pieces are described in the coordinates of the original parameters, a checkpoint saved at
one data-parallel size (or ZeRO stage) loads at any other: unickpt intersects the stored flat ranges
with the ranges the new layout needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Fragment", "ZeroLayout", "zero_layout", "wrapper_state", "check_wrapper_state",
           "restore_wrapper_state"]


@dataclass(frozen=True)
class Fragment:
    """The piece of parameter ``name`` that this rank's flat partition ``group`` holds.

    ``start`` / ``numel``: element range in the row-major flattened parameter of shape ``shape``;
    ``offset``: where the piece starts in the flat partition. ``numel`` may be 0 (this rank holds none
    of the parameter; it still takes part in the collective save and load).
    """

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    group: int
    offset: int


@dataclass
class ZeroLayout:
    """This rank's optimizer layout.

    ``flat``: the fp32 master partitions, the base optimizer's parameters (1-D for ZeRO; whole
    parameters for ZeRO-0); ``base``: the torch
    optimizer that steps them; ``fragments``: every trainable parameter's piece per partition;
    ``lp_shards``: ZeRO-3 only, ``name -> (partition tensor, start, numel)`` of the low-precision
    parameter partitions (``param.ds_tensor``); ``kind``: ``"zero12"``, ``"zero3"``, ``"flat"``
    (``FP16_Optimizer``) or ``"plain"``; ``wrapper``: DeepSpeed's optimizer wrapper (``engine.optimizer``),
    or None where the engine steps a torch optimizer itself (ZeRO-0, fp32).
    """

    kind: str
    base: torch.optim.Optimizer
    flat: list[torch.Tensor]
    fragments: list[Fragment]
    lp_shards: dict[str, tuple[torch.Tensor, int, int]]
    wrapper: Any = None

    def view(self, frag: Fragment, tensor: torch.Tensor) -> torch.Tensor:
        """``frag``'s elements inside ``tensor``, a tensor shaped like flat partition ``frag.group``."""
        return tensor.view(-1).narrow(0, frag.offset if frag.numel else 0, frag.numel)


_SWITCH_OFF = 'remove the "unickpt" block from the DeepSpeed config to use DeepSpeed\'s own checkpoints'


def _names(engine: Any) -> dict:
    names = getattr(engine, "param_names", None)
    if not names:
        names = {p: n for n, p in engine.module.named_parameters()}
    return names


def zero_layout(engine: Any) -> ZeroLayout:
    """The optimizer layout of a DeepSpeed engine on this rank (see the module docstring).

    This is the one rule for what the plugin can save: ``deepspeed.initialize`` runs it too
    (:func:`unickpt.deepspeed.checkpoint.check_supported`), so an unsupported configuration is refused there,
    not at the first ``save_checkpoint``.

    Raises:
        NotImplementedError: an optimizer this plugin does not know (names its class), an engine with
            no optimizer, or parameters offloaded to NVMe; the message says how to switch unickpt off.
    """
    opt = engine.optimizer
    if opt is None:
        raise NotImplementedError("unickpt.deepspeed: the engine has no optimizer (inference engines are not "
                                  f"supported by the unickpt checkpoint path); {_SWITCH_OFF}")
    names = _names(engine)
    cls = type(opt).__name__
    if hasattr(opt, "fp32_partitioned_groups_flat") and hasattr(opt, "fp16_groups"):  # ZeRO-3
        if getattr(opt, "swap_optimizer", False) or getattr(opt, "params_in_nvme_and_cpu", False):
            raise NotImplementedError(f"unickpt.deepspeed: ZeRO-3 with NVMe offload is not supported; {_SWITCH_OFF}")
        frags, lp = [], {}
        for g, params in enumerate(opt.fp16_groups):
            offset = 0
            for p in params:
                n = int(p.partition_numel())
                start = n * int(opt._get_param_partition_rank(p))
                numel = max(0, min(n, int(p.ds_numel) - start))
                name = names[p]
                frags.append(Fragment(name, tuple(p.ds_shape), start if numel else 0, numel, g, offset))
                offset += n
        for p, name in names.items():
            t = p.ds_tensor
            n = int(t.numel())
            start = n * int(opt._get_param_partition_rank(p))
            numel = max(0, min(n, int(p.ds_numel) - start))
            lp[name] = (t, start if numel else 0, numel)
        return ZeroLayout("zero3", opt.optimizer, list(opt.fp32_partitioned_groups_flat), frags, lp, opt)
    groups = flat = None
    if hasattr(opt, "bit16_groups") and hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        groups, flat = opt.bit16_groups, opt.single_partition_of_fp32_groups
    elif hasattr(opt, "bf16_groups") and hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer
        groups, flat = opt.bf16_groups, opt.fp32_groups_flat_partition
    if groups is not None and flat is not None:
        frags = []
        for g, params in enumerate(groups):
            for p in params:
                m = getattr(p, "_hp_mapping", None)
                if m is None:
                    frags.append(Fragment(names[p], tuple(p.shape), 0, 0, g, 0))
                else:
                    lp_addr, hp_addr = m.lp_fragment_address, m.get_hp_fragment_address()
                    frags.append(Fragment(names[p], tuple(p.shape), int(lp_addr.start), int(lp_addr.numel), g,
                                          int(hp_addr.start)))
        return ZeroLayout("zero12", opt.optimizer, list(flat), frags, {}, opt)
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups_flat"):  # ZeRO-0 FusedAdam: FP16_Optimizer
        frags = []
        for g, params in enumerate(opt.fp16_groups):
            offset = 0
            for p in params:
                frags.append(Fragment(names[p], tuple(p.shape), 0, p.numel(), g, offset))
                offset += p.numel()
        return ZeroLayout("flat", opt.optimizer, list(opt.fp32_groups_flat), frags, {}, opt)
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):  # ZeRO-0 fp16/bf16: FP16_UnfusedOptimizer
        flat, frags = [], []
        for lp_params, hp_params in zip(opt.fp16_groups, opt.fp32_groups):
            for p, hp in zip(lp_params, hp_params):
                frags.append(Fragment(names[p], tuple(p.shape), 0, p.numel(), len(flat), 0))
                flat.append(hp)
        return ZeroLayout("plain", opt.optimizer, flat, frags, {}, opt)
    if isinstance(opt, torch.optim.Optimizer):  # ZeRO-0, fp32: the torch optimizer steps the module params
        flat, frags = [], []
        for group in opt.param_groups:
            for p in group["params"]:
                frags.append(Fragment(names[p], tuple(p.shape), 0, p.numel(), len(flat), 0))
                flat.append(p)
        return ZeroLayout("plain", opt, flat, frags, {})
    raise NotImplementedError(f"unickpt.deepspeed: optimizer wrapper {cls} is not supported (supported: "
                              "FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer, DeepSpeedZeroOptimizer, "
                              "DeepSpeedZeroOptimizer_Stage3 and torch optimizers); " + _SWITCH_OFF)


# -- the optimizer wrapper's own state (fp16 loss scaler, overflow, clip_grad) -----------------------------
# The loss scaler in one form for every wrapper. ZeRO 1-3 keep a ``LossScaler`` / ``DynamicLossScaler``
# object (``runtime/fp16/loss_scaler.py``), which their ``state_dict()`` pickles whole (``loss_scaler``);
# FP16_Optimizer / FP16_UnfusedOptimizer keep a ``LossScaleConfig`` and save its fields
# (``fused_optimizer.py`` / ``unfused_optimizer.py``, ``state_dict``). Names below are the scaler object's;
# ``_CONFIG_NAMES`` maps the two that LossScaleConfig spells differently.
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
                  "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "raise_error_at_min_scale")
_CONFIG_NAMES = {"dynamic": "dynamic_loss_scale", "min_scale": "min_loss_scale"}
# wrappers whose load_state_dict restores ``clip_grad`` from the checkpoint (Stage 3 and the unfused
# optimizer keep their configured value)
_RESTORES_CLIP_GRAD = ("FP16_Optimizer", "DeepSpeedZeroOptimizer")


def _scaler(opt: Any) -> tuple[Any, dict]:
    """``(object holding the loss-scaler fields, field name -> attribute name)``, or ``(None, {})`` for a
    wrapper without loss scaling (bf16, fp32)."""
    cfg = getattr(opt, "loss_scale_config", None)
    if cfg is not None:
        return (cfg, _CONFIG_NAMES) if cfg.use_grad_scaling else (None, {})
    scaler = getattr(opt, "loss_scaler", None)  # ZeRO 1-3: a static scale of 1 unless fp16 (CreateLossScaler)
    return (scaler, {}) if scaler is not None and getattr(opt, "dtype", None) == torch.float16 else (None, {})


def wrapper_state(layout: ZeroLayout) -> dict:
    """The wrapper's own state, as plain values (encodable by ``unickpt.ext.Codec.encode`` without pickle).

    ``loss_scaler``: ``{"dynamic": bool, "cur_scale": float, ...}`` (the fields of ``_SCALER_FIELDS`` the
    wrapper has); ``overflow`` (ZeRO 1-3, as their ``state_dict``); ``clip_grad``. Empty without loss
    scaling (bf16, fp32): nothing there changes during training.
    """
    holder, names = _scaler(layout.wrapper) if layout.wrapper is not None else (None, {})
    if holder is None:
        return {}
    opt = layout.wrapper
    out: dict[str, Any] = {"loss_scaler": {f: getattr(holder, names.get(f, f)) for f in ("dynamic", *_SCALER_FIELDS)
                                           if hasattr(holder, names.get(f, f))}}
    if hasattr(opt, "loss_scaler") and hasattr(opt, "overflow"):
        out["overflow"] = bool(opt.overflow)
    if hasattr(opt, "clip_grad"):
        out["clip_grad"] = opt.clip_grad
    return out


def check_wrapper_state(layout: ZeroLayout, path: str, saved: dict) -> None:
    """Before anything is loaded: the saved loss scaler fits this engine's (see :func:`wrapper_state`).

    Raises:
        StateMismatchError: the checkpoint has a dynamic loss scaler and this engine a static one (or
            the other way round), or this engine scales the loss (fp16) and the checkpoint has no scaler
            (it was saved without loss scaling), or the reverse.
    """
    from unickpt import StateMismatchError

    holder, names = _scaler(layout.wrapper) if layout.wrapper is not None else (None, {})
    saved_scaler = saved.get("loss_scaler")
    if (holder is None) != (saved_scaler is None):
        have = "has none" if holder is None else "scales the loss (fp16)"
        held = "none" if saved_scaler is None else f"an fp16 loss scaler {saved_scaler}"
        raise StateMismatchError(f"{path!r}: 'optimizer.wrapper.loss_scaler': the checkpoint holds {held}, this "
                                 f"engine {have}")
    if holder is not None and saved_scaler is not None:  # both or neither, checked above
        dynamic = bool(getattr(holder, names.get("dynamic", "dynamic")))
        if bool(saved_scaler["dynamic"]) != dynamic:
            kind = {True: "dynamic", False: "static"}
            raise StateMismatchError(f"{path!r}: 'optimizer.wrapper.loss_scaler': the checkpoint's fp16 loss scaling "
                                     f"is {kind[bool(saved_scaler['dynamic'])]}, this engine's is {kind[dynamic]} "
                                     '(the "fp16" block\'s "loss_scale": 0 selects dynamic scaling)')


def restore_wrapper_state(layout: ZeroLayout, saved: dict) -> list[str]:
    """Set the wrapper's own state from ``saved`` (:func:`wrapper_state`), as the wrapper's
    ``load_state_dict`` does; call :func:`check_wrapper_state` first.

    Returns the saved loss-scaler fields this wrapper has no place for (a ZeRO scaler's hysteresis fields
    loaded into FP16_Optimizer, which has no hysteresis), for the caller to report.
    """
    opt = layout.wrapper
    if opt is None:
        return []
    holder, names = _scaler(opt)
    dropped = []
    for field, value in (saved.get("loss_scaler") or {}).items():
        attr = names.get(field, field)
        if holder is not None and hasattr(holder, attr):
            setattr(holder, attr, value)
        else:
            dropped.append(field)
    if "overflow" in saved and hasattr(opt, "loss_scaler") and hasattr(opt, "overflow"):
        opt.overflow = saved["overflow"]
    if "clip_grad" in saved and type(opt).__name__ in _RESTORES_CLIP_GRAD:
        opt.clip_grad = saved["clip_grad"]
    if hasattr(opt, "loss_scaler") and hasattr(opt, "dynamic_loss_scale"):
        opt.dynamic_loss_scale = opt.loss_scaler.dynamic
    return dropped
