"""The one reader of the ``unickpt.*`` entry points: what the installed plugins register.

Groups (declared in a plugin distribution's ``pyproject.toml``; this package's own plugins in the
repository's)::

    unickpt.startup      top-level module -> "module:function" run after it is imported (unickpt._startup)
    unickpt.layouts      framework name   -> a Layout instance (cross-framework loads)
    unickpt.wrappers     plugin name      -> parameter-name components frameworks insert
    unickpt.locators     plugin name      -> locate(path, storage) -> checkpoint dir | None
    unickpt.sources      source name      -> a Source (``unickpt import``)
    unickpt.conversions  plugin name      -> a Conversion or a list of them (``--to``)

Entry points are read straight from the ``entry_points.txt`` of the distributions whose name starts
with ``unickpt`` (this package, and plugin packages named ``unickpt-*``) on ``sys.path``: about 0.3 ms,
where ``importlib.metadata`` costs some 25 ms, and this runs at every interpreter start (the startup
hook). The first distribution found for a name wins, as for imports. Reading imports nothing; a target
is imported only by :func:`load` (a plugin whose framework is not installed raises ImportError there,
and is then left out: :func:`load` returns None and logs at DEBUG).

Runs on whichever thread asks; no collective.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys

__all__ = ["GROUPS", "read_entry_points", "entry_points", "load", "load_all"]

GROUPS = ("unickpt.startup", "unickpt.layouts", "unickpt.wrappers", "unickpt.locators", "unickpt.sources",
          "unickpt.conversions")


def read_entry_points(group: str, paths: list[str] | None = None) -> dict[str, str]:
    """``{name: "module:attribute"}`` of ``group`` in the ``unickpt*`` distributions on ``paths``
    (default ``sys.path``), in the order found. Unreadable entries of ``paths`` are skipped."""
    found: dict[str, str] = {}
    for entry in paths if paths is not None else sys.path:
        try:
            names = [n for n in os.listdir(entry or ".") if n.lower().startswith("unickpt") and n.endswith(".dist-info")]
        except OSError:
            continue
        for name in sorted(names):
            try:
                with open(os.path.join(entry or ".", name, "entry_points.txt"), encoding="utf-8") as f:
                    text = f.read()
            except OSError:
                continue
            section = None
            for line in text.splitlines():
                line = line.strip()
                if line.startswith("[") and line.endswith("]"):
                    section = line[1:-1].strip()
                elif section == group and "=" in line and not line.startswith(("#", ";")):
                    key, _, value = line.partition("=")
                    found.setdefault(key.strip(), value.split("[")[0].strip())
    return found


@functools.lru_cache(maxsize=None)
def entry_points(group: str) -> dict[str, str]:
    """:func:`read_entry_points` of ``sys.path``, read once per process and group."""
    if group not in GROUPS:
        raise ValueError(f"unknown entry-point group {group!r} (one of {', '.join(GROUPS)})")
    return read_entry_points(group)


@functools.lru_cache(maxsize=None)
def load(group: str, name: str) -> object | None:
    """The object the entry point ``name`` of ``group`` names, imported once; None when there is no
    such entry point or importing it raises ImportError (its framework is not installed)."""
    target = entry_points(group).get(name)
    if target is None:
        return None
    module, _, attr = target.partition(":")
    try:
        obj: object = importlib.import_module(module)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except ImportError as e:
        import logging  # not at module level: the startup hook imports this module in every interpreter

        logging.getLogger("unickpt").debug("unickpt: %s %s (%s) not available: %s", group, name, target, e)
        return None
    return obj


def load_all(group: str) -> dict[str, object]:
    """``{name: object}`` of every entry point of ``group`` that imports (see :func:`load`)."""
    out: dict[str, object] = {}
    for name in entry_points(group):
        obj = load(group, name)
        if obj is not None:
            out[name] = obj
    return out
