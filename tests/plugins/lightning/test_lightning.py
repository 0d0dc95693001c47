"""unickpt.lightning: the CheckpointIO (exact checkpoint dicts, versions, links, removal, pickle policy,
async snapshots, S3), zero-code activation, Fabric, and real multi-process Trainer runs on CPU/gloo
(DDP resume identical to an uninterrupted run; ModelParallel/FSDP2 saved on 2 devices and resumed on 1
and 3; FSDP1 sharded). Trainer runs execute tests/plugins/lightning/lightning_train.py in subprocesses (Lightning's DDP
launcher re-executes the script per device)."""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

pytest.importorskip("lightning")

from lightning.pytorch import LightningModule  # noqa: E402

import unickpt  # noqa: E402
from unickpt.lightning import UnickptCheckpointIO  # noqa: E402
from unickpt.lightning import _activate, _pack  # noqa: E402
from unickpt.testing.dist import _free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "lightning_train.py"
Pair = collections.namedtuple("Pair", "a b")


# -- helpers ------------------------------------------------------------------------------------------
def assert_same(a, b, where="checkpoint"):
    """Recursive exact equality: types, key order, bitwise tensors (dtype, shape, requires_grad, class)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        assert a.requires_grad == b.requires_grad, f"{where}: requires_grad"
        assert torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{where}: _metadata"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def lightning_like_checkpoint() -> dict:
    """What Lightning's dump_checkpoint produces, with the awkward cases in it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    shared = torch.arange(6, dtype=torch.float32)
    return {
        "epoch": 3,
        "global_step": 12,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),  # OrderedDict with _metadata
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4, "completed": 3}}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": {
            "best_model_score": torch.tensor(0.25), "best_model_path": "/ck/epoch=2-step=9.ckpt",
            "best_k_models": {"/ck/epoch=2-step=9.ckpt": torch.tensor(0.25), "/ck/epoch=1-step=6.ckpt": torch.tensor(0.5)},
            "kth_value": torch.tensor(float("inf"))}},
        "optimizer_states": [opt.state_dict()],  # integer keys
        "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 0.1, "layers": (4, 3), "name": "tiny", "dtype": torch.bfloat16, "ids": {1, 2}},
        "extras": {"param": torch.nn.Parameter(torch.ones(2)), "grad": torch.zeros(3).requires_grad_(True),
                   "bf16": torch.randn(3, 2).to(torch.bfloat16), "empty": torch.empty(0, 4),
                   7: "int key", "tied": [shared, shared],
                   "nested": [(1, torch.full((2,), 3.0)), {"k": None}]},
    }


def pack_metadata(path) -> "unickpt.CheckpointMetadata":
    """The unickpt metadata inside the checkpoint file ``path``."""
    with _pack.open_pack(str(path)) as (url, index):
        assert index["files"]["metadata.json"]
        from unickpt.storage import open_storage

        return unickpt.CheckpointMetadata.from_json(open_storage(url).read_bytes(f"{url}/metadata.json"))


# -- the CheckpointIO, in this process ------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [True, False])
def test_checkpoint_dict_round_trips_exactly(tmp_path, async_save):
    io = UnickptCheckpointIO(async_save=async_save)
    ckpt = lightning_like_checkpoint()
    path = tmp_path / "epoch=3-step=12.ckpt"
    io.save_checkpoint(ckpt, path)
    io.teardown()
    out = io.load_checkpoint(path)
    assert_same(ckpt, out)
    assert out["state_dict"]._metadata == ckpt["state_dict"]._metadata and out["state_dict"]._metadata
    assert list(out["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert out["extras"]["tied"][0] is out["extras"]["tied"][1]  # storage sharing kept, stored once
    meta = pack_metadata(path)
    assert meta.framework == "lightning" and meta.step == 12
    assert "tensors.state_dict.0.weight" in meta.tensors and "tensors.optimizer_states.0.state.0.exp_avg" in meta.tensors
    assert os.listdir(tmp_path) == ["epoch=3-step=12.ckpt"] and _pack.kind(str(path)) == "pack"  # one file
    # Lightning's resume path: the model takes the state dict, the optimizer its state
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model.load_state_dict(out["state_dict"])
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.load_state_dict(out["optimizer_states"][0])


class Opaque:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return type(other) is Opaque and other.x == self.x


def test_pickle_follows_lightning_trust_model(tmp_path):
    ckpt = {"global_step": 1, "w": torch.ones(2), "hyper_parameters": {"obj": Opaque(3)},
            "pair": Pair(torch.ones(1), 2)}  # a named tuple holding a tensor: kept, through pickle
    io = UnickptCheckpointIO(async_save=False)
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    cls = f"{Opaque.__module__}.Opaque"
    with pytest.raises(unickpt.UnsafeObjectError) as err:
        io.load_checkpoint(tmp_path / "a.ckpt")  # weights_only=None: torch.load's default (True) semantics
    assert str(err.value) == (  # one line naming the nested key, the class and the Lightning way to allow it
        f"{str(tmp_path / 'a.ckpt')!r}: checkpoint key 'hyper_parameters.obj' holds an object of class {cls} (and 1 "
        "more such value(s)), which only unpickling restores (it can execute code); if you trust this checkpoint "
        "pass weights_only=False (trainer.fit/validate/test(ckpt_path=..., weights_only=False), "
        "load_from_checkpoint(..., weights_only=False)) or use UnickptCheckpointIO(allow_pickle=True)")
    with pytest.raises(unickpt.UnsafeObjectError, match="Opaque"):
        io.load_checkpoint(tmp_path / "a.ckpt", weights_only=True)
    assert_same(ckpt, io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False))
    assert_same(ckpt, UnickptCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "a.ckpt"))
    strict = UnickptCheckpointIO(async_save=False, allow_pickle=False)
    with pytest.raises(unickpt.UnsafeObjectError, match=f"checkpoint key 'hyper_parameters.obj' holds an object of "
                       f"class {cls} \\(and 1 more such value\\(s\\)\\), which only pickle can store"):
        strict.save_checkpoint(ckpt, tmp_path / "b.ckpt")
    assert not (tmp_path / "b.ckpt").exists()


@dataclasses.dataclass
class Cfg:
    width: int


class TiedNet(LightningModule):
    """Tied weights, a buffer and non-JSON hyper-parameters (for load_from_checkpoint)."""

    def __init__(self, lr, ns, cfg, where):
        super().__init__()
        self.save_hyperparameters()
        self.enc = torch.nn.Linear(3, 3)
        self.dec = torch.nn.Linear(3, 3)
        self.dec.weight = self.enc.weight
        self.register_buffer("count", torch.zeros((), dtype=torch.long))


def test_damaged_checkpoint_is_one_clear_error_on_every_reader(tmp_path):
    """A truncated checkpoint file, or a pointer of the earlier layout edited by hand: ValueError
    naming the file (and the field, expected and actual value), from the CheckpointIO and from
    load_from_checkpoint (never a KeyError, nor torch's unpickling error)."""
    import lightning

    io = UnickptCheckpointIO(async_save=False)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, tmp_path / "last.ckpt")
    raw = (tmp_path / "last.ckpt").read_bytes()
    for cut in (len(raw) - 1, 40, 17):
        (tmp_path / "cut.ckpt").write_bytes(raw[:cut])
        for read in (io.load_checkpoint, lightning.pytorch.LightningModule.load_from_checkpoint):
            with pytest.raises(ValueError, match="damaged unickpt checkpoint file"):
                read(tmp_path / "cut.ckpt")
    good = {"format": "unickpt-lightning", "format_version": 1, "checkpoint": "x.ckpt.unickpt/step_1",
            "route": "io", "global_step": 1, "tensors_from": None}
    cases = [("checkpoint", None, "the relative path of a checkpoint version ('<name>/step_<v>')", "missing"),
             ("route", "fsdp", "'io' or 'sharded'", "'fsdp'"),
             ("global_step", "7", "an integer or null", "'7'")]
    for field, value, expected, actual in cases:
        doc = {k: v for k, v in good.items() if not (k == field and value is None)}
        if value is not None:
            doc[field] = value
        bad = tmp_path / f"bad-{field}.ckpt"
        bad.write_text(json.dumps(doc))
        message = (f"{str(bad)!r}: damaged unickpt-lightning pointer: field {field!r} must be {expected}, "
                   f"got {actual}")
        with pytest.raises(ValueError) as err:
            io.load_checkpoint(bad)
        assert str(err.value) == message
        with pytest.raises(ValueError) as err:
            lightning.pytorch.LightningModule.load_from_checkpoint(bad)
        assert str(err.value) == message
    (tmp_path / "last.ckpt").unlink()  # deleted by hand: Lightning's own message
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: "):
        io.load_checkpoint(tmp_path / "last.ckpt")


def test_load_from_checkpoint_reads_a_pointer(tmp_path):
    """``LightningModule.load_from_checkpoint`` (pl_load, i.e. torch.load) is routed to unickpt for a
    pointer: hyper-parameters (a Namespace, a dataclass, a Path), tied weights, buffers; the trust
    model and map_location (Lightning always passes a callable) as torch.load's."""
    import argparse

    hp = {"lr": 0.5, "ns": argparse.Namespace(a=1), "cfg": Cfg(3), "where": Path("/data/x")}
    torch.manual_seed(0)
    model = TiedNet(**hp)
    model.count += 3
    ckpt = {"epoch": 0, "global_step": 4, "pytorch-lightning_version": "2.6.6", "state_dict": model.state_dict(),
            "hparams_name": "kwargs", "hyper_parameters": dict(model.hparams)}
    io = UnickptCheckpointIO(async_save=False)
    io.save_checkpoint(ckpt, tmp_path / "m.ckpt")
    with pytest.raises(unickpt.UnsafeObjectError, match="checkpoint key 'hyper_parameters.ns' holds an object of class "
                       "argparse.Namespace \\(and 2 more such value\\(s\\)\\).*pass weights_only=False"):
        TiedNet.load_from_checkpoint(tmp_path / "m.ckpt")
    back = TiedNet.load_from_checkpoint(tmp_path / "m.ckpt", weights_only=False)
    assert dict(back.hparams) == hp
    assert back.dec.weight is back.enc.weight  # tying is the module's, the values are the checkpoint's
    assert_same(dict(back.state_dict()), dict(model.state_dict()))
    seen = []
    back = TiedNet.load_from_checkpoint(str(tmp_path / "m.ckpt"), weights_only=False,
                                        map_location=lambda storage, loc: seen.append(loc) or storage)
    assert seen and set(seen) == {"cpu"} and int(back.count) == 3


def test_plugin_pickles_its_configuration_only():
    import pickle

    io = UnickptCheckpointIO(async_save=False, allow_pickle=True, storage_options={"anon": True}, dedup_last=False)
    io.save_checkpoint({"global_step": 0}, "memory://lt-pickle/a.ckpt")
    copy = pickle.loads(pickle.dumps(io))  # ddp_spawn sends the strategy, and this plugin, to its workers
    assert (copy.async_save, copy.allow_pickle, copy.storage_options, copy.dedup_last, copy.verify) == \
        (False, True, {"anon": True}, False, True)
    assert copy.last_handle is None and copy._pending == {}


def test_overwrite_replaces_the_file_and_remove(tmp_path):
    io = UnickptCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.zeros(3)}, path)
    io.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, path)  # overwrite, like save_last
    io.wait()
    assert os.listdir(tmp_path) == ["last.ckpt"] and os.path.isfile(path)
    assert_same(io.load_checkpoint(path), {"global_step": 2, "w": torch.ones(3)})
    io.remove_checkpoint(path)
    assert sorted(os.listdir(tmp_path)) == []
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(path)
    # a torch.save checkpoint (a run resumed after turning unickpt on) is read as TorchCheckpointIO does
    torch.save({"w": torch.ones(1), "hp": Opaque(1)}, tmp_path / "plain.ckpt")
    assert_same(io.load_checkpoint(tmp_path / "plain.ckpt", weights_only=False), {"w": torch.ones(1), "hp": Opaque(1)})
    with pytest.raises(Exception, match="Weights only load failed"):
        io.load_checkpoint(tmp_path / "plain.ckpt")  # and with torch.load's trust model
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(ValueError, match="is a directory, not a unickpt or torch.save checkpoint file"):
        io.load_checkpoint(tmp_path / "dir.ckpt")
    (tmp_path / "dir.ckpt").rmdir()
    io.remove_checkpoint(tmp_path / "plain.ckpt")  # a path it did not write: removed like TorchCheckpointIO does
    assert not (tmp_path / "plain.ckpt").exists()


def test_save_last_is_an_independent_copy(tmp_path):
    """``save_last=True`` writes last.ckpt in full, as Lightning does: removing the top-k file (or any
    other) never touches it."""
    io = UnickptCheckpointIO()
    w = torch.randn(64)
    top = {"global_step": 5, "state_dict": {"w": w}, "callbacks": {"last_model_path": ""}}
    last = {"global_step": 5, "state_dict": {"w": w}, "callbacks": {"last_model_path": "last.ckpt"}}
    io.save_checkpoint(top, tmp_path / "epoch=0-step=5.ckpt")
    io.save_checkpoint(last, tmp_path / "last.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0-step=5.ckpt")
    io.wait()
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert_same(io.load_checkpoint(tmp_path / "last.ckpt"), last)


def test_pointer_layout_checkpoints_still_load(tmp_path):
    """A checkpoint of the earlier layout (a JSON pointer ``P`` naming ``P.unickpt/step_<v>``) still
    loads; overwriting it with a new save replaces it by a single file and removes its data folder."""
    from unickpt.dist.comm import THIS_PROCESS
    from unickpt.engine import get_engine
    from unickpt.requests import SaveRequest
    from unickpt.lightning._tree import split

    path = tmp_path / "last.ckpt"
    vdir = str(tmp_path / "last.ckpt.unickpt" / "step_1")
    tree, tensors = split({"global_step": 3, "w": torch.arange(4.0)})  # what the earlier release stored
    get_engine(THIS_PROCESS).save(SaveRequest(vdir, framework="lightning", allow_pickle=True),
                                  {"tensors": tensors, "lightning": tree})
    path.write_text(json.dumps({"format": "unickpt-lightning", "format_version": 1,
                                "checkpoint": "last.ckpt.unickpt/step_1", "route": "io", "global_step": 3,
                                "tensors_from": None}))
    io = UnickptCheckpointIO()
    out = io.load_checkpoint(path)
    assert out["global_step"] == 3 and torch.equal(out["w"], torch.arange(4.0))
    io.save_checkpoint({"global_step": 4, "w": torch.ones(2)}, path)
    io.wait()
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert_same(io.load_checkpoint(path), {"global_step": 4, "w": torch.ones(2)})


def test_async_save_returns_before_the_write_and_snapshots(tmp_path, monkeypatch):
    """Inside a Trainer run the save returns once the tensors are staged; training mutates them while
    the write is held back; the checkpoint still holds the values at save time. Outside a run (a
    script, ``trainer.save_checkpoint`` after ``fit``) the save completes before it returns."""
    import unickpt.storage.registry as storage_base
    from unickpt.lightning import _inflight
    from unickpt.lightning import io as io_module
    from unickpt.testing import Fault, install

    gate = Fault("write", match="*/data/*", nth=None, action="hold", delay_s=60)
    monkeypatch.setattr(storage_base, "_WRAPPERS", list(storage_base._WRAPPERS))  # put back at the end
    install(gate)
    monkeypatch.setattr(io_module, "trainer_running", lambda: True)
    io = UnickptCheckpointIO()
    w = torch.arange(1 << 16, dtype=torch.float32)
    io.save_checkpoint({"global_step": 1, "w": w}, tmp_path / "a.ckpt")
    handle = io.last_handle
    assert not handle.done()  # returned while the data is still unwritten
    w.mul_(-1)  # "training" goes on
    gate.release()
    io.wait()
    assert handle.done() and handle.stats.stall_s < handle.stats.total_s
    out = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(out["w"], torch.arange(1 << 16, dtype=torch.float32))
    monkeypatch.setattr(io_module, "trainer_running", lambda: False)
    io.save_checkpoint({"global_step": 2, "w": w}, tmp_path / "b.ckpt")
    assert io.last_handle.done() and not _inflight._ENGINE  # committed, and the engine's threads given back


def test_s3_remote_root(s3):
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    io = UnickptCheckpointIO(storage_options=s3)
    root = "s3://unickpt/lightning"
    a = {"global_step": 3, "w": torch.randn(1000), "loops": {"x": 1}}
    io.save_checkpoint(a, f"{root}/epoch=0-step=3.ckpt")
    io.save_checkpoint(a, f"{root}/last.ckpt")
    b = {"global_step": 4, "w": torch.randn(1000), "loops": {"x": 2}}
    io.save_checkpoint(b, f"{root}/last.ckpt")
    io.wait()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("unickpt/lightning", refresh=True))
    assert names == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert fs.modified("unickpt/lightning/last.ckpt")  # ckpt_path="last" compares these times
    assert_same(io.load_checkpoint(f"{root}/last.ckpt"), b)
    assert_same(io.load_checkpoint(f"{root}/epoch=0-step=3.ckpt"), a)
    io.remove_checkpoint(f"{root}/epoch=0-step=3.ckpt")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("unickpt/lightning", refresh=True)) == ["last.ckpt"]


# -- activation -------------------------------------------------------------------------------------------
def test_entry_point_factories_follow_the_environment(monkeypatch):
    from importlib.metadata import entry_points

    eps = {g: e.value for g in ("lightning.pytorch.callbacks_factory", "lightning.fabric.callbacks_factory")
           for e in entry_points(group=g) if e.name == "unickpt"}
    assert eps == {"lightning.pytorch.callbacks_factory": "unickpt.lightning._activate:callbacks_factory",
                   "lightning.fabric.callbacks_factory": "unickpt.lightning._activate:fabric_callbacks_factory"}
    monkeypatch.delenv("UNICKPT_LIGHTNING", raising=False)
    assert _activate.callbacks_factory() == [] and _activate.fabric_callbacks_factory() == []
    monkeypatch.setenv("UNICKPT_LIGHTNING", "1")
    assert [type(c).__name__ for c in _activate.callbacks_factory()] == ["UnickptCallback"]
    assert [type(c).__name__ for c in _activate.fabric_callbacks_factory()] == ["UnickptFabricCallback"]


def test_activation_module_is_inert_when_unset():
    code = ("import sys, lightning.pytorch as pl; before = set(sys.modules); "
            "t = pl.Trainer(accelerator='cpu', devices=1, logger=False, enable_checkpointing=False); "
            "print([type(c).__name__ for c in t.callbacks]); "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('unickpt')))")
    env = {k: v for k, v in os.environ.items() if k != "UNICKPT_LIGHTNING"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    callbacks, modules = out.stdout.strip().splitlines()[-2:]
    assert "Unickpt" not in callbacks
    assert "unickpt.lightning.io" not in modules and "unickpt.lightning._callback" not in modules


def test_fabric_plugin_and_env_activation(tmp_path, monkeypatch):
    import lightning as L

    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[UnickptCheckpointIO()])
    model = torch.nn.Linear(3, 2)
    model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": opt, "step": 7})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    remainder = fabric.load(tmp_path / "f.ckpt", {"model": model, "optimizer": opt})
    assert remainder == {"step": 7}
    assert_same(saved, {k: v.clone() for k, v in model.state_dict().items()})
    assert same_leaves(saved_opt, opt.state_dict())
    assert _pack.kind(str(tmp_path / "f.ckpt")) == "pack" and os.listdir(tmp_path) == ["f.ckpt"]
    monkeypatch.setenv("UNICKPT_LIGHTNING", "1")
    fabric2 = L.Fabric(accelerator="cpu", devices=1)
    assert type(fabric2.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"  # until setup
    fabric2.setup(torch.nn.Linear(3, 2))
    assert type(fabric2.strategy.checkpoint_io).__name__ == "UnickptCheckpointIO"


# -- real Trainer runs (subprocesses, gloo) ---------------------------------------------------------------------
def train(tmp_path, name, *args, env=None):
    out = tmp_path / f"{name}.pt"
    run_env = {k: v for k, v in os.environ.items() if k != "UNICKPT_LIGHTNING"}
    run_env.update({"OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port()), "PYTHONWARNINGS": "ignore"})
    run_env.update(env or {})
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), *map(str, args)]
    proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


def same_leaves(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                      for x, y in zip(la, lb))


def pointer(path: Path) -> dict:
    return json.loads(path.read_text())


def test_ddp_resume_is_indistinguishable_from_uninterrupted_training(tmp_path):
    full = train(tmp_path, "full", "--strategy", "ddp", "--devices", 2, "--epochs", 4, "--ckpt-dir", tmp_path / "a")
    # first half: an unmodified script, activated by the environment variable alone
    ck = tmp_path / "ck"
    half = train(tmp_path, "half", "--strategy", "ddp", "--devices", 2, "--epochs", 2, "--ckpt-dir", ck, "--io", "none",
                 env={"UNICKPT_LIGHTNING": "1"})
    assert half["io"] == "UnickptCheckpointIO" and "UnickptCallback" in half["callbacks"]
    assert sorted(os.listdir(ck)) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]  # as Lightning's
    assert all(_pack.kind(str(ck / n)) == "pack" for n in os.listdir(ck))
    rest = train(tmp_path, "rest", "--strategy", "ddp", "--devices", 2, "--epochs", 4, "--ckpt-dir", ck,
                 "--resume", "last")
    assert rest["io"] == "UnickptCheckpointIO"
    assert half["losses"] + rest["losses"] == full["losses"]
    assert rest["global_step"] == full["global_step"] == 12 and rest["seen"] == full["seen"]
    assert same_leaves(rest["model"], full["model"]) and sorted(rest["model"]) == sorted(full["model"])
    assert same_leaves(rest["optim"], full["optim"]) and rest["sched"] == full["sched"]
    # top-k (k=2) removed the first run's checkpoints, data included
    assert rest["best_k"] == ["epoch=2-step=9.ckpt", "epoch=3-step=12.ckpt"]
    assert sorted(os.listdir(ck)) == ["epoch=2-step=9.ckpt", "epoch=3-step=12.ckpt", "last.ckpt"]
    assert full["stall_s"] is not None and rest["stall_s"] < 5


def test_unset_environment_leaves_lightning_unchanged(tmp_path):
    ck = tmp_path / "ck"
    run = train(tmp_path, "plain", "--strategy", "single", "--devices", 1, "--epochs", 1, "--ckpt-dir", ck,
                "--io", "none", "--top-k", 1)
    assert run["io"] == "TorchCheckpointIO" and not any("Unickpt" in c for c in run["callbacks"])
    assert sorted(os.listdir(ck)) == ["epoch=0-step=6.ckpt", "last.ckpt"]
    assert torch.load(ck / "last.ckpt", weights_only=True)["global_step"] == 6  # Lightning's own format


def test_model_parallel_fsdp2_saved_on_2_resumed_on_1_and_3(tmp_path):
    ck = tmp_path / "ck"
    saved = train(tmp_path, "mp2", "--strategy", "mp", "--devices", 2, "--epochs", 2, "--ckpt-dir", ck,
                  "--watch-listings")
    # the folder lists what Lightning's own sharded IO leaves (one directory per checkpoint), at every moment
    names = ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    assert sorted(os.listdir(ck)) == names and all(os.path.isdir(ck / n) for n in names)
    assert saved["listings"] and all(set(seen) <= set(names) for seen in saved["listings"]), saved["listings"]
    assert pointer(ck / "last.ckpt" / "unickpt-lightning.json") == {
        "format": "unickpt-lightning", "format_version": 1, "route": "sharded", "checkpoint": "last.ckpt/step_2",
        "global_step": 6, "tensors_from": None}  # save_last: a whole checkpoint, its older version deleted
    assert sorted(os.listdir(ck / "last.ckpt")) == ["step_2", "unickpt-lightning.json"]
    meta = unickpt.CheckpointMetadata.from_json((ck / "epoch=1-step=6.ckpt/step_1/metadata.json").read_bytes())
    assert meta.layout["world_size"] == 2 and len(meta.tensors["state_dict.net.0.weight"].specs()) == 2
    for n, steps_per_epoch in ((1, 6), (3, 2)):
        restored = tmp_path / f"restored{n}.pt"
        run = train(tmp_path, f"mp{n}", "--strategy", "mp", "--devices", n, "--epochs", 3, "--ckpt-dir",
                    tmp_path / f"ck{n}", "--resume", ck / "last.ckpt", "--dump-restored", restored)
        got = torch.load(restored, weights_only=False)
        assert got["global_step"] == 6 and got["epoch"] == 2 and got["seen"] == saved["seen"]
        assert sorted(got["model"]) == sorted(saved["model"]) and same_leaves(got["model"], saved["model"])
        assert same_leaves(got["optim"], saved["optim"])
        assert run["global_step"] == 6 + steps_per_epoch  # training went on from there


def test_model_parallel_full_state_dict_through_checkpoint_io(tmp_path):
    """ModelParallelStrategy(save_distributed_checkpoint=False) saves a full dict through the
    CheckpointIO but loads it with its own code: that read is routed to unickpt too."""
    ck = tmp_path / "ck"
    saved = train(tmp_path, "full2", "--strategy", "mp-full", "--devices", 2, "--epochs", 2, "--ckpt-dir", ck)
    assert _pack.kind(str(ck / "last.ckpt")) == "pack"  # one file, like Lightning's own
    restored = tmp_path / "restored.pt"
    run = train(tmp_path, "full1", "--strategy", "mp-full", "--devices", 1, "--epochs", 3, "--ckpt-dir",
                tmp_path / "ck1", "--resume", ck / "last.ckpt", "--dump-restored", restored)
    got = torch.load(restored, weights_only=False)
    assert got["global_step"] == 6 and same_leaves(got["model"], saved["model"])
    assert same_leaves(got["optim"], saved["optim"]) and run["global_step"] == 12


def test_fsdp1_sharded_state_dict_resume(tmp_path):
    ck = tmp_path / "ck"
    train(tmp_path, "fsdp", "--strategy", "fsdp", "--devices", 2, "--epochs", 2, "--ckpt-dir", ck)
    assert pointer(ck / "last.ckpt" / "unickpt-lightning.json")["route"] == "sharded"
    assert sorted(os.listdir(ck)) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]  # as Lightning's
    restored = tmp_path / "restored.pt"
    run = train(tmp_path, "fsdp_resume", "--strategy", "fsdp", "--devices", 2, "--epochs", 3, "--ckpt-dir",
                tmp_path / "ck2", "--resume", ck / "last.ckpt", "--dump-restored", restored)
    assert run["global_step"] == 9
    for r in (0, 1):  # each rank's flat-parameter shard and optimizer state, as they were saved
        before = torch.load(tmp_path / f"fsdp.pt.rank{r}", weights_only=False)
        after = torch.load(f"{restored}.rank{r}", weights_only=False)
        assert sorted(before["model"]) == sorted(after["model"]) and same_leaves(before["model"], after["model"])
        assert same_leaves(before["optim"], after["optim"])


def test_deepspeed_strategy_routes_through_the_deepspeed_plugin(tmp_path):
    """Lightning's DeepSpeedStrategy needs CUDA; its routing is checked with a CPU DeepSpeed engine
    (tests/plugins/lightning/lightning_deepspeed.py): the strategy's DeepSpeed config gets unickpt's block, and
    ``DeepSpeedStrategy.save_checkpoint`` writes a unickpt checkpoint that a fresh engine loads."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("UNICKPT_LIGHTNING", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(HERE / "lightning_deepspeed.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    assert report == {"block": {"enabled": True, "async_save": True}, "engine": "UnickptCheckpointEngine",
                      "client": {"epoch": 1, "global_step": 3, "loops": {"fit_loop": {"n": 3}}},
                      "same": True, "same_after_step": True}
    tag = tmp_path / "epoch=1-step=3.ckpt" / "checkpoint"
    meta = unickpt.CheckpointMetadata.from_json((tag / "metadata.json").read_bytes())
    assert meta.layout["world_size"] == 2 and sorted(os.listdir(tag / "data")) == ["0_0.bin", "1_0.bin"]
