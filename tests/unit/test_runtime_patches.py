"""The table "Runtime patches" of docs/design.md is true: every place in core/ and plugins/ where unickpt
replaces something of torch, a framework or the standard library at run time is a row of it, and every
row is still in the code. Read from the sources with ``ast``, nothing is imported.

What counts as a patch (the rule of :func:`found_patches`): in a module of core/ or plugins/,

* an assignment (``x.attr = ...``, also in a tuple target) or ``setattr(x, "attr", ...)`` where ``x``
  names something of a module that is not unickpt's: a name bound by ``import`` / ``from ... import``
  of such a module, an attribute chain of one, or a local alias of one (``cls = mod.Class``; a ``for``
  variable over a literal of them; over ``sys.modules``: every module, written ``*.attr``). The
  target is the dotted path (``deepspeed.runtime.engine.DeepSpeedEngine.step``); ``fn.__code__ = ...``
  patches ``fn`` itself. Attributes named ``_unickpt*`` / ``__unickpt*`` are unickpt's own marks on a
  patched object, not patches;
* a call that installs a process hook: ``atexit.register`` (also as a decorator), ``signal.signal``,
  ``sys.meta_path.insert`` / ``.append``.

Each is found with the unickpt function holding it (``unickpt.deepspeed._activate.install``; the module
itself for code run at import). A found patch is documented when a row names its target and the
function in its "installed by" or "undone by" column. Not seen by the rule: attributes set on the
result of a call (``z2f = zero_to_fp32_module(); z2f.debug = ...``) and on instances passed in.
"""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DESIGN = os.path.join(ROOT, "docs", "design.md")
HOOK_CALLS = {"atexit.register", "signal.signal", "sys.meta_path.insert", "sys.meta_path.append"}


def _sources() -> dict[str, str]:
    """``{unickpt module name: file}`` of core/ (``unickpt``) and plugins/<fw>/ (``unickpt.<fw>``)."""
    out = {}
    for top in ("core", "plugins"):
        base = os.path.join(ROOT, top)
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            rel = os.path.relpath(dirpath, base)
            prefix = "unickpt" if rel == "." else "unickpt." + rel.replace(os.sep, ".")
            for f in sorted(files):
                if f.endswith(".py") and not (top == "plugins" and rel == "."):
                    out[prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"] = os.path.join(dirpath, f)
    return out


class _Scanner:
    """One module's patches: walks each scope (module, function) with the foreign names it sees."""

    def __init__(self, module: str, tree: ast.Module):
        self.module = module
        self.found: set[tuple[str, str]] = set()
        # module-level string constants (``_MARK = "__unickpt_wrapped__"``), for setattr's name
        self.consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                       and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                       for t in n.targets if isinstance(t, ast.Name)}
        self._scope(tree.body, {}, module)

    def _scope(self, body: list[ast.stmt], outer: dict[str, set[str]], where: str) -> None:
        env = dict(outer)  # name -> the dotted paths it may stand for ("*": any module)
        nodes = [n for stmt in body for n in self._walk(stmt)]
        for n in nodes:  # bindings first (flow-insensitive: enough for install functions)
            if isinstance(n, ast.Import):
                for a in n.names:
                    if not self._ours(a.name, 0):
                        env[a.asname or a.name.split(".")[0]] = {a.name if a.asname else a.name.split(".")[0]}
            elif isinstance(n, ast.ImportFrom) and not self._ours(n.module or "", n.level):
                env.update({a.asname or a.name: {f"{n.module}.{a.name}"} for a in n.names})
        for _ in range(2):  # aliases of aliases
            for n in nodes:
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        self._bind(t, n.value, env)
                elif isinstance(n, ast.For) and isinstance(n.target, ast.Name):
                    paths = self._iterated(n.iter, env)
                    if paths:  # a variable of several loops stands for what each walks
                        env[n.target.id] = env.get(n.target.id, set()) | paths
        for n in nodes:
            if isinstance(n, (ast.Assign, ast.AnnAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(e, ast.Attribute):
                            self._add(self._paths(e.value, env), e.attr, where)
            elif isinstance(n, ast.Call):
                func = self._paths(n.func, env)
                if func & HOOK_CALLS:
                    self.found.update((f, where) for f in func & HOOK_CALLS)
                elif (isinstance(n.func, ast.Name) and n.func.id == "setattr" and len(n.args) == 3
                      and not isinstance(n.args[0], ast.Subscript)):
                    name = n.args[1]
                    attr = name.value if isinstance(name, ast.Constant) else self.consts.get(getattr(name, "id", ""))
                    if isinstance(attr, str):
                        self._add(self._paths(n.args[0], env), attr, where)
        for stmt in body:
            self._defs(stmt, env, where)

    def _defs(self, stmt: ast.stmt, env: dict[str, set[str]], where: str) -> None:
        """Scan the functions and classes under ``stmt`` (a function's nested defs belong to it)."""
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in stmt.decorator_list:
                if self._paths(d, env) & HOOK_CALLS:
                    self.found.update((f, where) for f in self._paths(d, env) & HOOK_CALLS)
            inner = where if where != self.module else f"{where}.{stmt.name}"
            self._scope(stmt.body, env, inner)
        elif isinstance(stmt, ast.ClassDef):
            for s in stmt.body:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self._scope(s.body, env, f"{where}.{stmt.name}.{s.name}" if where == self.module else where)
        else:
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.stmt):
                    self._defs(child, env, where)

    @staticmethod
    def _walk(stmt: ast.stmt):
        """The nodes of ``stmt`` outside nested functions and classes."""
        todo = [] if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else [stmt]
        while todo:
            n = todo.pop()
            yield n
            todo += [c for c in ast.iter_child_nodes(n)
                     if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))]

    @staticmethod
    def _ours(module: str, level: int) -> bool:
        return level > 0 or module == "unickpt" or module.startswith("unickpt.") or module == "__future__"

    def _bind(self, target: ast.expr, value: ast.expr, env: dict[str, set[str]]) -> None:
        if isinstance(target, ast.Name):
            paths = self._paths(value, env)
            if paths:
                env[target.id] = paths
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v, env)

    def _paths(self, e: ast.expr, env: dict[str, set[str]]) -> set[str]:
        """The dotted paths a Name / attribute chain stands for (empty: not foreign)."""
        if isinstance(e, ast.Name):
            return env.get(e.id, set())
        if isinstance(e, ast.Attribute):
            return {f"{p}.{e.attr}" for p in self._paths(e.value, env)}
        return set()

    def _iterated(self, it: ast.expr, env: dict[str, set[str]]) -> set[str]:
        """What a ``for`` variable over ``it`` stands for: the foreign elements of a literal (also
        inside ``set(...)``, ``list(...)``, ``a | b``); every module for a walk of ``sys.modules``."""
        if any(self._paths(n, env) & {"sys.modules"} for n in ast.walk(it) if isinstance(n, ast.Attribute)):
            return {"*"}
        if isinstance(it, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(self._paths(e, env) for e in it.elts))
        if isinstance(it, ast.BinOp):
            return self._iterated(it.left, env) | self._iterated(it.right, env)
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id in ("set", "list", "tuple"):
            return set().union(*(self._iterated(a, env) for a in it.args))
        return set()

    def _add(self, paths: set[str], attr: str, where: str) -> None:
        if attr.startswith(("_unickpt", "__unickpt")):
            return
        for p in paths:
            self.found.add((p if attr == "__code__" else f"{p}.{attr}", where))


def found_patches() -> set[tuple[str, str]]:
    """``(patched target, unickpt function or module that does it)`` for every patch in core/ and plugins/."""
    out: set[tuple[str, str]] = set()
    for module, path in _sources().items():
        with open(path) as f:
            out |= _Scanner(module, ast.parse(f.read(), path)).found
    return out


def table_rows() -> list[dict[str, set[str]]]:
    """The rows of docs/design.md's "Runtime patches" table: the backticked names of the columns
    "patched" (targets), "installed by" and "undone by"."""
    with open(DESIGN) as f:
        text = f.read()
    section = re.search(r"^## Runtime patches\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/design.md has no section '## Runtime patches'"
    lines = [ln for ln in section.group(1).splitlines() if ln.startswith("|")]
    header = [c.strip().lower() for c in lines[0].strip("|").split("|")]
    col = {name: header.index(name) for name in ("patched", "installed by", "undone by")}
    rows = []
    for ln in lines[2:]:
        cells = ln.strip().strip("|").split("|")
        rows.append({name: set(re.findall(r"`([^`]+)`", cells[i])) for name, i in col.items()})
    return rows


def _documents(row: dict[str, set[str]], target: str, where: str) -> bool:
    if target.startswith("*."):
        named = any(t.endswith(target[1:]) for t in row["patched"])
    else:
        named = target in row["patched"]
    return named and where in row["installed by"] | row["undone by"]


def test_every_runtime_patch_is_in_the_table():
    rows = table_rows()
    missing = sorted(f"{target} (by {where})" for target, where in found_patches()
                     if not any(_documents(row, target, where) for row in rows))
    assert missing == [], "runtime patches missing from docs/design.md 'Runtime patches': " + ", ".join(missing)


def test_every_row_of_the_table_is_in_the_code():
    found = found_patches()
    stale = [f"{t} by {sorted(row['installed by'])}" for row in table_rows() for t in sorted(row["patched"])
             if not any(target == t and where in row["installed by"] for target, where in found)]
    assert stale == [], "rows of docs/design.md 'Runtime patches' not found in the code: " + ", ".join(stale)


def test_the_scan_sees_each_kind_of_patch():
    """The rule finds what it claims on a synthetic module, and nothing in ordinary code."""
    src = '''
import atexit, signal, sys
import torch.distributed.distributed_c10d as c10d
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from . import sibling
_MARK = "__unickpt_mark__"

def install():
    import deepspeed.runtime.engine as ds
    cls = ds.DeepSpeedEngine
    cls.step, cls.save_checkpoint = 1, 2
    fn = c10d.destroy_process_group
    fn.__code__ = None
    setattr(fn, _MARK, True)
    c10d._unickpt_helper = None
    for k in (FSDPStrategy, ModelParallelStrategy):
        setattr(k, "setup", None)
    for m in list(sys.modules.values()):
        m.get_default = None
    atexit.register(print)
    signal.signal(signal.SIGTERM, print)

@atexit.register
def _at_exit():
    sibling.value = 1
    x = torch_free = object()
    x.attr = 1
    sys.modules["unickpt"].name = 1

class Hooks:
    def __init__(self):
        self.attr = 1
        sys.meta_path.insert(0, self)
'''
    found = _Scanner("unickpt.x", ast.parse(src)).found
    assert found == {
        ("deepspeed.runtime.engine.DeepSpeedEngine.step", "unickpt.x.install"),
        ("deepspeed.runtime.engine.DeepSpeedEngine.save_checkpoint", "unickpt.x.install"),
        ("torch.distributed.distributed_c10d.destroy_process_group", "unickpt.x.install"),
        ("lightning.pytorch.strategies.FSDPStrategy.setup", "unickpt.x.install"),
        ("lightning.pytorch.strategies.ModelParallelStrategy.setup", "unickpt.x.install"),
        ("*.get_default", "unickpt.x.install"),
        ("atexit.register", "unickpt.x.install"),
        ("signal.signal", "unickpt.x.install"),
        ("atexit.register", "unickpt.x"),
        ("sys.meta_path.insert", "unickpt.x.Hooks.__init__"),
    }
