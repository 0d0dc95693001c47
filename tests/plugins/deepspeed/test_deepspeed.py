"""unickpt.deepspeed: the "unickpt" JSON block selects unickpt; ZeRO 0-3 (fp32, bf16) round trips and
reshards on load (2 -> 1, 2 -> 3) bitwise; an unmodified training script switches by its JSON alone.

The distributed parts run real DeepSpeed engines on CPU (DS_ACCELERATOR=cpu, gloo) under torchrun; see
tests/plugins/deepspeed/deepspeed_workers.py and examples/deepspeed_train.py. Nothing in those scripts calls
``unickpt.deepspeed`` to activate it: the startup hook does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORKER = os.path.join(ROOT, "tests", "plugins", "deepspeed", "deepspeed_workers.py")
EXAMPLE = os.path.join(ROOT, "examples", "deepspeed_train.py")
CONFIGS = "z0,z1,z2,z3,z0bf16,z1bf16,z2bf16,z3bf16"


def torchrun(nproc: int, *args: str, timeout: int = 400, s3: dict | None = None) -> str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    # deepspeed JIT-builds its CPU shm op at init_distributed into torch's extension cache; a cache shared
    # by several checkouts (their include paths differ) is rebuilt by each in turn, under one lock: a
    # checkout keeps its own (inside its virtual environment)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".venv", "torch_extensions"))
    env.pop("UNICKPT_DEEPSPEED", None)
    env.pop("UNICKPT_TEST_S3", None)
    if s3 is not None:
        env["UNICKPT_TEST_S3"] = json.dumps(s3)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def s3_or_none(request):
    """The moto S3 server's storage options (tests/conftest.py), or None where s3fs / moto are missing."""
    try:
        return request.getfixturevalue("s3")
    except pytest.skip.Exception:
        return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory, s3_or_none):
    """Every config saved at world size 2 (and checked there: same-size load and the step after it);
    ZeRO-3 also to S3 when available."""
    out = tmp_path_factory.mktemp("ds")
    log = torchrun(2, WORKER, "save", str(out), CONFIGS, "errors", s3=s3_or_none)
    return out, log


def test_same_size_roundtrip_and_step_after_load(saved):
    _, log = saved
    for name in CONFIGS.split(","):
        assert log.count(f"OK save {name} ws=2") == 2, (name, log[-3000:])


def test_without_block_deepspeed_is_unchanged_and_mismatch_is_named(saved):
    _, log = saved
    assert log.count("OK errors") == 2, log[-3000:]


def test_same_tag_waits_for_the_save_in_flight_and_replaces_only_at_commit(saved):
    # regression: a second save_checkpoint to a tag still being written raised CheckpointExistsError, and
    # replacing a committed tag deleted it before the new save had committed (lost on any failure)
    _, log = saved
    assert log.count("OK replace ws=2") == 2, log[-3000:]


@pytest.mark.parametrize("world", [1, 3])
def test_reshard_on_load(saved, world, s3_or_none):
    out, _ = saved
    extra = ["cross"] if world == 3 else []
    log = torchrun(world, WORKER, "load", str(out), CONFIGS, *extra, s3=s3_or_none if world == 3 else None)
    for name in CONFIGS.split(","):
        assert log.count(f"OK load {name} ws={world}") == world, (name, log[-3000:])
    if world == 3:  # ZeRO stage changed too; and the number of optimizer partitions (z0, ZeRO-3 sub-groups)
        for cross in ("z2->z3", "z3->z1", "z2->z0", "z3->z3sub"):
            assert log.count(f"OK cross {cross} ws=3") == 3, (cross, log[-3000:])
    if s3_or_none is not None and world == 3:
        assert log.count("OK remote load ws=3") == 3, log[-3000:]


def test_remote_save_and_load(saved, s3_or_none):
    if s3_or_none is None:
        pytest.skip("s3fs / moto not installed")
    _, log = saved
    assert log.count("OK remote save ws=2") == 2, log[-3000:]


def _example_config(tmp_path, with_block: bool) -> str:
    cfg = json.load(open(os.path.join(ROOT, "examples", "deepspeed_unickpt.json")))
    assert cfg["unickpt"]["enabled"] is True
    if not with_block:
        del cfg["unickpt"]
    path = tmp_path / ("with_block.json" if with_block else "without_block.json")
    path.write_text(json.dumps(cfg))
    return str(path)


def test_unmodified_script_only_json_changed(tmp_path):
    plain, ours = _example_config(tmp_path, False), _example_config(tmp_path, True)
    # without the block: DeepSpeed's own files
    torchrun(2, EXAMPLE, "--deepspeed_config", plain, "--ckpt_dir", str(tmp_path / "native"), "--steps", "2",
             "--save_every", "2")
    native = os.listdir(tmp_path / "native" / "global_step2")
    assert "mp_rank_00_model_states.pt" in native and "metadata.json" not in native, native
    # with the block: a unickpt checkpoint, `latest` written after its commit
    ck = tmp_path / "ours"
    log = torchrun(2, EXAMPLE, "--deepspeed_config", ours, "--ckpt_dir", str(ck), "--steps", "4", "--save_every", "2")
    assert "resumed" not in log
    assert (ck / "latest").read_text() == "global_step4"
    for tag in ("global_step2", "global_step4"):
        files = os.listdir(ck / tag)
        assert "metadata.json" in files and not any(f.endswith(".pt") for f in files), files
        meta = json.load(open(ck / tag / "metadata.json"))
        assert meta["framework"] == "deepspeed" and meta["layout"]["world_size"] == 2
    # the same script on 3 ranks resumes from it: ZeRO-2 partitions resharded 2 -> 3 at load time
    log = torchrun(3, EXAMPLE, "--deepspeed_config", ours, "--ckpt_dir", str(ck), "--steps", "6", "--save_every", "2")
    assert log.count("resumed from") == 3 and "at step 4" in log, log[-3000:]
    assert (ck / "latest").read_text() == "global_step6"
    assert json.load(open(ck / "global_step6" / "metadata.json"))["layout"]["world_size"] == 3


def test_startup_hook_patches_deepspeed_on_import():
    code = ("import sys, deepspeed, deepspeed.runtime.engine as e; "
            "print('unickpt.deepspeed._activate' in sys.modules, getattr(e.create_checkpoint_engine, "
            "'__unickpt_wrapped__', False))")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.pop("UNICKPT_DEEPSPEED", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.stdout.strip().splitlines()[-1] == "True True", res.stdout + res.stderr
    env["UNICKPT_DEEPSPEED"] = "0"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    # the hook still runs the plugin's startup(), which patches nothing
    assert res.stdout.strip().splitlines()[-1] == "True False", res.stdout + res.stderr


def test_config_block_validation():
    from unickpt.deepspeed.config import UnickptConfig

    assert UnickptConfig.from_block({"enabled": True}) == UnickptConfig(enabled=True, async_save=True)
    assert UnickptConfig.from_block(True).enabled is True
    assert UnickptConfig.from_block({"enabled": True, "async_save": False}).async_save is False
    with pytest.raises(ValueError) as e:
        UnickptConfig.from_block({"enabled": True, "asyncsave": True})
    assert str(e.value) == ('DeepSpeed config "unickpt": unknown key(s) [\'asyncsave\'] (did you mean '
                            "'asyncsave' -> 'async_save'?); known keys: "
                            "['allow_pickle', 'async_save', 'enabled', 'memory_dir', 'memory_every', 'memory_keep', "
                            "'memory_limit_bytes', 'peer', 'persist_every', 'save_dir', 'signals', 'storage_options', "
                            "'verify']")
    with pytest.raises(ValueError) as e:  # no near match: no hint
        UnickptConfig.from_block({"enabled": True, "zzz": 1})
    assert str(e.value) == ('DeepSpeed config "unickpt": unknown key(s) [\'zzz\']; known keys: '
                            "['allow_pickle', 'async_save', 'enabled', 'memory_dir', 'memory_every', 'memory_keep', "
                            "'memory_limit_bytes', 'peer', 'persist_every', 'save_dir', 'signals', 'storage_options', "
                            "'verify']")
    with pytest.raises(ValueError) as e:
        UnickptConfig.from_block({"enabled": "yes"})
    assert str(e.value) == 'DeepSpeed config "unickpt.enabled": expected a JSON boolean, got str \'yes\''
    with pytest.raises(ValueError) as e:
        UnickptConfig.from_block([1])
    assert str(e.value).startswith('DeepSpeed config "unickpt": expected a JSON object')
    # the checkpoint tiers' keys (docs/tiers.md)
    cfg = UnickptConfig.from_block({"enabled": True, "memory_every": 2, "save_dir": "/ckpt", "signals": ["SIGUSR1"]})
    assert cfg.tiers_enabled and cfg.tier_options().validated().memory_every == 2
    with pytest.raises(ValueError, match='need "save_dir"'):
        UnickptConfig.from_block({"enabled": True, "memory_every": 1})
    with pytest.raises(ValueError) as e:
        UnickptConfig.from_block({"enabled": True, "memory_every": 0, "save_dir": "/ckpt"})
    assert str(e.value) == 'DeepSpeed config "unickpt.memory_every": expected a positive integer or null, got int 0'
    with pytest.raises(ValueError, match="signals must be names"):
        UnickptConfig.from_block({"enabled": True, "persist_every": 5, "save_dir": "/ckpt", "signals": ["SIGKILL"]})


def test_misspelled_block_name_is_warned_about(caplog):
    from unickpt.deepspeed._activate import _unickpt_block

    class Config:  # DeepSpeedConfig keeps the raw JSON in _param_dict
        _param_dict = {"train_batch_size": 8, "unickp": {"enabled": True}}

    with caplog.at_level("WARNING", logger="unickpt.deepspeed"):
        assert _unickpt_block(Config()) is None  # DeepSpeed's own checkpoints, as before
    assert [r.getMessage() for r in caplog.records] == [
        "DeepSpeed config: top-level key 'unickp' is not \"unickpt\"; DeepSpeed ignores it and saves its own "
        "checkpoints"]
    caplog.clear()
    Config._param_dict = {"train_batch_size": 8, "bf16": {"enabled": True}}
    with caplog.at_level("WARNING", logger="unickpt.deepspeed"):
        assert _unickpt_block(Config()) is None
    assert caplog.records == []


class _Handle:
    """A stand-in for unickpt's SaveHandle: done() and wait() only."""

    def __init__(self, done: bool, error: BaseException | None = None):
        self._done, self._error, self.waited = done, error, 0

    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        self.waited += 1
        if self._error is not None:
            raise self._error


def test_decoupled_contract_raises_failed_async_save_at_step_boundary():
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from unickpt.deepspeed.config import UnickptConfig
    from unickpt.deepspeed.checkpoint_engine import UnickptCheckpointEngine
    from unickpt.errors import SaveFailedError

    eng = UnickptCheckpointEngine(None, UnickptConfig(enabled=True, async_save=True))
    assert eng.is_decoupled() is True
    assert UnickptCheckpointEngine(None, UnickptConfig(enabled=True, async_save=False)).is_decoupled() is False
    info = CheckpointCommitInfo(tag="t", save_dir="/x", save_latest=True)
    running, failed = _Handle(done=False), _Handle(done=True, error=SaveFailedError("/x/t", {1: "disk full"}))
    eng.add_pending(running, info)
    eng.add_pending(failed, info)
    # DeepSpeed's engine.step() calls get_commit_info() at each boundary: the failure surfaces there,
    # a save still running is not waited for, and nothing is left for DeepSpeed to commit
    with pytest.raises(SaveFailedError, match="disk full"):
        eng.get_commit_info()
    assert running.waited == 0 and eng._pending == [(running, info)]
    assert eng.get_commit_info() is None
    running._done = True
    eng.cleanup()  # engine.destroy(): waits for the rest
    assert running.waited == 1 and eng._pending == []


def test_memory_tiers_through_the_json_block(tmp_path):
    """"memory_every" in the block: engine.step() saves to memory every optimizer step; a fresh engine's
    load_checkpoint restores the last step from memory bitwise; a SIGUSR1 to one rank makes every rank
    save that step (docs/tiers.md)."""
    import shutil
    import tempfile

    mem = tempfile.mkdtemp(prefix="unickpt-test-ds-tiers-", dir="/dev/shm")
    try:
        os.environ["UNICKPT_MEMORY_DIR"] = mem
        log = torchrun(2, WORKER, "tiers", str(tmp_path))
    finally:
        os.environ.pop("UNICKPT_MEMORY_DIR", None)
        shutil.rmtree(mem, ignore_errors=True)
    assert log.count("OK tiers ws=2") == 2, log[-3000:]
