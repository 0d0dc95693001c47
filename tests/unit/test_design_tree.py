"""docs/design.md's module tables name every module of core/ and plugins/ once, and module names mean one thing.

The tables ("The tree, one line per module" and "The plugins, one line per module") are the map a
reader starts from; this keeps them true: a module added, moved or removed without its row fails
here, naming it. And a file name used twice in the package tree must mean the same thing in both
places (`SHARED_NAMES`), so that `layout.py` never again names three different things."""
from __future__ import annotations

import collections
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# file names that appear in more than one folder, with the one meaning they share everywhere
SHARED_NAMES = {
    "__init__.py": "a package",
    "_activate.py": "a plugin's zero-code activation",
    "layout.py": "a framework's names of training state (an interop Layout), in that framework's plugin",
    "errors.py": "unickpt's typed errors (core), and the same errors as a framework's exception types (plugin)",
    "_patch.py": "a plugin's replacement of its framework's checkpoint methods (on the framework's class)",
    "_options.py": "a plugin's options, from keyword arguments or its UNICKPT_<FRAMEWORK>_* variables",
}


def _table(title: str) -> list[tuple[str, str]]:
    """``[(folder, module)]`` of the markdown table after the line ``title`` in docs/design.md."""
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        text = f.read()
    assert title in text, f"docs/design.md has no line {title!r}"
    lines = text.split(title, 1)[1].strip("\n").split("\n\n", 1)[0].splitlines()
    rows, folder = [], ""
    for line in lines[2:]:  # the header row and the separator
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"docs/design.md: malformed row {line!r}"
        if cells[0]:
            folder = cells[0].strip("`").rstrip("/")
        names = re.findall(r"`([\w.]+\.py)`", cells[1])
        assert names and cells[2], f"docs/design.md: the row {line!r} names no module or says nothing of it"
        rows += [(folder, name) for name in names]
    return rows


def _modules(top: str, prefix: str) -> set[tuple[str, str]]:
    out = set()
    for d, dirs, files in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        rel = os.path.relpath(d, os.path.join(ROOT, top))
        folder = prefix if rel == "." else f"{prefix}{rel}".rstrip("/")
        out |= {(folder, f) for f in files if f.endswith(".py") and f != "__init__.py"}
    return out


def _check(rows: list[tuple[str, str]], actual: set[tuple[str, str]]) -> None:
    twice = [row for row, n in collections.Counter(rows).items() if n > 1]
    assert not twice, f"docs/design.md lists these modules twice: {twice}"
    assert not actual - set(rows), f"modules missing from docs/design.md's table: {sorted(actual - set(rows))}"
    assert not set(rows) - actual, f"docs/design.md lists modules that do not exist: {sorted(set(rows) - actual)}"


def test_core_table_lists_every_core_module_once():
    rows = [("" if f == "core" else f.rstrip("/"), m) for f, m in _table("The tree, one line per module:")]
    _check(rows, _modules("core", ""))


def test_plugin_table_lists_every_plugin_module_once():
    _check(_table("The plugins, one line per module (`__init__.py` holds each plugin's public names):"),
           _modules("plugins", "plugins/"))


def test_a_module_name_used_in_two_folders_means_one_thing():
    where = collections.defaultdict(list)
    for top in ("core", "plugins"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    where[f].append(os.path.relpath(os.path.join(d, f), ROOT))
    repeated = {name: paths for name, paths in where.items() if len(paths) > 1 and name not in SHARED_NAMES}
    assert not repeated, f"module names used in several folders (rename, or add the one shared meaning): {repeated}"
    layouts = [p for p in where["layout.py"] if not p.startswith("plugins/")]
    assert not layouts, f"layout.py means a framework's Layout, in plugins only: {layouts}"
