"""Interpreter startup hook: activate framework plugins when their framework is imported.

Installed as ``unickpt-startup.pth`` next to the package (see ``setup.py``), so Python runs
``import unickpt._startup`` in every interpreter. That import must stay cheap and side-effect free:
it imports neither torch nor any framework, it only puts a small finder on :data:`sys.meta_path`
that waits for the frameworks named in the ``unickpt.startup`` entry-point group to be imported and
then calls the entry point (the plugin's ``install()``, which reads its own switch, e.g.
``UNICKPT_ACCELERATE``, and patches the framework's checkpoint entry points or does nothing)::

    [project.entry-points."unickpt.startup"]
    accelerate = "unickpt.accelerate._activate:install"   # name: the module to watch
    deepspeed = "unickpt.deepspeed._activate:install"

Core names no framework: the table comes from the entry points of the distributions whose name
starts with ``unickpt`` (this package, and plugin packages named ``unickpt-*``), read by the one
registry of unickpt's entry points (:mod:`unickpt.interop.entry_points`: straight from their
``*.dist-info/entry_points.txt`` on ``sys.path``, about 0.3 ms; ``importlib.metadata`` would cost some
25 ms at every interpreter start). ``UNICKPT_STARTUP_HOOK=0`` disables the hook entirely
(read here, before anything else of unickpt is imported). Lightning needs no hook: it discovers its
plugin through its own ``lightning.pytorch.callbacks_factory`` entry point.

The technique is the post-import hook of PEP 369 (withdrawn), as implemented by e.g. ``wrapt``:
a meta-path finder that finds the module's real spec and wraps its loader so that
``exec_module`` is followed by the hook. Errors in a hook are reported as a warning and never
break the framework's import.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings
from typing import Any

from .interop.entry_points import read_entry_points

__all__ = ["install", "HOOKS", "GROUP", "read_hooks"]

GROUP = "unickpt.startup"


def read_hooks(paths: list[str] | None = None) -> dict[str, str]:
    """``{top-level module: "module:function"}`` of the ``unickpt.startup`` entry points of the
    ``unickpt*`` distributions on ``paths`` (default ``sys.path``); the first distribution found for
    a name wins, as for imports (:func:`unickpt.interop.entry_points.read_entry_points`)."""
    return read_entry_points(GROUP, paths)


# top-level module imported by the user -> "module:function" to call after it (filled by install())
HOOKS: dict[str, str] = {}


def _run_hook(name: str) -> None:
    target = HOOKS[name]
    module_name, _, func_name = target.partition(":")
    try:
        getattr(importlib.import_module(module_name), func_name)()
    except Exception as exc:  # never break the user's import of the framework
        warnings.warn(f"unickpt: activating the {name} plugin ({target}) failed: {exc!r}; "
                      f"{name} keeps its own checkpointing", RuntimeWarning, stacklevel=2)


class _HookedLoader:
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


class _PostImportFinder:
    """Finds the watched top-level modules through the other finders and wraps their loaders (the
    importlib meta-path finder protocol; ``importlib.abc`` is not imported: startup cost)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in HOOKS:
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
        spec.loader = _HookedLoader(spec.loader, fullname)  # type: ignore[assignment]  # a duck-typed Loader (see above)
        return spec


def install() -> None:
    """Read the hooks (:func:`read_hooks`) and put the post-import finder first on ``sys.meta_path``
    (idempotent). A watched framework that is already imported gets its hook run at once."""
    if os.environ.get("UNICKPT_STARTUP_HOOK", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    for name, target in read_hooks().items():
        HOOKS.setdefault(name, target)
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for name in list(HOOKS):
        if name in sys.modules:
            _run_hook(name)


install()
