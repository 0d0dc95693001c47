"""Lazy package attributes (PEP 562 module ``__getattr__``), shared by ``unickpt`` and its plugins.

A package lists its public names with the submodule defining each; the first access imports that
submodule and caches the value on the package. Importing this module imports nothing heavy, so a
package using it stays cheap to import (the startup hook imports ``unickpt`` in every interpreter).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps a name to the relative module
    (``".api"``) that defines it. Unknown names raise AttributeError, as for any module."""

    def __getattr__(name: str) -> Any:
        mod = exports.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
