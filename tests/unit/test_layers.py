"""The shape of the code: core/ layers import only downwards, with no cycles, and plugins use only
``unickpt``, ``unickpt.ext`` and ``unickpt.interop`` of the core (docs/design.md). Read from the sources (every import
statement, also those inside functions), so a lazy import cannot hide a dependency."""
from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORE = os.path.join(ROOT, "core")
PLUGINS = os.path.join(ROOT, "plugins")

# bottom to top; a module may import its own layer and the ones below
LAYERS = [
    {"unickpt.errors", "unickpt.options", "unickpt.requests", "unickpt._lazy", "unickpt._util", "unickpt.geometry"},
    {"unickpt.format", "unickpt.storage", "unickpt.dist"},
    {"unickpt.state", "unickpt.lifecycle"},
    {"unickpt.plan"},
    {"unickpt.interop"},
    {"unickpt.saving", "unickpt.loading", "unickpt.tiers", "unickpt.sync"},
    {"unickpt.engine", "unickpt.teardown", "unickpt.removal", "unickpt.api", "unickpt.checkpointer"},
    {"unickpt.ext"},
    {"unickpt.tools", "unickpt.testing", "unickpt._startup", "unickpt.__main__", "unickpt"},
]
PLUGIN_NAMES = sorted(d for d in os.listdir(PLUGINS) if os.path.isdir(os.path.join(PLUGINS, d)) and d != "__pycache__")


def _modules(base: str, package: str) -> dict[str, str]:
    """``{module name: file}`` of the package rooted at ``base``."""
    out = {}
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(dirpath, base)
        prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                out[prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"] = os.path.join(dirpath, f)
    return out


def _imports(name: str, path: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, names imported from it, line)`` for every import statement of the module."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts if is_pkg else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, [a.name for a in node.names], node.lineno))
    return out


def _layer(module: str) -> int | None:
    """The layer of a core module (its longest listed prefix)."""
    best, found = -1, None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    return found


def _targets(mod: str, names: list[str], known: dict[str, str]) -> list[str]:
    """The core modules an import statement reaches (``from pkg import submodule`` reaches the submodule)."""
    out = [mod] if mod in known else []
    out += [f"{mod}.{n}" for n in names if f"{mod}.{n}" in known]
    return out


CORE_MODULES = _modules(CORE, "unickpt")


def test_every_core_module_has_a_layer():
    assert [m for m in CORE_MODULES if _layer(m) is None] == []


def test_core_layers_import_only_downwards():
    violations = []
    for mod, path in CORE_MODULES.items():
        for target_mod, names, line in _imports(mod, path):
            for target in _targets(target_mod, names, CORE_MODULES):
                if _layer(target) > _layer(mod):
                    violations.append(f"{mod}:{line} imports {target} (layer {_layer(target)} > {_layer(mod)})")
    assert violations == []


def test_core_has_no_import_cycles_between_packages():
    """The graph of core packages (``unickpt.saving`` -> ``unickpt.plan``, ...) has no cycle."""
    def package(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 else m

    graph: dict[str, set[str]] = {}
    for mod, targets in _module_graph(CORE_MODULES).items():
        graph.setdefault(package(mod), set()).update(package(t) for t in targets if package(t) != package(mod))
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def _module_graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """``{module: modules of mods it imports}``, every import statement counted (also those inside
    functions); a module importing its own package is not an edge. A package ``__init__`` that names
    its submodules in ``lazy_getattr`` strings does not import them."""
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        for target_mod, names, _ in _imports(mod, path):
            for target in _targets(target_mod, names, mods):
                if target != mod and not mod.startswith(target + "."):
                    graph.setdefault(mod, set()).add(target)
    return graph


def test_core_has_no_module_import_cycles():
    """Between modules too (imports inside functions included): data flows one way."""
    cycle = _find_cycle(_module_graph(CORE_MODULES))
    assert cycle is None, " -> ".join(cycle or [])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if state.get(n) is None:
            found = visit(n)
            if found:
                return found
    return None


def test_core_names_no_framework():
    frameworks = {"lightning", "pytorch_lightning", "accelerate", "deepspeed", "megatron", "transformers"}
    found = []
    for mod, path in CORE_MODULES.items():
        for target_mod, names, line in _imports(mod, path):
            top = target_mod.split(".")[0]
            plugin = target_mod.startswith("unickpt.") and target_mod.split(".")[1] in PLUGIN_NAMES
            if top in frameworks or plugin:
                found.append(f"{mod}:{line} imports {target_mod}")
    assert found == []


@pytest.mark.parametrize("plugin", PLUGIN_NAMES)
def test_plugins_use_only_the_public_names_and_ext(plugin):
    """A plugin imports ``unickpt`` (its public names), ``unickpt.ext`` (what it uses of the engine),
    ``unickpt.interop`` (what it implements: layouts, sources, conversions) and plugins, nothing else of
    the core."""
    sys.path.insert(0, CORE)  # read unickpt.__all__ without importing anything heavy
    try:
        import unickpt
        public = set(unickpt.__all__)
    finally:
        sys.path.remove(CORE)
    allowed = {f"unickpt.{p}" for p in PLUGIN_NAMES} | {"unickpt.ext", "unickpt.interop"}
    bad = []
    for mod, path in _modules(os.path.join(PLUGINS, plugin), f"unickpt.{plugin}").items():
        for target_mod, names, line in _imports(mod, path):
            if target_mod == "unickpt":
                bad += [f"{mod}:{line} from unickpt import {n}" for n in names
                        if n not in public and n != "ext" and f"unickpt.{n}" not in allowed]
            elif target_mod.startswith("unickpt.") and not any(  # the package of ext / interop, not its modules
                    target_mod == a or (a.removeprefix("unickpt.") in PLUGIN_NAMES and target_mod.startswith(a + "."))
                    for a in allowed):
                bad.append(f"{mod}:{line} imports {target_mod}")
    assert bad == []


def _plugin_graph(plugin_dir: str, package: str) -> dict[str, set[str]]:
    """``{module: modules of the same plugin it imports}`` (:func:`_module_graph`)."""
    return _module_graph(_modules(plugin_dir, package))


@pytest.mark.parametrize("plugin", PLUGIN_NAMES)
def test_plugins_have_no_module_import_cycles(plugin):
    """Within a plugin, data flows one way too: no cycle between its modules, function-level imports
    included (a lazy import would only hide one)."""
    cycle = _find_cycle(_plugin_graph(os.path.join(PLUGINS, plugin), f"unickpt.{plugin}"))
    assert cycle is None, " -> ".join(cycle or [])


MAX_CLASS_LINES = 300  # issue 32: a class longer than this holds more than one responsibility


def _long_classes(*bases: str) -> dict[str, int]:
    """``{"<file relative to the root>:<class>": lines}`` of the classes over MAX_CLASS_LINES lines."""
    out = {}
    for base in bases:
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    for node in ast.walk(ast.parse(open(path).read(), path)):
                        n = node.end_lineno - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
                        if n > MAX_CLASS_LINES:
                            out[f"{os.path.relpath(path, ROOT).replace(os.sep, '/')}:{node.name}"] = n
    return out


def test_no_class_is_over_300_lines():
    assert _long_classes(CORE, PLUGINS) == {}


def test_the_plugin_checks_see_a_cycle_and_a_long_class(tmp_path):
    """A function-level import closing a cycle and a 301-line class in a synthetic plugin are found;
    lazy_getattr strings of a package ``__init__`` are no edge."""
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from unickpt.ext import lazy_getattr\n"
                                     "__getattr__ = lazy_getattr(__name__, {'A': '.a', 'B': '.b'})\n")
    (pkg / "a.py").write_text("from .b import g\n\nclass A:\n" + "    x = 1\n" * 300)
    (pkg / "b.py").write_text("def g():\n    from . import a\n    return a\n")
    assert _find_cycle(_plugin_graph(str(pkg), "unickpt.demo")) == ["unickpt.demo.a", "unickpt.demo.b", "unickpt.demo.a"]
    assert {k.rsplit("/", 1)[-1]: n for k, n in _long_classes(str(pkg)).items()} == {"a.py:A": 301}
    (pkg / "b.py").write_text("def g():\n    return 1\n")
    assert _find_cycle(_plugin_graph(str(pkg), "unickpt.demo")) is None


def test_the_layer_test_sees_a_violation(tmp_path):
    """The checks above can fail: an upward import and a cycle in a synthetic tree are found."""
    pkg = tmp_path / "core"
    (pkg / "plan").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "__init__.py").write_text("")
    (pkg / "plan" / "x.py").write_text("def f():\n    from ..engine import get_engine\n")
    (pkg / "engine.py").write_text("from .plan import x\n")
    mods = _modules(str(pkg), "unickpt")
    ups = [(m, t) for m, p in mods.items() for tm, ns, _ in _imports(m, p) for t in _targets(tm, ns, mods)
           if _layer(t) > _layer(m)]
    assert ups == [("unickpt.plan.x", "unickpt.engine")]
    graph: dict[str, set[str]] = {}
    for m, p in mods.items():
        for tm, ns, _ in _imports(m, p):
            for t in _targets(tm, ns, mods):
                if t != m and not m.startswith(t + "."):
                    graph.setdefault(m, set()).add(t)
    assert _find_cycle(graph) == ["unickpt.engine", "unickpt.plan.x", "unickpt.engine"]
