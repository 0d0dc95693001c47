"""Megatron-core sharded state -> unickpt canonical state (and back).

A megatron-core ``sharded_state_dict`` (after ``dist_checkpointing`` has applied its
``ShardedTensorFactory`` build functions and dropped ``LocalNonpersistentObject``) holds:

- ``ShardedTensor``: a local tensor, the global shape, its ``global_offset`` (elements per dim),
  ``prepend_axis_num`` leading global axes of length 1 the local tensor lacks (the layer index of
  the stacked ``decoder.layers.*`` keys, the expert index), ``replica_id`` and, in megatron-core
  < 0.16, an optional ``flattened_range`` (the distributed optimizer's slice of the row-major
  flattened local box). One rank may hold several shards of one key (one per local layer; the
  two halves of a SwiGLU ``linear_fc1`` that its factory splits).
- ``ShardedObject``: any value, identified by its ``unique_key``
  (``"{key}/shard_{offsets}_{global shape}"``), written by its main replica (``replica_id`` 0).

unickpt holds one shard per rank and fqn, so a ShardedTensor key maps to one or more fqns:

- the prepended axes become part of the fqn: ``decoder.layers.mlp.linear_fc1.weight[1]`` is layer 1
  (its global index, so PP changes keep the name), a tensor of the remaining axes;
- when some rank holds several shards of a key along one axis, the key's global tensor is stored as
  ``k`` slabs of that axis, ``KEY#0/k`` .. ``KEY#k-1/k``, so that no rank holds two pieces of one slab:
  ``k`` equal slabs when every such rank holds ``k`` shards, each within its own slab (SwiGLU's gate and
  up halves: ``k = 2`` at every TP size), else slabs cut after each shard but the last of every such
  rank (uneven shards; the cuts are recorded). Agreed by all ranks at save time and recorded in
  ``metadata.json`` ``extra.megatron.keys``;
- a shard is a box (:class:`unickpt.Shard` ``offsets=``); a flattened shard is a flat range of
  the fqn's row-major tensor when its slice is one contiguous global range (the box is split only
  along its leading non-singleton dim, or the slice stays within one row), otherwise a save fails
  naming the key, and a load reads the whole local box and copies the slice out;
- a ShardedObject becomes a ``uint8`` tensor under ``OBJECT_PREFIX + unique_key`` holding the value
  as unickpt tagged JSON (:mod:`unickpt.state.codec`; no pickle unless ``allow_pickle``), in the state of
  the rank holding its main replica only.

Replicas of a ShardedTensor (same key and box, ``replica_id != 0``: DP copies, TP-replicated
layernorms, the output layer tied to the embedding): by default only the main replica is handed to
the engine, megatron's rule (``FullyParallelSaveStrategyWrapper`` spreads the main replicas over the
DP group). With ``balance_replicas=True`` every replica is handed over and unickpt's planner writes
each box once, from the least loaded holder: fully parallel without megatron's exchange of replica
ids, for states whose replicas are bitwise identical (megatron keeps DP and TP replicas so).

Loading cuts every requested shard the same way, using the split recorded at save time; a rank that
needs several pieces of one fqn loads them in successive rounds (one collective ``unickpt.load`` each).
A request with fewer prepended axes than saved (``dist_checkpointing.load_plain_tensors`` asks for
whole stacked tensors) is read per stored layer, one with more (a plain tensor read as a stack, as
megatron-core's ``test_partition_change_save_load`` does) as a box of the stored tensor; a ShardedTensor with ``allow_shape_mismatch`` (padded
vocabularies) whose global shape differs gets zeros plus the stored overlap, megatron's torch_dist rule.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from unickpt import Shard, ext

__all__ = ["OBJECT_PREFIX", "KeyInfo", "SavePrep", "LoadTarget", "prepare_save", "agree_layout", "build_save_state",
           "to_load_targets", "is_main_replica", "global_flat_range", "encode_object", "decode_object",
           "stored_object_sizes"]

OBJECT_PREFIX = "megatron_sharded_objects/"
"""unickpt fqn prefix of ShardedObjects (followed by the object's ``unique_key``)."""


def is_main_replica(replica_id: Any) -> bool:
    """Megatron's rule: the main replica has ``replica_id`` 0, or a tuple of zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def global_flat_range(global_shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...],
                      start: int, stop: int) -> tuple[int, int] | None:
    """Map ``[start, stop)`` of a box's row-major flattened elements to the global tensor.

    Args:
        global_shape: the global tensor's shape.
        offsets, lengths: the box (elements per dim).
        start, stop: a slice of the box's ``prod(lengths)`` row-major elements.

    Returns:
        ``(global start, length)`` when those elements are one contiguous range of the row-major
        flattened global tensor, else None. The map from box order to global order is strictly
        increasing, so the elements are contiguous exactly when the global distance between the
        first and the last equals ``stop - 1 - start``.
    """
    if stop <= start:
        return (0, 0)

    def to_global(i: int) -> int:
        idx = []
        for n in reversed(lengths):
            idx.append(i % n)
            i //= n
        flat = 0
        for o, k, n in zip(offsets, reversed(idx), global_shape):
            flat = flat * n + o + k
        return flat

    first, last = to_global(start), to_global(stop - 1)
    return (first, stop - start) if last - first == stop - 1 - start else None


def encode_object(value: Any, key: str, allow_pickle: bool) -> torch.Tensor:
    """A ShardedObject's value as a 1-D ``uint8`` tensor of UTF-8 tagged JSON (:mod:`unickpt.state.codec`).

    Raises UnsafeObjectError (naming ``key``) for a value only pickle can store and ``allow_pickle`` off.
    """
    text = json.dumps(ext.Codec.encode(value, allow_pickle=allow_pickle, key=key), separators=(",", ":"))
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def decode_object(buf: torch.Tensor, key: str, allow_pickle: bool) -> Any:
    """Inverse of :func:`encode_object`. Raises UnsafeObjectError for a pickle and ``allow_pickle`` off."""
    return ext.Codec.decode(json.loads(bytes(buf.numpy()).decode()), allow_pickle=allow_pickle, key=key)




@dataclass
class KeyInfo:
    """How one ShardedTensor key is stored: its megatron global ``shape`` and ``dtype`` name, the number
    of ``prepend`` axes (named in the fqn), the slab ``split`` ``(axis, k)`` of the remaining axes, if any,
    and the slabs' ``cuts``: the ``k - 1`` inner slab boundaries along that axis (elements, increasing),
    or None for ``k`` equal slabs."""

    shape: tuple[int, ...]
    dtype: str
    prepend: int
    split: tuple[int, int] | None = None
    cuts: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        out = {"shape": list(self.shape), "dtype": self.dtype, "prepend": self.prepend,
               "split": list(self.split) if self.split else None}
        if self.cuts is not None:
            out["cuts"] = list(self.cuts)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "KeyInfo":
        """Raises ValueError for cuts that do not fit the split."""
        info = cls(tuple(d["shape"]), d["dtype"], int(d["prepend"]), tuple(d["split"]) if d.get("split") else None,
                   tuple(int(c) for c in d["cuts"]) if d.get("cuts") is not None else None)
        if info.cuts is not None:
            b = info.bounds()
            if info.split is None or len(b) != info.split[1] + 1 or any(x >= y for x, y in zip(b, b[1:])):
                raise ValueError(f"slab cuts {list(info.cuts)} do not fit split {info.split} of shape {list(info.shape)}")
        return info

    def bounds(self) -> tuple[int, ...]:
        """The ``k + 1`` slab boundaries ``(0, ..., length)`` along the split axis (``split`` is set; for
        equal slabs ``k`` divides the axis, which :func:`_pieces` checks)."""
        assert self.split is not None, "bounds() of a key stored whole"
        d, k = self.split
        n = self.shape[self.prepend + d]
        return (0, *self.cuts, n) if self.cuts is not None else tuple(i * (n // k) for i in range(k + 1))


def base_fqn(key: str, global_offset: tuple, prepend: int) -> str:
    """``key``, or ``key[i,j]`` with the offsets along the prepended axes (global layer / expert index)."""
    if prepend == 0:
        return key
    return f"{key}[{','.join(str(int(o)) for o in global_offset[:prepend])}]"


@dataclass
class _Entry:
    sh: Any
    base: str
    shape: tuple[int, ...]  # global shape without the prepended axes
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    flat: tuple[int, int] | None  # flattened_range (start, stop) of the box, or None


def _entry(sh: Any) -> _Entry:
    n = sh.prepend_axis_num
    fr = getattr(sh, "flattened_range", None)
    return _Entry(sh, base_fqn(sh.key, tuple(sh.global_offset), n), tuple(int(x) for x in sh.global_shape[n:]),
                  tuple(int(x) for x in sh.global_offset[n:]), tuple(int(x) for x in sh.local_shape),
                  None if fr is None else (int(fr.start or 0), int(fr.stop)))


def _duplicates(entries: list[_Entry], errors: list[str]) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """key -> (axis, extents) for keys of which this rank holds several distinct non-empty boxes of one fqn
    that differ along one axis: the boxes' sorted ``(offset, length)`` along that axis (over every fqn of
    the key on this rank)."""
    by_base: dict[str, list[_Entry]] = {}
    for e in entries:
        by_base.setdefault(e.base, []).append(e)
    out: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    for base, es in by_base.items():
        boxes = {(e.offsets, e.lengths) for e in es if all(e.lengths)}  # an empty box holds nothing to store
        if len(boxes) < 2:
            continue
        key = es[0].sh.key
        axes = {d for (o1, l1) in boxes for (o2, l2) in boxes for d in range(len(o1)) if (o1[d], l1[d]) != (o2[d], l2[d])}
        if len(axes) != 1 or any(e.flat is not None for e in es):
            errors.append(f"ShardedTensor {key!r}: this rank holds {len(boxes)} shards of {base!r} that differ "
                          f"along axes {sorted(axes)}{' and are flattened' if any(e.flat for e in es) else ''}; "
                          "unickpt stores several shards of one key per rank only along one axis")
            continue
        axis = axes.pop()
        if out.setdefault(key, (axis, []))[0] != axis:
            errors.append(f"ShardedTensor {key!r}: shards split along axis {out[key][0]} and axis {axis} on this rank")
            continue
        out[key][1].extend((o[axis], n[axis]) for o, n in boxes)
    return {key: (axis, sorted(set(extents))) for key, (axis, extents) in out.items()}


def _slabs(length: int, extents: list[list[tuple[int, int]]]) -> tuple[int, tuple[int, ...] | None]:
    """The slabs of a key that ranks hold in several pieces along one axis (of ``length`` elements), from
    each such rank's sorted, non-empty ``(offset, length)`` extents: ``(k, None)`` for ``k`` equal slabs
    when every such rank holds ``k`` pieces, each within a slab of its own (SwiGLU's gate and up halves);
    else ``(k, cuts)``, the slabs cut after each piece but the last of every such rank, so that no rank
    holds two pieces of one slab."""
    ks = {len(ex) for ex in extents}
    if len(ks) == 1:
        k = ks.pop()
        size = length // k
        if length % k == 0 and all(len({o // size for o, _ in ex}) == k and all(o // size == (o + n - 1) // size
                                                                              for o, n in ex) for ex in extents):
            return k, None
    cuts = tuple(sorted({o + n for ex in extents for o, n in ex[:-1]} - {0, length}))
    return len(cuts) + 1, cuts


@dataclass
class SavePrep:
    """One rank's part of a save before the ranks agree: entries, objects, key infos, splits, errors."""

    entries: list = field(default_factory=list)
    objects: dict = field(default_factory=dict)
    infos: dict[str, dict] = field(default_factory=dict)
    splits: dict[str, tuple[int, list[tuple[int, int]]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _values(sharded_state_dict: Any) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return list(nested_values(sharded_state_dict))


def prepare_save(sharded_state_dict: Any, *, allow_pickle: bool = False, balance_replicas: bool = False) -> SavePrep:
    """First step of a save on one rank (no communication). Problems are collected in ``errors`` (one
    line per key) instead of raised, so that every rank can fail together. Plain (non-sharded)
    values are ignored: megatron's common strategy saves them in ``common.pt``."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out = SavePrep()
    for sh in _values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            if sh.key.startswith(OBJECT_PREFIX):
                out.errors.append(f"ShardedTensor key {sh.key!r} uses the prefix {OBJECT_PREFIX!r} reserved for ShardedObjects")
                continue
            info = KeyInfo(tuple(int(n) for n in sh.global_shape), ext.Codec.dtype_to_str(sh.dtype), sh.prepend_axis_num).to_json()
            if out.infos.setdefault(sh.key, info) != info:
                out.errors.append(f"ShardedTensor {sh.key!r}: shards disagree on global shape / dtype / prepended "
                                  f"axes: {out.infos[sh.key]} and {info}")
            if not balance_replicas and not is_main_replica(sh.replica_id):
                continue
            if sh.data is None:
                out.errors.append(f"ShardedTensor {sh.key!r} has no data to save")
                continue
            e = _entry(sh)
            want = e.lengths if e.flat is None else (e.flat[1] - e.flat[0],)
            have = tuple(sh.data.shape) if e.flat is None else (sh.data.numel(),)
            if have != want:
                out.errors.append(f"ShardedTensor {sh.key!r}: data shape {list(sh.data.shape)} does not fit local_shape "
                                  f"{list(sh.local_shape)} / flattened_range {e.flat}")
                continue
            if e.flat is not None and global_flat_range(e.shape, e.offsets, e.lengths, *e.flat) is None:
                out.errors.append(_noncontiguous(e, e.shape, e.offsets, e.lengths))
                continue
            out.entries.append(e)
        elif isinstance(sh, ShardedObject):
            if not is_main_replica(sh.replica_id):
                continue
            fqn = OBJECT_PREFIX + sh.unique_key
            try:
                out.objects[fqn] = encode_object(sh.data, fqn, allow_pickle)
            except Exception as e:  # UnsafeObjectError or an encoding failure: name the key
                out.errors.append(f"ShardedObject {sh.unique_key!r}: {type(e).__name__}: {e}")
        else:
            out.errors.append(f"unsupported sharded entry {type(sh).__name__} (key {getattr(sh, 'key', '?')!r}); "
                              "apply ShardedTensorFactory build functions first (dist_checkpointing.save does)")
    out.splits = _duplicates(out.entries, out.errors)
    return out


def agree_layout(preps: list[tuple[dict, dict, list]]) -> tuple[dict[str, KeyInfo], dict[int, list[str]]]:
    """Merge every rank's ``(infos, splits, errors)`` into the key infos all ranks use (the same on
    every rank) and the problems by rank."""
    infos: dict[str, dict] = {}
    errors: dict[int, list[str]] = {r: list(errs) for r, (_, _, errs) in enumerate(preps) if errs}
    axes: dict[str, int] = {}
    extents: dict[str, list[list[tuple[int, int]]]] = {}
    for r, (inf, spl, _) in enumerate(preps):
        for key, d in inf.items():
            if infos.setdefault(key, d) != d:
                errors.setdefault(r, []).append(f"ShardedTensor {key!r} is {d}, another rank has {infos[key]}")
        for key, (axis, ex) in spl.items():
            if axes.setdefault(key, axis) != axis:
                errors.setdefault(r, []).append(f"ShardedTensor {key!r} split along axis {axis}, another rank "
                                                f"along axis {axes[key]}")
            else:
                extents.setdefault(key, []).append([tuple(x) for x in ex])
    out = {}
    for key, d in infos.items():
        info = KeyInfo.from_json(d)
        if key in extents:
            axis = axes[key]
            k, info.cuts = _slabs(info.shape[info.prepend + axis], extents[key])
            info.split = (axis, k)
        out[key] = info
    return out, errors


def _pieces(e: _Entry, info: KeyInfo) -> list[tuple[str, tuple, tuple, tuple, int, int, int]]:
    """The fqn pieces of a box: ``(fqn, piece global shape, offsets, lengths, axis, lo, hi)`` where
    ``[lo, hi)`` along ``axis`` (-1: whole) is the part of the local box the piece takes.
    Raises ValueError when the split does not divide the axis."""
    if info.split is None:
        return [(e.base, e.shape, e.offsets, e.lengths, -1, 0, 0)]
    d, k = info.split
    if info.cuts is None and e.shape[d] % k:
        raise ValueError(f"ShardedTensor {e.sh.key!r}: axis {d} of size {e.shape[d]} does not split into {k} equal slabs")
    b = info.bounds()
    out = []
    o, n = e.offsets[d], e.lengths[d]
    for i in range(k):  # an empty box has no piece: it holds nothing
        lo, hi = max(o, b[i]), min(o + n, b[i + 1])
        if hi <= lo:
            continue
        shape = e.shape[:d] + (b[i + 1] - b[i],) + e.shape[d + 1:]
        offs = e.offsets[:d] + (lo - b[i],) + e.offsets[d + 1:]
        lens = e.lengths[:d] + (hi - lo,) + e.lengths[d + 1:]
        out.append((f"{e.base}#{i}/{k}", shape, offs, lens, d, lo - o, hi - o))
    return out


def _copy_flat(dst: torch.Tensor, box: torch.Tensor, start: int, stop: int) -> None:
    """``dst`` (contiguous) = the elements ``[start, stop)`` of ``box`` in row-major order."""
    dst.view(-1).copy_(box.view(-1)[start:stop])


def _noncontiguous(e: _Entry, shape: tuple, offs: tuple, lens: tuple) -> str:
    assert e.flat is not None  # called for flattened boxes only
    return (f"ShardedTensor {e.sh.key!r}: flattened_range [{e.flat[0]}, {e.flat[1]}) of the local box offsets "
            f"{list(offs)} lengths {list(lens)} is not one contiguous range of the global tensor {list(shape)}; "
            "unickpt stores one box or one flat range per rank and fqn (use the distributed optimizer's "
            "'dp_reshardable' or 'fully_reshardable' sharding type)")


def _shard(e: _Entry, data: torch.Tensor, piece: tuple, replica: int) -> Shard:
    fqn, shape, offs, lens, d, lo, hi = piece
    if e.flat is not None:
        rng = global_flat_range(shape, offs, lens, *e.flat)
        if rng is None:
            raise ValueError(_noncontiguous(e, shape, offs, lens))
        return Shard(data.reshape(-1), shape, flat_range=rng, replica_id=replica)
    view = data if d < 0 else data.narrow(d, lo, hi - lo)
    return Shard(view, shape, offsets=offs, replica_id=replica)


def build_save_state(prep: SavePrep, infos: dict[str, KeyInfo]) -> tuple[dict, list[str]]:
    """The unickpt state of one rank from its :class:`SavePrep` and the agreed key infos; ``errors``."""
    state: dict = dict(prep.objects)
    errors: list[str] = []
    for e in prep.entries:
        try:
            for piece in _pieces(e, infos[e.sh.key]):
                if piece[0] in state:
                    continue  # the same box twice on this rank (identical shards): stored once
                state[piece[0]] = _shard(e, e.sh.data, piece, 0 if is_main_replica(e.sh.replica_id) else 1)
        except ValueError as err:
            errors.append(str(err))
    return state, errors


@dataclass
class LoadTarget:
    """One rank's load request.

    ``rounds``: unickpt states loaded one after the other (a rank needing several pieces of one fqn
    takes them in successive rounds); ``objects``: ShardedObject unique key -> ShardedObject;
    ``after``: copies to run after the load (flattened slices of boxes read whole, repeated keys);
    ``errors``: mismatches with the checkpoint, one line each.
    """

    rounds: list[dict] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    after: list[Callable[[], None]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def to_load_targets(sharded_state_dict: Any, infos: dict[str, KeyInfo], object_sizes: dict[str, int]) -> LoadTarget:
    """Build the unickpt states that load ``sharded_state_dict`` in place from a checkpoint whose keys
    are described by ``infos`` (see :func:`agree_layout`). ShardedTensors without data get a CPU
    tensor. Requested objects missing from ``object_sizes`` are left out (the caller's policy)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out = LoadTarget()

    def put(fqn: str, leaf: Any) -> None:
        for r in out.rounds:
            if fqn not in r:
                r[fqn] = leaf
                return
        out.rounds.append({fqn: leaf})

    for sh in _values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            if sh.data is None:
                sh.init_data("cpu")
            info = infos.get(sh.key)
            want = (tuple(int(n) for n in sh.global_shape), ext.Codec.dtype_to_str(sh.data.dtype), sh.prepend_axis_num)
            if info is None:
                out.errors.append(f"ShardedTensor {sh.key!r} is not in the checkpoint")
                continue
            if (info.shape, info.dtype) == want[:2] and info.prepend > want[2] and getattr(sh, "flattened_range", None) is None:
                # fewer prepended axes than saved (load_plain_tensors asks for whole stacked tensors):
                # one request per stored layer the box spans
                try:
                    for e, view in _unstack(sh, info):
                        for piece in _pieces(e, info):
                            put(piece[0], _shard(e, view, piece, 0))
                except ValueError as err:
                    out.errors.append(str(err))
                continue
            if (info.shape, info.dtype) == want[:2] and info.prepend < want[2] and getattr(sh, "flattened_range", None) is None:
                # more prepended axes than saved (megatron-core's test_partition_change_save_load): the same
                # global tensor, whose stored fqn holds the request's leading axes as plain axes
                try:
                    e = _stacked(sh, info)
                    for piece in _pieces(e, info):
                        put(piece[0], _shard(e, sh.data.view(e.lengths), piece, 0))
                except ValueError as err:
                    out.errors.append(str(err))
                continue
            if _padded_overlap(sh, info, want):
                # allow_shape_mismatch (padded vocabularies): megatron's torch_dist rule, zeros + the overlap
                e = _entry(sh)
                lens = tuple(max(0, min(o + n, g) - o) for o, n, g in zip(e.offsets, e.lengths, info.shape[info.prepend:]))
                sh.data.zero_()
                if all(lens):
                    put(e.base, Shard(sh.data[tuple(slice(0, n) for n in lens)], info.shape[info.prepend:], offsets=e.offsets))
                continue
            if (info.shape, info.dtype, info.prepend) != want:
                out.errors.append(f"ShardedTensor {sh.key!r}: checkpoint has shape {list(info.shape)} dtype {info.dtype} "
                                  f"prepended axes {info.prepend}, the state has shape {list(want[0])} dtype {want[1]} "
                                  f"prepended axes {want[2]}")
                continue
            e = _entry(sh)
            data = sh.data
            try:
                pieces = _pieces(e, info)
                if e.flat is not None and (len(pieces) != 1 or global_flat_range(*pieces[0][1:4], *e.flat) is None):
                    box = torch.empty(e.lengths, dtype=sh.data.dtype)  # read the whole box, copy the slice out
                    out.after.append(functools.partial(_copy_flat, sh.data, box, *e.flat))
                    e = _Entry(sh, e.base, e.shape, e.offsets, e.lengths, None)
                    data = box
                for piece in pieces:
                    put(piece[0], _shard(e, data, piece, 0))
            except ValueError as err:
                out.errors.append(str(err))
        elif isinstance(sh, ShardedObject):
            out.objects[sh.unique_key] = sh
            n = object_sizes.get(sh.unique_key)
            if n is not None:
                put(OBJECT_PREFIX + sh.unique_key, torch.empty(n, dtype=torch.uint8))
    return out


def _padded_overlap(sh: Any, info: KeyInfo, want: tuple) -> bool:
    """Whether a request is loaded by megatron's ``allow_shape_mismatch`` rule: the ShardedTensor allows
    it, only the global extents of its own (not prepended) axes differ, same dtype and rank, and the key
    is neither stored as slabs nor requested as a flattened range (those keep the strict check)."""
    shape, dtype, prepend = want
    return (bool(getattr(sh, "allow_shape_mismatch", False)) and info.shape != shape and (info.dtype, info.prepend) ==
            (dtype, prepend) and len(info.shape) == len(shape) and info.shape[:prepend] == shape[:prepend]
            and info.split is None and getattr(sh, "flattened_range", None) is None)


def _unstack(sh: Any, info: KeyInfo) -> list[tuple[_Entry, torch.Tensor]]:
    """The boxes of a ShardedTensor request with fewer prepended axes than ``info`` (same global shape):
    one per index of the axes ``sh.prepend_axis_num .. info.prepend - 1`` its local box spans, named
    like the stored per-layer fqns, each with its view of ``sh.data``."""
    p, k = sh.prepend_axis_num, info.prepend - sh.prepend_axis_num
    offs = tuple(int(o) for o in sh.global_offset)
    local = tuple(int(n) for n in sh.local_shape)
    data = sh.data.view(local)
    out: list[tuple[_Entry, torch.Tensor]] = []
    for idx in itertools.product(*(range(n) for n in local[:k])):
        gidx = offs[:p] + tuple(o + i for o, i in zip(offs[p:info.prepend], idx))
        out.append((_Entry(sh, base_fqn(sh.key, gidx, info.prepend), tuple(info.shape[info.prepend:]),
                           offs[info.prepend:], local[k:], None), data[idx]))
    return out


def _stacked(sh: Any, info: KeyInfo) -> _Entry:
    """The box of a ShardedTensor request with more prepended axes than ``info`` (same global shape), in
    the coordinates of the stored fqn: its axes ``info.prepend .. sh.prepend_axis_num - 1`` become plain
    axes of length 1 at the request's global offsets (megatron's torch_dist stores one global tensor, so
    the number of prepended axes only says how the local tensor maps into it)."""
    offs, q = tuple(int(o) for o in sh.global_offset), info.prepend
    lengths = (1,) * (sh.prepend_axis_num - q) + tuple(int(n) for n in sh.local_shape)
    return _Entry(sh, base_fqn(sh.key, offs, q), tuple(info.shape[q:]), offs[q:], lengths, None)


def stored_object_sizes(tensor_meta: dict) -> dict[str, int]:
    """unique key -> byte length of every ShardedObject in a checkpoint's ``tensors`` metadata."""
    return {fqn[len(OBJECT_PREFIX):]: math.prod(tm.shape) for fqn, tm in tensor_meta.items()
            if fqn.startswith(OBJECT_PREFIX)}
