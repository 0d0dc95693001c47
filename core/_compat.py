"""The module paths of unickpt 0.1 (one flat package), kept for one release and deprecated.

``import unickpt.metadata`` (say) still works and gives a module whose names are looked up in the
modules that now hold them; the first import of each old path warns (``DeprecationWarning``). Old
paths that are packages now (``unickpt.state``, ``unickpt.storage``, ``unickpt.loading``) keep their
old names through the package's own ``__getattr__``. New code imports the new paths, and plugins
import only :mod:`unickpt` and :mod:`unickpt.ext`. Removed in 0.3.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import warnings
from typing import Any

__all__ = ["OLD_MODULES", "deprecated_getattr"]

# old module -> the modules that now hold its names, searched in order
OLD_MODULES: dict[str, tuple[str, ...]] = {
    "unickpt.codec": ("unickpt.state.codec", "unickpt.format.dtypes"),
    "unickpt.types": ("unickpt.state.leaves",),
    "unickpt.rng": ("unickpt.state.rng",),
    "unickpt.resharding": ("unickpt.geometry", "unickpt._util", "unickpt.plan.balance"),
    "unickpt.metadata": ("unickpt.format.metadata", "unickpt.format.layout", "unickpt.format.integrity",
                         "unickpt.lifecycle.directory", "unickpt.saving.commit"),
    "unickpt.collectives": ("unickpt.dist.comm",),
    "unickpt.merging": ("unickpt.plan.merge", "unickpt.dist.p2p"),
    "unickpt.planner": ("unickpt.plan.save_plan",),
    "unickpt.read_plan": ("unickpt.plan.read_plan",),
    "unickpt.hashwrite": ("unickpt.saving.drain", "unickpt.saving.writer_process", "unickpt.plan.stream",
                          "unickpt.format.integrity", "unickpt.storage.local"),
    "unickpt.staging": ("unickpt.saving.staging",),
    "unickpt.pipeline": ("unickpt.options", "unickpt.saving.pipeline", "unickpt.saving.staging"),
    "unickpt.replicas": ("unickpt.saving.replicas",),
    "unickpt.reader": ("unickpt.loading.reads", "unickpt.loading.targets", "unickpt.loading.stats"),
    "unickpt.dcp_compat": ("unickpt.loading.dcp",),
    "unickpt.retention": ("unickpt.lifecycle.root", "unickpt.lifecycle.directory"),
    "unickpt.checkpoint_reader": ("unickpt.tools.reader",),
    "unickpt.cli": ("unickpt.tools.cli",),
    "unickpt.diff": ("unickpt.tools.diff",),
    "unickpt.export": ("unickpt.tools.export",),
    "unickpt.importers": ("unickpt.tools.importers",),
    "unickpt.verify": ("unickpt.tools.verify",),
}

# renamed names of the old modules
_RENAMED = {"default_pool_cap": "default_ring_bytes"}



def _lookup(old: str, homes: tuple[str, ...], name: str) -> Any:
    target = _RENAMED.get(name, name)
    for home in homes:
        mod = importlib.import_module(home)
        if hasattr(mod, target):
            return getattr(mod, target)
    raise AttributeError(f"module {old!r} (deprecated) has no attribute {name!r}")


def deprecated_getattr(old: str, homes: tuple[str, ...], names: frozenset[str] | None = None) -> Any:
    """A module ``__getattr__`` serving the names of the old module ``old`` from ``homes`` (with a
    DeprecationWarning naming the new home); only ``names`` when given (so that a package's
    submodules are still imported as such)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__") or (names is not None and name not in names):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = _lookup(old, homes, name)
        doc = getattr(value, "__doc__", None) or ""
        if doc.startswith("Deprecated"):  # a shim of a 0.1 name: its docstring says what replaces it
            text = f"{old}.{name} is deprecated: {doc.split(chr(10))[0]}"
        else:
            text = f"{old}.{name} is deprecated; import it from {getattr(value, '__module__', homes[0])}"
        warnings.warn(text, DeprecationWarning, stacklevel=2)
        return value

    return __getattr__


class _Loader:  # the importlib loader protocol (importlib.abc is not imported: startup cost)
    def create_module(self, spec: Any) -> types.ModuleType:
        mod = types.ModuleType(spec.name, f"Deprecated: the names of {spec.name} moved to {OLD_MODULES[spec.name]}.")
        mod.__getattr__ = deprecated_getattr(spec.name, OLD_MODULES[spec.name])  # type: ignore[attr-defined]
        return mod

    def get_code(self, name: str) -> Any:
        """``python -m unickpt.cli`` (runpy asks the loader for the code to run as ``__main__``)."""
        if name != "unickpt.cli":
            return None
        return compile("import sys, warnings\n"
                       "warnings.warn('python -m unickpt.cli is deprecated; use python -m unickpt', DeprecationWarning)\n"
                       "from unickpt.tools.cli import main\nsys.exit(main())\n", "<unickpt.cli>", "exec")

    def is_package(self, name: str) -> bool:
        return False

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(f"{module.__name__} is deprecated (unickpt 0.2 is laid out by layer); import from "
                      f"{' / '.join(OLD_MODULES[module.__name__])}", DeprecationWarning, stacklevel=2)
        if module.__name__ == "unickpt.cli":  # the console script of installs made before 0.2
            module.main = importlib.import_module("unickpt.tools.cli").main  # type: ignore[attr-defined]


class _Finder:  # the importlib meta path finder protocol
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in OLD_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), origin=f"<deprecated {fullname}>")
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
