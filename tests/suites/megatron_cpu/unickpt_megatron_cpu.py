"""TEST-ONLY pytest plugin: megatron-core's own ``tests/unit_tests/dist_checkpointing`` on a CPU-only
torch, one pytest per rank under ``torchrun`` (``-p unickpt_megatron_cpu``, this folder on ``PYTHONPATH``).
Used by ``tests/suites/megatron.py``; never imported by unickpt.

What it changes in every rank's process, before the tests import anything (no test file is edited):

- CUDA calls stubbed: ``tests/plugins/megatron/megatron_cuda_shim.py`` (``synchronize``, ``set_device``,
  ``current_device``) plus ``torch.cuda.device_count() -> 1`` (the harness's
  ``torch.cuda.set_device(rank % device_count())``); a CUDA build is left alone;
- gloo instead of nccl: ``torch.distributed.init_process_group`` / ``new_group`` asked for ``nccl``
  get ``gloo`` (megatron's ``Utils.initialize_distributed`` asks for nccl);
- CPU tensors: a ``TorchFunctionMode`` rewrites every ``device`` argument naming CUDA (``"cuda"``,
  ``"cuda:0"``, ``torch.device("cuda")``, ``tensor.to("cuda")``) to ``"cpu"``; ``Tensor.cuda()`` and
  ``Module.cuda()`` return CPU objects;
- ``megatron.core.transformer.custom_layers.batch_invariant_kernels`` (imported by Megatron-LM's
  ``megatron.training.initialize``; it imports ``triton``, absent from CPU wheels, at module level):
  replaced by a stub whose ``enable_batch_invariant_mode`` raises, only when triton is not importable;
- ``megatron.core.utils.is_te_min_version`` answers False without Transformer Engine (it compares
  ``None >= Version`` and raises TypeError; megatron's harness calls it in an autouse fixture);
- megatron's persistent checkpoint worker (a ``spawn``-ed process) runs through a function of this
  module, so that it gets the same stubs;
- the harness's test-data download (``ensure_test_data``, unused by these tests) is not attempted;
- after each test, once model parallelism is torn down, the process groups it left are destroyed
  (megatron forgets them without destroying them; see ``_destroy_orphaned_groups``), in both modes;
- ``UNICKPT_MCORE_MODE=unickpt``: unickpt is made megatron-core's default sharded save strategy the way a
  user does it, ``unickpt.megatron.launch.install()``, called when the first test starts: megatron's
  ``dist_checkpointing/conftest.py`` replaces ``get_default_save_sharded_strategy`` for the session
  (a mock returning torch_dist's strategy), and ``install()`` wraps whatever is in place, so it must
  run after that mock. Every unickpt save is recorded (``saves`` in the result file), so the runner can
  check that the suite really went through unickpt.

Results: every test's phases are appended as JSON lines to ``$UNICKPT_MCORE_OUT/rank<RANK>.jsonl`` as
they happen (``{"nodeid", "when": "start"|"setup"|"call"|"teardown", "outcome", "error"}``, and ``{"saves": 1}``
when a unickpt save starts), so a run killed on a timeout still tells what finished
and which test was running. Each rank's pytest exits 0 when tests failed (see ``pytest_sessionfinish``).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(_REPO, "tests", "plugins", "megatron"))
import megatron_cuda_shim  # noqa: E402,F401  (synchronize / set_device / current_device)

sys.path.pop(0)

_CPU = not torch.cuda.is_available()


def _is_cuda(d) -> bool:
    return (isinstance(d, str) and d.startswith("cuda")) or (isinstance(d, torch.device) and d.type == "cuda")


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA ``device`` arguments (keyword or positional) of every torch function to ``"cpu"``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _gloo(fn):
    def wrapper(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        if args and args[0] == "nccl" and fn is dist.init_process_group.__wrapped__:
            args = ("gloo",) + args[1:]
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


def _stub_triton_kernels() -> None:
    import importlib.util
    import types

    if importlib.util.find_spec("triton") is not None:
        return
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"

    def enable_batch_invariant_mode(*args, **kwargs):
        raise RuntimeError(f"{name} needs triton (stubbed by the unickpt suite runner on CPU)")

    stub = types.ModuleType(name)
    stub.enable_batch_invariant_mode = enable_batch_invariant_mode
    sys.modules[name] = stub


def _no_te_is_not_min_version() -> None:
    import megatron.core.utils as mcu

    original = mcu.is_te_min_version

    def is_te_min_version(version, check_equality=True):
        return mcu.get_te_version() is not None and original(version, check_equality)

    mcu.is_te_min_version = is_te_min_version


_no_te_is_not_min_version()  # before megatron's conftest imports it by name
if _CPU:
    _stub_triton_kernels()
    torch.cuda.device_count = lambda: 1
    dist.init_process_group = _gloo(dist.init_process_group)
    dist.new_group = _gloo(dist.new_group)
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    _CudaToCpu().__enter__()  # for the whole session


def _persistent_async_loop(*args, **kwargs):
    """megatron's ``PersistentAsyncCaller.async_loop``, the target of its spawned checkpoint worker: a
    function of this module, so the spawned process imports this module (applying the stubs above,
    e.g. for its ``torch.cuda.set_device(rank % torch.cuda.device_count())``) before running it."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    return PersistentAsyncCaller.__dict__["_unickpt_suite_original"](*args, **kwargs)


if _CPU:
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    if "_unickpt_suite_original" not in PersistentAsyncCaller.__dict__:
        PersistentAsyncCaller._unickpt_suite_original = PersistentAsyncCaller.async_loop  # a staticmethod
        PersistentAsyncCaller.async_loop = staticmethod(_persistent_async_loop)


def _out_path() -> str | None:
    out = os.environ.get("UNICKPT_MCORE_OUT")
    return os.path.join(out, f"rank{os.environ.get('RANK', '0')}.jsonl") if out else None


def _record(entry: dict) -> None:
    path = _out_path()
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def pytest_plugin_registered(plugin, manager):
    """Megatron's ``tests/unit_tests/conftest.py`` downloads data sets to /opt/data at session start."""
    if getattr(plugin, "__name__", "") == "tests.unit_tests.conftest":
        def no_download(*args, **kwargs):
            raise RuntimeError("not downloaded by the unickpt suite runner (the checkpoint tests do not use it)")

        plugin.download_and_extract_asset = no_download


@pytest.fixture(autouse=True)
def _unickpt_default_save_strategy():
    """In unickpt mode: ``unickpt.megatron.launch.install()`` (idempotent), after megatron's session mock."""
    if os.environ.get("UNICKPT_MCORE_MODE") == "unickpt":
        from unickpt.megatron import launch
        from unickpt.megatron.strategy import UnickptSaveShardedStrategy

        if not getattr(UnickptSaveShardedStrategy, "_suite_counted", False):
            original = UnickptSaveShardedStrategy._start  # under both save() and async_save()

            def start(self, *args, **kwargs):
                _record({"saves": 1})
                return original(self, *args, **kwargs)

            UnickptSaveShardedStrategy._start = start
            UnickptSaveShardedStrategy._suite_counted = True
        launch.install()
    yield


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    _destroy_orphaned_groups()


def _destroy_orphaned_groups() -> None:
    """After a test's own teardown (both modes): destroy the process groups nothing uses any more.

    megatron's ``destroy_model_parallel()`` forgets its groups without destroying them, and every gloo
    group keeps its threads and sockets, so each rank grew by ~1000 threads over the suite (load in the
    thousands on 2 cores, tests timing out at random). Only when model parallelism is no longer set up
    (a fixture of a wider scope may keep it for the next test): every group but the default one and the
    private groups of unickpt's engine of the default group is destroyed; destroying a group an engine
    of unickpt was made for closes that engine first (its teardown guard), as in a user's program."""
    if not dist.is_available() or not dist.is_initialized():
        return
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    world = dist.group.WORLD
    keep = {world}
    engine_mod = sys.modules.get("unickpt.engine")
    if engine_mod is not None:
        for key, engine in list(engine_mod._ENGINES.items()):
            if key is world or key is None:
                keep |= {g for g in (engine.comm.plan_group, engine.comm.background_group) if g is not None}
    for group in [g for g in list(c10d._world.pg_map) if g not in keep]:
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # already gone (an engine's private group, closed with it)
            pass


def pytest_runtest_logstart(nodeid, location):
    _record({"nodeid": nodeid, "when": "start"})


def pytest_runtest_logreport(report):
    error = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        error = crash.message if crash is not None else str(report.longrepr)
        error = (error.strip().splitlines() or [""])[0][:300]
    _record({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "error": error})


def pytest_configure(config):
    """Each rank its own ``--basetemp`` under ``$UNICKPT_MCORE_TMP``, so that megatron's shared checkpoint
    folder (``tmp_path_dist_ckpt``: the basetemp's parent ``/ "tmp_dist_ckpt"``) is this run's, and ranks
    never clear each other's basetemp."""
    tmp = os.environ.get("UNICKPT_MCORE_TMP")
    if tmp:
        config.option.basetemp = os.path.join(tmp, f"basetemp-rank{os.environ.get('RANK', '0')}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Exit status 0 when tests failed (the outcomes are in the records):
    torchrun stops every rank as soon as one exits non-zero, which would cut the others' last test short."""
    if session.exitstatus == 1:
        session.exitstatus = 0
