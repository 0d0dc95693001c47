"""Mapping rules and cross-framework loads in one process (docs/cross-framework.md): the geometry of
Rename / Split / Fuse / Permute and their compositions, the generic layout (module, optimizer, LR
scheduler, loss scaler, step), wrapper prefixes, what raises, the export reader's box reads. The
framework pairs themselves run in tests/plugins/cross/, resharding with rules in
tests/distributed/test_mapping_dist.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import unickpt
from unickpt import Fuse, Mapping, Permute, Rename, Split
from unickpt.plan.mapping import Unresolved


def _resolver(stored: dict[str, torch.Tensor], rules: list):
    return Mapping(rules).resolver(lambda n: (tuple(stored[n].shape), "float32") if n in stored else None)


def _materialize(res, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    out = torch.full(res.shape, float("nan"))
    for p in res.pieces:
        region = tuple(slice(o, o + n) for o, n in zip(p.region.offsets, p.region.lengths))
        out[region] = stored[p.source][tuple(slice(o, o + n) for o, n in zip(p.offsets, p.region.lengths))]
    return out


def test_split_fuse_permute_compose_to_pieces_of_the_stored_tensors():
    heads, groups, d = 4, 2, 2
    per = heads // groups
    order = [g * (per + 2) + j for g in range(groups) for j in range(per)] + \
            [g * (per + 2) + per for g in range(groups)] + [g * (per + 2) + per + 1 for g in range(groups)]
    qkv = torch.arange(8 * d * 3, dtype=torch.float32).view(8 * d, 3)
    stored = {"layers.0.qkv": qkv}
    sections = (heads * d, groups * d, groups * d)
    resolve = _resolver(stored, [Split(f"layers.{{i}}.{x}", "~p.{i}", 0, sections, j) for j, x in enumerate("qkv")]
                        + [Permute("~p.{i}", "layers.{i}.qkv", 0, d, tuple(order))])
    w = qkv.view(groups, per + 2, d, 3)
    q = resolve("layers.0.q")
    assert torch.equal(_materialize(q, stored), w[:, :per].reshape(-1, 3))
    assert torch.equal(_materialize(resolve("layers.0.k"), stored), w[:, per].reshape(-1, 3))
    assert torch.equal(_materialize(resolve("layers.0.v"), stored), w[:, per + 1].reshape(-1, 3))
    # the two query heads of a group are adjacent in the stored tensor: one piece per group
    assert [(p.region.offsets, p.region.lengths, p.offsets) for p in q.pieces] == \
        [((0, 0), (4, 3), (0, 0)), ((4, 0), (4, 3), (8, 0))]
    # and back: Fuse, then the inverse permutation, is the stored tensor again
    plain = {n: _materialize(resolve(f"layers.0.{n}"), stored) for n in "qkv"}
    inverse = [0] * len(order)
    for j, o in enumerate(order):
        inverse[o] = j
    back = _resolver(plain, [Permute("qkv", "~f", 0, d, tuple(inverse)), Fuse("~f", ("q", "k", "v"), 0)])("qkv")
    assert torch.equal(_materialize(back, plain), qkv)


def test_split_sections_fuse_along_dim_1_and_an_identity_permutation():
    stored = {"a": torch.arange(12.0).view(3, 4), "b": torch.arange(6.0).view(3, 2) + 100}
    resolve = _resolver(stored, [Split("left", "a", 1, (1, 3), 1), Fuse("ab", ("a", "b"), 1),
                                 Permute("same", "a", 0, 1, (0, 1, 2)), Split("half", "a", 1, 2, 0)])
    assert torch.equal(_materialize(resolve("left"), stored), stored["a"][:, 1:])
    assert torch.equal(_materialize(resolve("ab"), stored), torch.cat([stored["a"], stored["b"]], 1))
    assert torch.equal(_materialize(resolve("half"), stored), stored["a"][:, :2])
    assert len(resolve("same").pieces) == 1  # adjacent blocks in order merge into one piece


@pytest.mark.parametrize("rule,message", [
    (Fuse("t", ("a", "b"), 0), "the sources' shapes [[3, 4], [3, 2]] differ outside dim 0"),
    (Fuse("t", (), 0), "no sources to fuse"),
    (Split("t", "a", 0, (1, 1), 0), "sections [1, 1] do not add up to the 3 elements along dim 0"),
    (Split("t", "a", 1, 3, 0), "4 elements along dim 1 do not split into 3 equal parts"),
    (Permute("t", "a", 0, 1, (0, 0, 1)), "order [0, 0, 1] is not a permutation of the 3 blocks"),
    (Permute("t", "a", 1, 3, (0,)), "the source's shape [3, 4] is not made of blocks of 3 along dim 1"),
])
def test_rules_that_do_not_fit_the_stored_shapes_raise_naming_rule_and_tensor(rule, message):
    stored = {"a": torch.zeros(3, 4), "b": torch.zeros(3, 2)}
    with pytest.raises(ValueError, match="mapping rule .* for 't': " + message.replace("[", r"\[").replace("]", r"\]")):
        _resolver(stored, [rule])("t")


def test_rules_that_loop_and_names_that_resolve_to_nothing():
    resolve = _resolver({"a": torch.zeros(2)}, [Rename("x", "y"), Rename("y", "x")])
    with pytest.raises(ValueError, match=r"mapping rules loop at 'x'"):
        resolve("x")
    with pytest.raises(Unresolved) as e:
        _resolver({"a": torch.zeros(2)}, [Rename("t.{n}", "s.{n}")])("t.w")
    assert e.value.missing == ["s.w"]
    with pytest.raises(ValueError, match=r"names \{j\}, which its target does not bind"):
        _resolver({"a": torch.zeros(2)}, [Rename("t.{n}", "s.{j}")])("t.w")


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda e: 0.9 ** e)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        optim.step()
        sched.step()
        optim.zero_grad()
    return model, optim, sched


def test_auto_mapping_moves_model_optimizer_schedule_and_step_under_other_keys(tmp_path):
    model, optim, sched = _trained()
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim, "sched": sched, "step": 3})
    m2, o2, s2 = _trained(seed=1)
    state = {"net": m2, "opt": o2, "lr": s2, "step": 0}
    stats = unickpt.load(tmp_path / "c", state, mapping="auto")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters()))
    for p, q in zip(model.parameters(), m2.parameters()):
        assert {k: v.tolist() for k, v in optim.state[p].items()} == {k: v.tolist() for k, v in o2.state[q].items()}
    assert s2.state_dict() == sched.state_dict() and o2.param_groups[0]["lr"] == optim.param_groups[0]["lr"]
    assert state["step"] == 3
    assert stats.conversion == {"from": "unickpt.save", "tensors": 16, "values": ["lr", "opt.param_groups", "step"],
                                "left_behind": [], "kept": []}


class _Wrapped(nn.Module):
    """Names its model ``_orig_mod`` (as torch.compile's OptimizedModule does)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._orig_mod = inner


def test_wrapper_components_are_dropped_on_both_sides(tmp_path):
    model, _, _ = _trained()
    unickpt.save(tmp_path / "c", {"model": _Wrapped(model)})
    assert "model._orig_mod.0.weight" in unickpt.ext.CheckpointDir.open(str(tmp_path / "c")).read_metadata().tensors
    plain = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    unickpt.load(tmp_path / "c", {"weights": plain}, mapping="auto")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


class _TwoHalves(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(6, 2)


def test_declared_rules_split_a_stored_tensor_and_a_model_only_target_leaves_the_optimizer_behind(tmp_path):
    model, optim, sched = _trained()
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim, "sched": sched})
    target = _TwoHalves()
    rules = [Split("a.{w}", "0.{w}", 0, 2, 0), Split("b.{w}", "0.{w}", 0, 2, 1), Rename("out.{w}", "1.{w}")]
    stats = unickpt.load(tmp_path / "c", {"model": target}, mapping=Mapping(rules))
    assert torch.equal(target.a.weight, model[0].weight[:3]) and torch.equal(target.b.bias, model[0].bias[3:])
    assert torch.equal(target.out.weight, model[1].weight)
    assert stats.conversion["tensors"] == 6
    with pytest.raises(unickpt.StateMismatchError, match=r"6 tensor\(s\) of the state no stored tensor serves: "
                       r"'model.a.bias' \(param of 'a.bias'; looked for 'a.bias'\)"):
        unickpt.load(tmp_path / "c", {"model": _TwoHalves()}, mapping="auto")
    # a rule naming a source with its wrapper prefix (as DeepSpeed or torch.compile store it) gets a hint
    with pytest.raises(unickpt.StateMismatchError, match=r"'model.out.weight' \(param of 'out.weight'; looked for "
                       r"'_orig_mod.1.weight'; rule sources name stored tensors without wrapper prefixes: "
                       r"'_orig_mod.1.weight' is stored as '1.weight'\)"):
        unickpt.load(tmp_path / "c", {"model": _TwoHalves()},
                     mapping=Mapping(rules[:2] + [Rename("out.{w}", "_orig_mod.1.{w}")]))


def test_what_cannot_move_raises_by_name_and_changes_nothing(tmp_path):
    model, optim, sched = _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim, "sched": sched, "scaler": scaler})
    m2, o2, s2 = _trained(seed=1)
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(unickpt.StateMismatchError, match=r"'scaler': the checkpoint holds an fp16 loss scaler \('_growth_tracker'"
                       r".*the state to load into has none; it cannot move \(strict=False leaves it behind\)"):
        unickpt.load(tmp_path / "c", {"model": m2, "optim": o2, "sched": s2}, mapping="auto")
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))
    with pytest.raises(unickpt.StateMismatchError, match=r"'sched': the checkpoint's scheduler state has keys"):
        unickpt.load(tmp_path / "c", {"model": m2, "optim": o2, "sched": torch.optim.lr_scheduler.StepLR(o2, 2),
                                      "scaler": torch.amp.GradScaler("cpu")}, mapping="auto")
    # with a scaler to take it, everything moves; strict=False leaves a scaler behind
    target = torch.amp.GradScaler("cpu")
    unickpt.load(tmp_path / "c", {"model": m2, "optim": o2, "sched": s2, "scaler": target}, mapping="auto")
    assert target.get_scale() == 1024.0
    unickpt.load(tmp_path / "c", {"model": m2, "optim": o2, "sched": s2}, mapping="auto", strict=False)
    with pytest.raises(TypeError, match="mapping must be None, 'auto' or a unickpt.Mapping"):
        unickpt.load(tmp_path / "c", {"model": m2}, mapping={"a": "b"})


def test_two_models_are_ambiguous(tmp_path):
    model, _, _ = _trained()
    unickpt.save(tmp_path / "c", {"model": model})
    with pytest.raises(unickpt.StateMismatchError, match=r"the state to load into holds 2 models \('a', 'b'\)"):
        unickpt.load(tmp_path / "c", {"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)}, mapping="auto")


def test_export_reader_reads_boxes_and_resolved_pieces(tmp_path):
    from unickpt.interop import StoredParams
    from unickpt.tools.reader import CheckpointReader

    t = torch.arange(60.0).view(6, 10)
    unickpt.save(tmp_path / "c", {"w": t})
    reader = CheckpointReader(str(tmp_path / "c"))
    assert torch.equal(reader.read_box("w", (2, 3), (3, 4)), t[2:5, 3:7])
    params = StoredParams(reader.meta)
    res = params.resolver((Permute("p", "w", 0, 2, (2, 0, 1)),))("p")
    assert torch.equal(reader.read_resolved(res), torch.cat([t[4:6], t[0:4]]))
    assert params.names == ["w"] and params.fqns == ["w"]
