"""Worker functions for test_format_v2_dist.py (run on every rank of a DistPool)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import unickpt
from unickpt.geometry import EvenSplit

SPLIT = {"w": ((10, 6), 0, torch.float32), "c": ((4, 9), 1, torch.float64), "k": ((3, 5), 0, torch.int64),
         "big": ((2100, 1000), 0, torch.float32)}  # big: 2.1 MB parts at 4 ranks, 3 checksum blocks each


def full() -> dict[str, torch.Tensor]:
    """Every global tensor (deterministic)."""
    g = torch.Generator().manual_seed(11)
    out = {name: (torch.randn(shape, generator=g) * 100).to(dtype) for name, (shape, _, dtype) in SPLIT.items()}
    out["rep"] = torch.arange(5, dtype=torch.float16)
    out["step"] = torch.tensor(7.0)
    out["flat"] = torch.randn(3, 7, generator=g).to(torch.bfloat16)
    return out


def _part(t: torch.Tensor, dim: int, parts: int, k: int) -> unickpt.Shard:
    """Part ``k`` of ``t`` split as torch.chunk does (an empty shard past the rows)."""
    lo, hi = EvenSplit(dim, parts).bounds(t.shape, k)
    return unickpt.Shard(t.narrow(dim, lo, hi - lo).clone(), tuple(t.shape),
                         offsets=tuple(lo if d == dim else 0 for d in range(t.dim())))


def state(empty: bool, layout: str = "split") -> dict:
    """This rank's state: ``split`` (each rank its torch.chunk part of every split tensor, as FSDP2
    holds them) or ``uneven`` (rows cut 1 : 2 : 3 ..., so no rank holds its part of a split)."""
    r, n = dist.get_rank(), dist.get_world_size()
    t = {k: (torch.zeros_like(v) if empty else v) for k, v in full().items()}
    out: dict = {}
    for name, (_, dim, _) in SPLIT.items():
        if layout == "split":
            out[name] = _part(t[name], dim, n, r)
        else:
            size = t[name].shape[dim]
            cuts = [size * sum(range(1, i + 1)) // sum(range(1, n + 1)) for i in range(n + 1)]
            out[name] = unickpt.Shard(t[name].narrow(dim, cuts[r], cuts[r + 1] - cuts[r]).clone(), tuple(t[name].shape),
                                      offsets=tuple(cuts[r] if d == dim else 0 for d in range(t[name].dim())))
    flat = t["flat"].reshape(-1)
    cut = [len(flat) * i // n for i in range(n + 1)]
    out["flat"] = unickpt.Shard(flat[cut[r]:cut[r + 1]].clone(), (3, 7), flat_range=(cut[r], cut[r + 1] - cut[r]))
    out["rep"], out["step"], out["note"] = t["rep"], t["step"], (None if empty else "v2")
    return out


def save(path: str) -> dict:
    h = unickpt.save(path, state(empty=False))
    return h.stats.as_dict()


def local(leaf) -> torch.Tensor:
    return leaf.tensor if isinstance(leaf, unickpt.Shard) else leaf


def expected(name: str, leaf, want: torch.Tensor) -> torch.Tensor:
    if not isinstance(leaf, unickpt.Shard):
        return want
    if leaf.spec.__class__.__name__ == "FlatRange":
        return want.reshape(-1)[leaf.spec.start:leaf.spec.start + leaf.spec.length]
    box = tuple(slice(o, o + n) for o, n in zip(leaf.spec.offsets, leaf.spec.lengths))
    return want[box]


def load(path: str, layout: str, redistribute: bool | None) -> dict:
    """Load into ``layout`` on this world; ``ok`` per tensor (bitwise), and the stats."""
    st = state(empty=True, layout=layout)
    stats = unickpt.load(path, st, redistribute=redistribute)
    want = full()
    ok = {}
    for name, leaf in st.items():
        if name == "note":
            ok[name] = leaf == "v2"
            continue
        got, exp = local(leaf), expected(name, leaf, want[name])
        ok[name] = got.dtype == exp.dtype and torch.equal(got.reshape(-1).view(torch.uint8),
                                                           exp.contiguous().reshape(-1).view(torch.uint8))
    return {"ok": ok, **stats.as_dict()}


def load_error(path: str) -> str:
    try:
        unickpt.load(path, state(empty=True), redistribute=True)
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"
