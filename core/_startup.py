"""Interpreter startup hook: activate unickpt's framework plugins when a framework is imported.

Installed as ``unickpt-startup.pth`` next to the package (see ``setup.py``), so Python runs
``import unickpt._startup`` in every interpreter. That import must stay cheap and side-effect free:
it imports neither torch nor any framework, it only puts a small finder on :data:`sys.meta_path`
that waits for the frameworks below to be imported and then calls the plugin's ``install()``
(which patches the framework's checkpoint entry points).

==============  ===================================  ==================================================
framework        runs when                            calls
==============  ===================================  ==================================================
``accelerate``   ``UNICKPT_ACCELERATE=1``             ``unickpt.accelerate._activate.install()``
``deepspeed``    unless ``UNICKPT_DEEPSPEED=0``       ``unickpt.deepspeed._activate.install()`` (a no-op
                                                      for engines whose JSON config has no ``"unickpt"``
                                                      block)
==============  ===================================  ==================================================

``UNICKPT_STARTUP_HOOK=0`` disables the hook entirely. Lightning needs no hook: it discovers the
plugin through its ``lightning.pytorch.callbacks_factory`` entry point.

The technique is the post-import hook of PEP 369 (withdrawn), as implemented by e.g. ``wrapt``:
a meta-path finder that finds the module's real spec and wraps its loader so that
``exec_module`` is followed by the hook. Errors in a hook are reported as a warning and never
break the framework's import.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import warnings
from typing import Any, Callable

__all__ = ["install", "HOOKS"]


def _enabled(var: str, default: bool) -> Callable[[], bool]:
    def check() -> bool:
        value = os.environ.get(var)
        if value is None or value == "":
            return default
        return value.strip().lower() not in ("0", "false", "no", "off")
    return check


# top-level module imported by the user -> (activation predicate, "module:function" to call after it)
HOOKS: dict[str, tuple[Callable[[], bool], str]] = {
    "accelerate": (_enabled("UNICKPT_ACCELERATE", False), "unickpt.accelerate._activate:install"),
    "deepspeed": (_enabled("UNICKPT_DEEPSPEED", True), "unickpt.deepspeed._activate:install"),
}


def _run_hook(name: str) -> None:
    active, target = HOOKS[name]
    if not active():
        return
    module_name, func_name = target.split(":")
    try:
        getattr(importlib.import_module(module_name), func_name)()
    except Exception as exc:  # never break the user's import of the framework
        warnings.warn(f"unickpt: activating the {name} plugin ({target}) failed: {exc!r}; "
                      f"{name} keeps its own checkpointing", RuntimeWarning, stacklevel=2)


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader; after ``exec_module`` puts the real loader back and runs the hook."""

    def __init__(self, loader: Any, name: str):
        self._loader = loader
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)

    def create_module(self, spec):  # noqa: D401 - loader protocol
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        # restore the real loader first, so introspection (importlib.resources, reload) sees it
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_hook(self._name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds the watched top-level modules through the other finders and wraps their loaders."""

    def __init__(self) -> None:
        self._local = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in HOOKS or not HOOKS[fullname][0]():
            return None
        busy = self._local.__dict__.setdefault("busy", set())
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


def install() -> None:
    """Put the post-import finder first on ``sys.meta_path`` (idempotent).

    A watched framework that is already imported gets its hook run at once.
    """
    if os.environ.get("UNICKPT_STARTUP_HOOK", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for name in HOOKS:
        if name in sys.modules:
            _run_hook(name)


install()
