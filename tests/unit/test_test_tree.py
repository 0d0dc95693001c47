"""The test tree itself: pytest's default ``prepend`` import mode puts every test folder on ``sys.path``,
so two helper modules with one file name (``pipeline_workers.py`` in two folders) shadow each other:
a spawned worker process then imports the other folder's module and dies, failing every test of one
folder whenever the whole tree is collected (and never when that folder runs alone)."""
from __future__ import annotations

import collections
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_two_test_modules_share_a_file_name():
    seen = collections.defaultdict(list)
    for folder, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "suites")]  # suites/: imported by path only
        for name in files:
            if name.endswith(".py") and name not in ("conftest.py", "__init__.py"):
                seen[name].append(os.path.relpath(folder, TESTS))
    assert {n: f for n, f in seen.items() if len(f) > 1} == {}
