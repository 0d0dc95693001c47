"""Hooks that ``tests/suites/deepspeed.py`` puts into DeepSpeed's own test processes (not a test file).

The runner copies this file as ``unickpt_ds_suite.py`` into a temporary folder on ``PYTHONPATH``, next
to a generated ``sitecustomize.py`` that imports it in every interpreter: pytest's process and the
workers that DeepSpeed's harness (``tests/unit/common.py``, ``DistributedTest``) starts through the
``forkserver`` start method. It does three things:

- :func:`install` (from ``sitecustomize``): right after ``import deepspeed``, adds what the test sources
  of 0.19.6-dev need of 0.19.8 (:func:`_compat`, both modes), and with ``UNICKPT_DS_SUITE=1`` wraps
  ``deepspeed.initialize`` so that every config it is given (``config=``, ``config_params=`` or
  ``args.deepspeed_config``; a dict or a JSON file path) gets ``"unickpt": {"enabled": true}`` added,
  as a user switching unickpt on would. The caller's dict is not changed (a shallow copy gets the
  block); a config that already has a ``"unickpt"`` block is passed as it is. The post-import hook is
  the meta-path technique of ``unickpt._startup`` (PEP 369's, as in ``wrapt``).
- :func:`pytest_configure` makes the forkserver import torch and deepspeed once (the workers fork
  from it), which saves each worker of each test its own imports.
- The other pytest hooks (loaded with ``-p unickpt_ds_suite`` in pytest's process only) append one
  JSON line per event to ``$UNICKPT_DS_SUITE_LOG`` as soon as it happens: ``{"collected": [nodeids]}``,
  ``{"start": nodeid}``, ``{"nodeid", "when", "outcome", "error"}`` (``error``: the first line of the
  failure). pytest's junit XML is written only at the end of a session and is lost when a hung
  test's process is killed; these lines survive, so the runner knows what ran and what hung.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading

_MARK = "__unickpt_ds_suite__"


# --- unickpt switched on inside DeepSpeed's tests ----------------------------------------------------

def _with_block(config):
    """``config`` (a dict, or a JSON file path as DeepSpeed accepts) as a new dict with the block added."""
    if not isinstance(config, dict):
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

        config = load_ds_config(config)
    return config if "unickpt" in config else {**config, "unickpt": {"enabled": True}}


def _wrap_initialize(deepspeed) -> None:
    original = deepspeed.initialize
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        import inspect

        bound = inspect.signature(original).bind(*args, **kwargs)
        params = bound.arguments
        for name in ("config", "config_params"):
            if params.get(name) is not None:
                params[name] = _with_block(params[name])
                break
        else:
            ds_args = params.get("args")
            for attr in ("deepspeed_config", "deepscale_config"):
                if getattr(ds_args, attr, None) is not None:
                    setattr(ds_args, attr, _with_block(getattr(ds_args, attr)))
                    break
        return original(*bound.args, **bound.kwargs)

    setattr(initialize, _MARK, True)
    deepspeed.initialize = initialize


class _AfterImport:
    """Meta-path finder: finds ``deepspeed`` through the other finders and runs :func:`_after_import`
    after its module has executed."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        class _Loader:
            def __getattr__(self, attr):
                return getattr(loader, attr)

            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                module.__loader__ = loader
                module.__spec__.loader = loader
                loader.exec_module(module)
                _after_import(module)

        spec.loader = _Loader()
        return spec


def _compat(deepspeed) -> None:
    """Let the test sources (DeepSpeed 0.19.6-dev, the nearest to the installed 0.19.8 that the snapshot
    has) run on deepspeed 0.19.8, in both modes: 0.19.8 removed the ``sparse_gradients`` option and with it
    ``DeepSpeedEngine.sparse_tensor_module_names`` (the names of the embeddings whose dense gradients were
    sent sparse), which ``tests/unit/checkpoint/common.py`` compares between the saved and the loaded
    engine. Without the option that set is empty (0.19.6 ``runtime/engine.py``, "Bookkeeping for sparse
    support"), so the attribute is added as an empty set where the engine has none."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not hasattr(DeepSpeedEngine, "sparse_tensor_module_names"):
        DeepSpeedEngine.sparse_tensor_module_names = property(lambda self: set())


def _after_import(deepspeed) -> None:
    _compat(deepspeed)
    if os.environ.get("UNICKPT_DS_SUITE") == "1":
        _wrap_initialize(deepspeed)


def install() -> None:
    """Run in every interpreter (``sitecustomize``): right after ``import deepspeed`` (or now, if it is
    imported), apply :func:`_compat`, and with ``UNICKPT_DS_SUITE=1`` add the ``"unickpt"`` block to
    every config given to ``deepspeed.initialize``."""
    if "deepspeed" in sys.modules:
        _after_import(sys.modules["deepspeed"])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


# --- pytest hooks: one JSON line per event, written at once ------------------------------------------

def _log(record: dict) -> None:
    path = os.environ.get("UNICKPT_DS_SUITE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def pytest_configure(config):
    """Import torch and deepspeed once, in the forkserver that DeepSpeed's harness forks its workers
    from, instead of in every worker of every test (``UNICKPT_DS_SUITE_PRELOAD=0``: off). The same in
    both modes; the workers still import the test module themselves."""
    if os.environ.get("UNICKPT_DS_SUITE_PRELOAD", "1") != "0":
        import multiprocessing

        multiprocessing.set_forkserver_preload(["torch", "deepspeed"])


def pytest_collection_finish(session):
    _log({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):
    _log({"start": nodeid})


def pytest_runtest_logreport(report):
    if report.when != "call" and report.outcome == "passed":
        return  # setup / teardown that passed: the call's report says it
    error = ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        error = str(report.longrepr[2])
    elif report.outcome == "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        text = str(report.longrepr)  # a setup error (fixture not found) has no crash entry: its "E" line
        error = crash.message if crash is not None else next(
            (line[1:].strip() for line in text.splitlines() if line.startswith("E ")), text)
    _log({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
          "error": error.strip().splitlines()[0][:300] if error.strip() else ""})
