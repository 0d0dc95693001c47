"""The state-dict cache of saves (unickpt.state.sd_cache): a hit returns what torch's get_state_dict
returns at that moment, anything its fingerprint covers misses, and what it cannot see is never cached.
(FSDP2 on a real process group: tests/distributed/test_dist_semantics.py.)"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

import unickpt
from unickpt.state import sd_cache


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return model, optim, sched


def _same(got: tuple, want: tuple) -> None:
    """Equal to torch's result: the same fqns, tensors on the same storage with the same shape, the
    optimizer's own per-parameter state dicts, equal param groups."""
    (gm, go), (wm, wo) = got, want
    assert list(gm) == list(wm)
    for k in wm:
        assert gm[k].data_ptr() == wm[k].data_ptr() and gm[k].shape == wm[k].shape and torch.equal(gm[k], wm[k]), k
    if wo is None:
        assert go is None
        return
    assert list(go["state"]) == list(wo["state"])
    assert all(go["state"][k] is wo["state"][k] for k in wo["state"])  # the live dicts, as torch gives
    assert go["param_groups"] == wo["param_groups"]
    assert [list(g) for g in go["param_groups"]] == [list(g) for g in wo["param_groups"]]  # key order too


def test_a_second_save_reuses_the_state_dicts_and_reads_the_param_groups_anew():
    model, optim, sched = _trained()
    sd_cache.clear()
    _same(sd_cache.state_dicts(model, optim), get_state_dict(model, optim))
    assert sd_cache.cache_info() == {"hits": 0, "misses": 1, "uncacheable": 0}
    sched.step()  # a new learning rate: read from the live groups on a hit
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optim.step()  # moments and steps change in place; BatchNorm's running stats too
    got = sd_cache.state_dicts(model, optim)
    assert sd_cache.cache_info()["hits"] == 1
    _same(got, get_state_dict(model, optim))
    assert got[1]["param_groups"][0]["lr"] == optim.param_groups[0]["lr"] == 1e-2 / 8
    # the outer dicts are the caller's own: changing them leaves the next result alone
    got[0].pop("0.weight")
    got[1]["param_groups"][0]["lr"] = 99.0
    _same(sd_cache.state_dicts(model, optim), get_state_dict(model, optim))
    # a model saved without an optimizer: its own entry
    _same(sd_cache.state_dicts(model, None), (get_model_state_dict(model), None))
    _same(sd_cache.state_dicts(model, None), (get_model_state_dict(model), None))
    assert sd_cache.cache_info() == {"hits": 3, "misses": 2, "uncacheable": 0}


def test_every_change_the_fingerprint_covers_misses():
    def add_group(m, o):  # the last layer's parameters, left out of the optimizer below, join it
        o.add_param_group({"params": list(m[2].parameters())})

    changes = {
        "new storage under a parameter": lambda m, o: setattr(m[0].weight, "data", torch.randn(6, 4)),
        "a buffer replaced": lambda m, o: m[1].register_buffer("running_mean", torch.zeros(6)),
        "a new buffer": lambda m, o: m[1].register_buffer("extra", torch.ones(3)),
        "a module added": lambda m, o: m.append(nn.ReLU()),
        "optimizer state loaded": lambda m, o: o.load_state_dict(o.state_dict()),  # new per-parameter dicts
        "a parameter group added": add_group,
    }
    for name, change in changes.items():
        model, optim, _ = _trained()
        if change is add_group:
            optim = torch.optim.AdamW(list(model[0].parameters()) + list(model[1].parameters()), lr=1e-2)
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optim.step()
        sd_cache.clear()
        sd_cache.state_dicts(model, optim)
        change(model, optim)
        _same(sd_cache.state_dicts(model, optim), get_state_dict(model, optim))
        assert sd_cache.cache_info() == {"hits": 0, "misses": 2, "uncacheable": 0}, name
        _same(sd_cache.state_dicts(model, optim), get_state_dict(model, optim))  # cached again: a hit
        assert sd_cache.cache_info()["hits"] == 1, name
    # a parameter the optimizer steps, replaced in the model: torch refuses, and so does the cached path
    model, optim, _ = _trained()
    sd_cache.clear()
    sd_cache.state_dicts(model, optim)
    model[2].bias = nn.Parameter(torch.zeros(2))
    with pytest.raises(Exception) as torch_error:
        get_state_dict(model, optim)
    with pytest.raises(type(torch_error.value)):
        sd_cache.state_dicts(model, optim)


class _Counted(nn.Linear):
    """A module whose state dict holds a value computed at each call (extra state)."""

    calls = 0

    def get_extra_state(self):
        _Counted.calls += 1
        return {"calls": _Counted.calls}

    def set_extra_state(self, state):
        pass


def test_what_the_fingerprint_cannot_see_is_never_cached():
    model, optim, _ = _trained()
    sd_cache.clear()
    model.register_state_dict_post_hook(lambda module, sd, prefix, local: sd.__setitem__("tag", torch.tensor(1)))
    first, _ = sd_cache.state_dicts(model, optim)
    assert "tag" in first and sd_cache.cache_info() == {"hits": 0, "misses": 0, "uncacheable": 1}
    counted = nn.Sequential(_Counted(2, 2))
    a, b = sd_cache.state_dicts(counted, None)[0], sd_cache.state_dicts(counted, None)[0]
    assert a["0._extra_state"] == {"calls": 1} and b["0._extra_state"] == {"calls": 2}  # computed at each save
    fresh = nn.Linear(2, 2)
    unstepped = torch.optim.AdamW(fresh.parameters())  # torch would create its state: never cached
    sd_cache.state_dicts(fresh, unstepped)
    assert sd_cache.cache_info() == {"hits": 0, "misses": 0, "uncacheable": 4}


def test_saves_through_the_cache_hold_the_state_at_each_call(tmp_path):
    model, optim, sched = _trained()
    sd_cache.clear()
    ck = unickpt.Checkpointer(tmp_path / "run", async_save=True)
    want = {}
    for step in (1, 2, 3):
        ck.save(step, {"model": model, "optim": optim, "sched": sched})
        ck.wait()
        want[step] = ({k: v.clone() for k, v in model.state_dict().items()}, optim.param_groups[0]["lr"])
        if step == 1:
            model[0].weight.data = torch.full((6, 4), 3.0)  # a new storage: the fingerprint misses
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    ck.close()
    assert sd_cache.cache_info()["hits"] >= 1
    for step in (1, 2, 3):
        m2, o2, s2 = _trained(seed=5)
        unickpt.load(tmp_path / "run" / f"step_{step}", {"model": m2, "optim": o2, "sched": s2})
        weights, lr = want[step]
        assert all(torch.equal(v, m2.state_dict()[k]) for k, v in weights.items()), step
        assert o2.param_groups[0]["lr"] == lr


def test_changes_found_by_the_break_test_miss():
    # a new layout at the same address (a transposed view: Conv1D -> Linear), a renamed child, and
    # state_dict replaced on an instance or on a class after the first save: each was served stale
    def transposed(m, o):
        with torch.no_grad():
            m[0].weight.data = torch.arange(16.0).reshape(4, 4)
        sd_cache.state_dicts(m, o)  # cached with this layout
        m[0].weight.data = m[0].weight.data.t()  # same storage, same shape, other strides

    def renamed(m, o):
        m.add_module("head", m[1])
        del m._modules["1"]

    for name, change in {"transposed": transposed, "renamed": renamed}.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
        sd_cache.clear()
        sd_cache.state_dicts(model, optim)
        change(model, optim)
        _same(sd_cache.state_dicts(model, optim), get_state_dict(model, optim))
        assert sd_cache.cache_info()["hits"] == 0, name
    model, optim, _ = _trained()
    sd_cache.clear()
    sd_cache.state_dicts(model, optim)
    model.state_dict = lambda *a, **k: {"x": torch.ones(1)}  # on the instance
    assert list(sd_cache.state_dicts(model, optim)[0]) == ["x"]
    del model.state_dict
    optim.state_dict = lambda: {"state": {}, "param_groups": []}
    assert sd_cache.cache_info() == {"hits": 0, "misses": 1, "uncacheable": 1}

    class Mine(nn.Linear):
        pass

    mine = Mine(2, 2)
    sd_cache.state_dicts(mine, None)
    Mine.state_dict = lambda self, *a, **k: {"w": torch.full((1,), 9.0)}  # patched after the first save
    assert list(sd_cache.state_dicts(mine, None)[0]) == ["w"]


def test_a_re_created_optimizer_does_not_keep_its_predecessors_alive():
    import gc
    import weakref

    model = nn.Linear(8, 8)
    sd_cache.clear()
    moments = []
    for _ in range(6):
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(2, 8)).sum().backward()
        optim.step()
        sd_cache.state_dicts(model, optim)
        moments.append(weakref.ref(optim.state[model.weight]["exp_avg"]))
        del optim
        gc.collect()
    # the entries of optimizers that are gone go at the model's next save: one left of the last one
    assert len(sd_cache._CACHE[model]) == 1 and sum(r() is not None for r in moments) == 1
