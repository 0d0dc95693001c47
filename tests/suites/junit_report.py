"""Per-test outcomes of a pytest run from its junit XML, shared by the suite runners that launch a
framework's own pytest files (``lightning.py``, ``transformers.py``)."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["nodeid", "parse_junit", "empty_counts"]


def empty_counts() -> dict:
    """The counts of a run that reported nothing."""
    return {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failed_tests": [], "passed_tests": []}


def nodeid(case: ET.Element) -> str:
    """pytest's node id from a junit ``testcase`` (classname = dotted module, then classes)."""
    cls, name = case.get("classname", ""), case.get("name", "")
    parts = cls.split(".") if cls else []
    while len(parts) > 1 and parts[-1][:1].isupper():  # trailing test classes
        parts = parts[:-1]
    classes = cls.split(".")[len(parts):] if cls else []
    module = "/".join(parts) + ".py" if parts else case.get("file", "")
    return "::".join([module, *classes, name])


def parse_junit(xml_path: Path) -> dict:
    """Per-test outcomes: a test counts once (a failure in the call and an error in its teardown
    are one failed test), as failed > error > skipped > passed."""
    rank = {"passed": 0, "skipped": 1, "errors": 2, "failed": 3}
    outcome: dict[str, str] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        kind = ("failed" if "failure" in kinds else "errors" if "error" in kinds else
                "skipped" if "skipped" in kinds else "passed")
        test = nodeid(case)
        if rank[kind] >= rank[outcome.get(test, "passed")]:
            outcome[test] = kind
    out = empty_counts()
    for test, kind in outcome.items():
        out[kind] += 1
        if kind in ("failed", "errors"):
            out["failed_tests"].append(test)
        elif kind == "passed":
            out["passed_tests"].append(test)
    return out
