"""FSDP1 flat parameters as irregular shards: which flat range of which original parameter each rank holds.

FSDP1 (``FullyShardedDataParallel``) concatenates the flattened original parameters of each wrapped
unit into one 1-D ``FlatParameter`` (with alignment padding when ``use_orig_params=True``) and gives
each rank a contiguous, equally sized slice of it (the last slices end in padding). Each original
parameter therefore lies on a rank as a contiguous range of its own row-major flattened elements,
cutting rows anywhere: an irregular shard. FSDP records the geometry per rank in
``FlatParameter._shard_param_infos`` (``offset_in_shard``, ``numel_in_shard``,
``intra_param_start_idx``; see ``torch/distributed/fsdp/_flat_param.py``), which is all this module
reads. No collective, no all-gather: the slices are views of the rank's local flat shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp._flat_param import FlatParameter

__all__ = ["ParamSlice", "FlatUnit", "fsdp1_units", "is_fsdp1", "module_buffers", "unmanaged_params"]


@dataclass(frozen=True)
class ParamSlice:
    """Original parameter ``fqn`` (global shape ``shape``) as held by this rank.

    ``start``, ``length``: the flat range of the parameter's row-major elements this rank holds
    (``length == 0``: none); ``offset``: where that range starts in the rank's local flat shard;
    ``index``: the parameter's index in its ``FlatParameter`` (``_params[index]`` with
    ``use_orig_params=True``); ``shared``: other fqns tied to this parameter (the same storage).
    """

    fqn: str
    shape: tuple[int, ...]
    start: int
    length: int
    offset: int
    index: int
    shared: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class FlatUnit:
    """One FSDP1 unit: its ``FlatParameter`` and the slice of every original parameter this rank holds."""

    flat_param: FlatParameter
    slices: list[ParamSlice]
    use_orig_params: bool

    def local_shard(self) -> torch.Tensor:
        """This rank's 1-D local flat shard (with its trailing padding), detached.

        Raises RuntimeError when the unit is not sharded right now (inside ``summon_full_params``,
        forward or backward), where the local shard is not the parameter's data.
        """
        fp = self.flat_param
        want = getattr(fp, "_sharded_size", None)
        if want is not None and tuple(fp.shape) != tuple(want):
            raise RuntimeError(
                f"FSDP unit holding {self.slices[0].fqn if self.slices else '?'!r}: its flat parameter has shape "
                f"{list(fp.shape)}, not its sharded shape {list(want)}; save and load outside forward, "
                "backward and summon_full_params"
            )
        return fp.detach()

    def view(self, source: torch.Tensor, s: ParamSlice) -> torch.Tensor:
        """The elements of ``s`` in ``source``, a tensor laid out like the local flat shard (1-D)."""
        return source.view(-1)[s.offset : s.offset + s.length]


def is_fsdp1(model: nn.Module) -> bool:
    """True when ``model`` is or contains an FSDP1 ``FullyShardedDataParallel`` unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return any(isinstance(m, FSDP) for m in model.modules())


def _clean(name: str) -> str:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def _join(prefix: str, name: str) -> str:
    return _clean(f"{prefix}.{name}" if prefix else name)


def fsdp1_units(model: nn.Module) -> list[FlatUnit]:
    """Every FSDP1 unit of ``model`` with this rank's parameter slices, in module order.

    fqns are the original parameter names relative to ``model`` with FSDP's wrapper prefixes removed
    (the names ``model.state_dict()`` uses). Parameters tied to an earlier one (FSDP1 flattens a
    shared parameter once) are listed in ``ParamSlice.shared`` of the primary.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = []
    for name, mod in model.named_modules():
        if not isinstance(mod, FSDP) or mod._handle is None:
            continue
        fp = mod._handle.flat_param
        prefix = f"{name}.{'_fsdp_wrapped_module'}" if name else "_fsdp_wrapped_module"
        shared: dict[str, list[str]] = {}
        for spi in fp._shared_param_infos:
            prim = _join(prefix, f"{spi.prim_module_name}.{spi.prim_param_name}" if spi.prim_module_name else spi.prim_param_name)
            tied = _join(prefix, f"{spi.module_name}.{spi.param_name}" if spi.module_name else spi.param_name)
            shared.setdefault(prim, []).append(tied)
        slices = []
        for i, (rel, shape, info) in enumerate(zip(fp._fqns, fp._shapes, fp._shard_param_infos)):
            fqn = _join(prefix, rel)
            if info.in_shard:
                start, length, offset = info.intra_param_start_idx, info.numel_in_shard, info.offset_in_shard
                assert start is not None and length is not None and offset is not None  # FSDP sets all three
            else:
                start, length, offset = 0, 0, 0
            slices.append(ParamSlice(fqn, tuple(shape), int(start), int(length), int(offset), i, tuple(shared.get(fqn, ()))))
        units.append(FlatUnit(fp, slices, bool(mod._use_orig_params)))
    return units


def module_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(fqn, buffer)`` for each persistent buffer (FSDP1 keeps them whole on every rank)."""
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is None or bname in mod._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            yield _join(mname, bname), buf


def unmanaged_params(model: nn.Module, units: list[FlatUnit]) -> Iterator[tuple[str, nn.Parameter]]:
    """``(fqn, parameter)`` for parameters no FSDP1 unit manages (ignored modules): whole on every rank."""
    managed = {id(u.flat_param) for u in units}
    for u in units:
        managed.update(id(p) for p in (getattr(u.flat_param, "_params", None) or ()))
        managed.update(id(p) for p in (getattr(u.flat_param, "_shared_params", None) or ()))
    for name, p in model.named_parameters():
        if id(p) not in managed:
            yield _clean(name), p

