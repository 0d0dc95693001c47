"""The last step of a load into a module (unickpt.state.writeback): torch's set_model_state_dict is
skipped only when it would copy every tensor onto itself; a module with its own load path, hooks,
or a state dict of copies gets torch's call, every hook included. (FSDP2 on a real process group:
tests/distributed/test_dist_semantics.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.state_dict as dsd
from torch import nn

import unickpt
from unickpt.state import writeback


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))


def _trained(model: nn.Module):
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(8)).pow(2).mean().backward()
    optim.step()
    return optim


@pytest.fixture
def torch_calls(monkeypatch):
    """Counts torch's set_model_state_dict calls (and still runs it)."""
    calls = []
    real = dsd.set_model_state_dict

    def counting(model, sd, **kw):
        calls.append(model)
        return real(model, sd, **kw)

    monkeypatch.setattr(dsd, "set_model_state_dict", counting)
    return calls


def test_a_plain_model_loads_bitwise_without_copying_onto_itself(tmp_path, torch_calls):
    model = _model()
    optim = _trained(model)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_optim = {k: {n: t.clone() for n, t in s.items()} for k, s in optim.state_dict()["state"].items()}
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim})
    fresh = _model(seed=1)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    versions = {k: p._version for k, p in fresh.named_parameters()}
    unickpt.load(tmp_path / "c", {"model": fresh, "optim": fresh_optim})
    assert torch_calls == []  # the load wrote the parameters themselves
    got = fresh.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    got_optim = fresh_optim.state_dict()["state"]
    assert all(torch.equal(got_optim[k][n], want_optim[k][n]) for k in want_optim for n in want_optim[k])
    # as torch's copy_ would: every parameter's version counter moved
    assert all(p._version > versions[k] for k, p in fresh.named_parameters())


def test_a_graph_that_saved_a_parameter_fails_after_the_load_as_with_torch(tmp_path):
    model = _model()
    unickpt.save(tmp_path / "c", {"model": model})
    fresh = _model(seed=1)
    out = fresh[1](torch.randn(3, 4, requires_grad=True)).sum()  # Linear saved its weight for backward
    unickpt.load(tmp_path / "c", {"model": fresh})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


class _OwnLoad(nn.Linear):
    """A module with its own _load_from_state_dict (as BatchNorm, quantized and many user modules)."""

    seen: list = []

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _OwnLoad.seen.append(prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def test_a_module_with_its_own_load_path_or_hooks_gets_torchs_call(tmp_path, torch_calls):
    torch.manual_seed(0)
    model = nn.Sequential(_OwnLoad(4, 4), nn.Linear(4, 2))
    unickpt.save(tmp_path / "c", {"model": model})
    _OwnLoad.seen.clear()
    fresh = nn.Sequential(_OwnLoad(4, 4), nn.Linear(4, 2))
    unickpt.load(tmp_path / "c", {"model": fresh})
    assert torch_calls == [fresh] and _OwnLoad.seen == ["0."]
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))

    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))  # torch's own override (num_batches_tracked)
    unickpt.save(tmp_path / "bn", {"model": bn})
    unickpt.load(tmp_path / "bn", {"model": nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))})
    assert len(torch_calls) == 2

    plain = _model(seed=2)
    hooked = []
    plain[3].register_load_state_dict_post_hook(lambda module, keys: hooked.append(module))
    unickpt.save(tmp_path / "p", {"model": _model()})
    unickpt.load(tmp_path / "p", {"model": plain})
    assert len(torch_calls) == 3 and hooked == [plain[3]]  # the user's hook ran
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), _model().state_dict().values()))


def test_writes_back_whenever_skipping_cannot_be_shown(monkeypatch):
    model = _model()
    assert writeback.writes_back(model, model.state_dict()) is False
    copies = {k: v.clone() for k, v in model.state_dict().items()}  # CPU offload, a full state dict
    assert writeback.writes_back(model, copies) is True
    transposed = dict(model.state_dict(), **{"1.weight": model[1].weight.detach().t()})  # same memory, other view
    assert writeback.writes_back(model, transposed) is True
    assert writeback.writes_back(model, dict(model.state_dict(), extra=3)) is True  # not a tensor
    model[2].load_state_dict = lambda *a, **k: None  # an instance override
    assert writeback.writes_back(model, model.state_dict()) is True
    del model[2].load_state_dict
    model[0].register_load_state_dict_pre_hook(lambda *a: None)
    assert writeback.writes_back(model, model.state_dict()) is True
    other = _model()
    monkeypatch.setattr(nn.Module, "_load_from_state_dict", lambda *a, **k: None)  # torch patched
    assert writeback.writes_back(other, other.state_dict()) is True


class _Tracked(torch.Tensor):
    """A ``__torch_function__`` subclass that acts on ``copy_`` (re-quantizing, invalidating a cache)."""

    copies: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            cls.copies.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_what_torchs_copy_would_act_on_or_refuse_gets_torchs_call(tmp_path, torch_calls, monkeypatch):
    unickpt.save(tmp_path / "c", {"model": nn.Linear(4, 2)})
    with torch.inference_mode():  # an inference tensor written outside inference mode: torch raises
        frozen = nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        unickpt.load(tmp_path / "c", {"model": frozen})

    tracked = nn.Linear(4, 2)
    tracked.weight = nn.Parameter(tracked.weight.detach().as_subclass(_Tracked))
    _Tracked.copies.clear()
    unickpt.load(tmp_path / "c", {"model": tracked})
    assert _Tracked.copies == ["copy_"]  # the subclass saw torch's copy_

    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
    plain = nn.Linear(4, 2)
    assert writeback.writes_back(plain, plain.state_dict()) is True
    assert torch_calls == [frozen, tracked]
