"""Live weight sync's pure parts: the transfer plan (unickpt.plan.transfer) and the message codec
(unickpt.sync.wire)."""
from __future__ import annotations

import math

import pytest
import torch

from unickpt import Mapping, Rename, Split, StateMismatchError
from unickpt.geometry import Box
from unickpt.plan.transfer import (ALIGN, SourceEntry, TargetEntry, needs_from_json, needs_to_json, plan_transfers,
                                   resolve_needs, sources_from_json, sources_to_json)
from unickpt.sync import wire


def _rows(name, shape, k, n, itemsize=2, dtype="bfloat16"):
    step = shape[0] // n
    return SourceEntry(name, dtype, shape, Box((k * step,) + (0,) * (len(shape) - 1), (step,) + shape[1:]), itemsize)


def _lookup(sources):
    found = {e.name: (e.shape, e.dtype) for s in sources for e in s}
    return found.get


def _covers_exactly(plan, r, target_box):
    """The regions a receiver gets cover its box once: volumes add up and no two overlap."""
    regions = [it.region for (s, rr), p in plan.pairs.items() if rr == r for it in p.items]
    assert sum(b.numel for b in regions) == target_box.numel
    for i, a in enumerate(regions):
        for b in regions[i + 1:]:
            lo = [max(x, y) for x, y in zip(a.offsets, b.offsets)]
            hi = [min(x + m, y + n) for x, m, y, n in zip(a.offsets, a.lengths, b.offsets, b.lengths)]
            assert any(h <= l for l, h in zip(lo, hi)), (a, b)


def test_row_shards_to_column_shards_each_byte_once_straight_from_its_holder():
    """FSDP2-style Shard(0) over 4 trainers -> Shard(1) over 2 receivers: each receiver gets every element
    of its box exactly once, from the trainer that holds it; messages are 64-byte aligned, back to back."""
    shape = (8, 6)
    sources = [[_rows("w", shape, k, 4)] for k in range(4)]
    targets = [[TargetEntry("w", "bfloat16", shape, Box((0, 3 * r), (8, 3)))] for r in range(2)]
    needs = [resolve_needs(t, _lookup(sources)) for t in targets]
    plan = plan_transfers(sources, needs)
    assert sorted(plan.pairs) == [(s, r) for s in range(4) for r in range(2)]
    for r in range(2):
        _covers_exactly(plan, r, targets[r][0].box)
    for (s, r), p in plan.pairs.items():
        (it,) = p.items
        assert it.at == Box((2 * s, 3 * r), (2, 3)) and it.region == it.at and it.nbytes == 2 * 3 * 2
        assert it.offset % ALIGN == 0 and p.nbytes == ALIGN and p.word == 2
    assert plan.sent_bytes == [2 * ALIGN] * 4


def test_replicas_are_sent_once_by_the_least_loaded_holder():
    """DDP: 4 trainers hold every tensor whole; one receiver needs all of them. Each tensor is sent once,
    and the bytes are spread over the 4 holders (largest first), not piled on rank 0."""
    sizes = [1000, 900, 800, 700, 600, 500, 400, 300]
    entries = [SourceEntry(f"t{i}", "float32", (n,), Box((0,), (n,)), 4) for i, n in enumerate(sizes)]
    sources = [entries] * 4
    targets = [TargetEntry(e.name, "float32", e.shape, e.box) for e in entries]
    plan = plan_transfers(sources, [resolve_needs(targets, _lookup(sources))])
    sent = sorted(it.target for p in plan.pairs.values() for it in p.items)
    assert sent == list(range(len(sizes)))  # every tensor exactly once
    loads = [sum(it.nbytes for p in plan.pairs.values() if p.sender == s for it in p.items) for s in range(4)]
    assert loads == [4 * (1000 + 300), 4 * (900 + 400), 4 * (800 + 500), 4 * (700 + 600)]


def test_mapping_rules_are_applied_piece_by_piece():
    """A fused [gate; up] published on 2 ranks (each holding [gate_r; up_r] as two boxes) is read as
    gate and up by a receiver: each rank sends its own halves, no more."""
    f, h = 4, 3
    sources = [[SourceEntry("fc1", "float32", (2 * f, h), Box((k * f // 2, 0), (f // 2, h)), 4),
                SourceEntry("fc1", "float32", (2 * f, h), Box((f + k * f // 2, 0), (f // 2, h)), 4)] for k in range(2)]
    rules = Mapping([Split("up", "fc1", 0, 2, 1), Split("gate", "fc1", 0, 2, 0), Rename("other", "x")])
    targets = [TargetEntry("gate", "float32", (f, h), Box((0, 0), (f, h))),
               TargetEntry("up", "float32", (f, h), Box((0, 0), (f, h)))]
    needs = resolve_needs(targets, _lookup(sources), rules)
    assert [(n.target, n.source, n.at) for n in needs] == [(0, "fc1", Box((0, 0), (f, h))), (1, "fc1", Box((f, 0), (f, h)))]
    plan = plan_transfers(sources, [needs])
    got = {(s, it.target, it.region.offsets, it.at.offsets) for (s, _), p in plan.pairs.items() for it in p.items}
    assert got == {(0, 0, (0, 0), (0, 0)), (1, 0, (2, 0), (2, 0)), (0, 1, (0, 0), (4, 0)), (1, 1, (2, 0), (6, 0))}


def test_errors_name_the_tensor_and_the_values():
    sources = [[_rows("w", (8, 4), 0, 2)]]  # only the first half of the rows is held
    with pytest.raises(StateMismatchError, match=r"'w': no training rank holds all of elements"):
        plan_transfers(sources, [resolve_needs([TargetEntry("w", "bfloat16", (8, 4), Box((0, 0), (8, 4)))], _lookup(sources))])
    with pytest.raises(StateMismatchError, match=r"'w': the target's dtype is float32, the trainer publishes bfloat16"):
        resolve_needs([TargetEntry("w", "float32", (8, 4), Box((0, 0), (8, 4)))], _lookup(sources))
    with pytest.raises(StateMismatchError, match=r"'w': the target's shape is \[4, 8\], the published tensors give \[8, 4\]"):
        resolve_needs([TargetEntry("w", "bfloat16", (4, 8), Box((0, 0), (4, 8)))], _lookup(sources))
    with pytest.raises(StateMismatchError, match=r"'v': no published tensor serves this target \(looked for \['v'\]\)"):
        resolve_needs([TargetEntry("v", "bfloat16", (8, 4), Box((0, 0), (8, 4)))], _lookup(sources))
    overlapping = [[SourceEntry("w", "bfloat16", (8, 4), Box((0, 0), (5, 4)), 2)],
                   [SourceEntry("w", "bfloat16", (8, 4), Box((4, 0), (4, 4)), 2)]]
    with pytest.raises(StateMismatchError, match=r"'w': training ranks hold overlapping boxes"):
        plan_transfers(overlapping, [[]])


def test_layout_documents_round_trip_as_json():
    entries = [_rows("a.b", (6, 2), 1, 3), SourceEntry("s", "int64", (), Box((), ()), 8)]
    assert sources_from_json(sources_to_json(entries, {"tied": "a.b"})) == (entries, {"tied": "a.b"})
    needs = resolve_needs([TargetEntry("a.b", "bfloat16", (6, 2), Box((1, 0), (4, 2)))], _lookup([entries]))
    assert needs_from_json(needs_to_json(needs)) == (needs, None)
    assert needs_from_json(needs_to_json(None, "'x': bad")) == ([], "'x': bad")


@pytest.mark.parametrize("word,dtype", [(2, torch.bfloat16), (4, torch.float32), (1, torch.uint8), (8, torch.float64)])
def test_delta_round_trip_is_bitwise_and_small(word, dtype):
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, 256, (64 * 1000,), dtype=torch.uint8, generator=g)
    cur = prev.clone()
    words = cur.view(wire.WORD_DTYPES[word])
    idx = torch.randperm(words.numel(), generator=g)[: words.numel() // 50]
    words[idx] ^= 1  # 2 % of the words change
    payload, changed_idx, n = wire.encode_delta(cur, prev, word)
    assert n == idx.numel() and torch.equal(changed_idx, idx.sort().values)
    assert payload.numel() == n * (4 + word) <= math.ceil(0.02 * words.numel()) * (4 + word)
    rebuilt = prev.clone()
    got_idx, values = wire.decode_delta(payload, n, word, words.numel())
    rebuilt.view(wire.WORD_DTYPES[word])[got_idx] = values
    assert torch.equal(rebuilt, cur)
    everything = prev ^ 0xFF  # every word changed: a delta would not be under half -> None (send in full)
    assert wire.encode_delta(everything, prev, word) is None
    with pytest.raises(ValueError, match=r"delta payload of 3 bytes for 1 changed"):
        wire.decode_delta(payload[:3], 1, word, words.numel())


def test_a_tied_name_is_served_by_its_tensor_and_travels_once():
    """The trainer ties 'head' to 'emb' (published once, 'head' as an alias); an inference model with both
    as separate tensors gets the bytes once in the message and copies them into both targets. A model that
    ties two names the trainer publishes separately is refused, naming both."""
    emb = SourceEntry("emb", "float32", (4, 4), Box((0, 0), (4, 4)), 4)
    targets = [TargetEntry("emb", "float32", (4, 4), Box((0, 0), (4, 4))),
               TargetEntry("head", "float32", (4, 4), Box((0, 0), (4, 4)))]
    needs = resolve_needs(targets, _lookup([[emb]]), published_aliases={"head": "emb"})
    assert [(n.target, n.source) for n in needs] == [(0, "emb"), (1, "emb")]
    plan = plan_transfers([[emb]], [needs])
    (pair,) = plan.pairs.values()
    assert [(it.target, it.offset) for it in pair.items] == [(0, 0), (1, 0)] and pair.nbytes == 64
    head = SourceEntry("head", "float32", (4, 4), Box((0, 0), (4, 4)), 4)
    with pytest.raises(StateMismatchError, match=r"'head' is tied to 'emb' in the inference model, but the trainer publishes"):
        resolve_needs(targets[:1], _lookup([[emb, head]]), own_aliases={"head": "emb"})


@pytest.mark.parametrize("layout", ["contiguous", "column-block", "fp32-in-bf16-words", "transposed"])
def test_changed_words_compares_live_tensors_with_the_last_version(layout):
    """The delta's compare without packing: a live tensor (contiguous, or a strided column block) against
    the buffer holding its last version; the indices are row-major words, the values the new words, and
    nothing is returned once more than ``limit`` words differ."""
    g = torch.Generator().manual_seed(1)
    full = torch.randn(64, 48, generator=g)
    src = {"contiguous": full.bfloat16(), "column-block": full.bfloat16()[:, 8:24],
           "fp32-in-bf16-words": full[:, 8:24], "transposed": full.t()[:3]}[layout]
    if layout == "transposed":  # fp32 rows of a transposed view: the last dim has no unit stride
        assert src.stride(-1) != 1
    prev = src.contiguous().view(-1).view(torch.uint8).clone()
    flat = src.contiguous().view(torch.int16)  # the words (an fp32 tensor: two per value)
    rows = torch.randperm(src.shape[0], generator=g)[:5]
    before = flat.clone()
    flat[rows, 3] ^= 1  # one word in each of (up to) five rows changes
    src.copy_(flat.view(src.dtype))
    got = wire.changed_words(src, prev, 2, limit=100)
    assert got is not None
    idx, values = got
    expect = (before != flat).contiguous().view(-1).nonzero().flatten()
    assert idx.tolist() == expect.tolist() and len(idx) == len(rows)
    assert values.tolist() == flat.contiguous().view(-1)[expect].tolist()
    assert wire.changed_words(src, prev, 2, limit=len(rows) - 1) is None


def test_changed_words_on_a_scalar_and_the_sampled_estimate():
    """A 0-d fp32 tensor in a message of 2-byte words, and the 1/64 estimate that sends a mostly-changed
    version whole without a full compare."""
    x = torch.tensor(1.5)
    prev = x.reshape(1).view(torch.uint8).clone()
    assert wire.changed_words(x, prev, 2, limit=10)[0].tolist() == []
    x.fill_(-2.0)
    idx, _ = wire.changed_words(x, prev, 2, limit=10)
    assert len(idx) >= 1
    big = torch.randn(1024, 16).bfloat16()
    base = big.view(-1).view(torch.uint8).clone()
    assert wire.sampled_changes(big, base, 2) == 0
    big.add_(1.0)
    assert wire.sampled_changes(big, base, 2) > 0.9 * big.numel()
