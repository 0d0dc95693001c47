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
- ZeRO-0: each parameter is its own "flat partition", whole: the module parameter itself (fp32, a
  plain torch optimizer) or its fp32 copy (bf16, ``FP16_UnfusedOptimizer.fp32_groups``).

Because the pieces are described in the coordinates of the original parameters, a checkpoint saved at
one data-parallel size (or ZeRO stage) loads at any other: unickpt intersects the stored flat ranges
with the ranges the new layout needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Fragment", "ZeroLayout", "zero_layout"]


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
    parameter partitions (``param.ds_tensor``); ``kind``: ``"zero12"``, ``"zero3"`` or ``"plain"``.
    """

    kind: str
    base: torch.optim.Optimizer
    flat: list[torch.Tensor]
    fragments: list[Fragment]
    lp_shards: dict[str, tuple[torch.Tensor, int, int]]

    def view(self, frag: Fragment, tensor: torch.Tensor) -> torch.Tensor:
        """``frag``'s elements inside ``tensor``, a tensor shaped like flat partition ``frag.group``."""
        return tensor.view(-1).narrow(0, frag.offset if frag.numel else 0, frag.numel)


def _names(engine: Any) -> dict:
    names = getattr(engine, "param_names", None)
    if not names:
        names = {p: n for n, p in engine.module.named_parameters()}
    return names


def zero_layout(engine: Any) -> ZeroLayout:
    """The optimizer layout of a DeepSpeed engine on this rank (see the module docstring).

    Raises:
        NotImplementedError: an optimizer this plugin does not know (names its class), an engine with
            no optimizer, or parameters offloaded to NVMe.
    """
    opt = engine.optimizer
    if opt is None:
        raise NotImplementedError("unickpt.deepspeed: the engine has no optimizer (inference engines are not "
                                  "supported by the unickpt checkpoint path)")
    names = _names(engine)
    cls = type(opt).__name__
    if hasattr(opt, "fp32_partitioned_groups_flat") and hasattr(opt, "fp16_groups"):  # ZeRO-3
        if getattr(opt, "swap_optimizer", False) or getattr(opt, "params_in_nvme_and_cpu", False):
            raise NotImplementedError("unickpt.deepspeed: ZeRO-3 with NVMe offload is not supported")
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
        return ZeroLayout("zero3", opt.optimizer, list(opt.fp32_partitioned_groups_flat), frags, lp)
    groups = flat = None
    if hasattr(opt, "bit16_groups") and hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        groups, flat = opt.bit16_groups, opt.single_partition_of_fp32_groups
    elif hasattr(opt, "bf16_groups") and hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer
        groups, flat = opt.bf16_groups, opt.fp32_groups_flat_partition
    if groups is not None:
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
        return ZeroLayout("zero12", opt.optimizer, list(flat), frags, {})
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):  # ZeRO-0 bf16: FP16_UnfusedOptimizer
        flat, frags = [], []
        for lp_params, hp_params in zip(opt.fp16_groups, opt.fp32_groups):
            for p, hp in zip(lp_params, hp_params):
                frags.append(Fragment(names[p], tuple(p.shape), 0, p.numel(), len(flat), 0))
                flat.append(hp)
        return ZeroLayout("plain", opt.optimizer, flat, frags, {})
    if isinstance(opt, torch.optim.Optimizer):  # ZeRO-0, fp32: the torch optimizer steps the module params
        flat, frags = [], []
        for group in opt.param_groups:
            for p in group["params"]:
                frags.append(Fragment(names[p], tuple(p.shape), 0, p.numel(), len(flat), 0))
                flat.append(p)
        return ZeroLayout("plain", opt, flat, frags, {})
    raise NotImplementedError(f"unickpt.deepspeed: optimizer wrapper {cls} is not supported (supported: ZeRO "
                              "stages 0-3 with fp32 or bf16)")
