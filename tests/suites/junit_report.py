"""A framework's own pytest files run in a subprocess, and their per-test outcomes from its junit XML:
shared by the suite runners that launch them (``lightning.py``, ``transformers.py``)."""
from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["nodeid", "parse_junit", "empty_counts", "run_pytest", "print_counts"]


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


def run_pytest(cmd: list[str], cwd: Path, env: dict[str, str], xml_path: Path, timeout_s: float) -> dict:
    """Run ``cmd`` (pytest writing junit XML to ``xml_path``) in ``cwd``; its counts (:func:`parse_junit`).
    A run that wrote no report counts as one error naming the tail of its output; a timeout as one
    error (``<suite timeout after N s>``) on top of whatever had finished."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired as e:
        proc, timed_out = e, True  # type: ignore[assignment]
    if xml_path.is_file():
        result = parse_junit(xml_path)
    else:
        result = empty_counts()
        if not timed_out:
            tail = (getattr(proc, "stdout", "") or "")[-3000:] + (getattr(proc, "stderr", "") or "")[-3000:]
            result["errors"] += 1
            result["failed_tests"].append(f"<pytest produced no report: {tail.strip()}>")
    if timed_out:
        result["errors"] += 1
        result["failed_tests"].append(f"<suite timeout after {timeout_s:.0f} s>")
    return result


def print_counts(result: dict, mode: str, accepted: dict[str, str], json_path: str | None = None) -> None:
    """A runner's command-line report: one line per suite, one per failed test (with its accepted
    reason in ``unickpt`` mode), and the result dict written to ``json_path`` when given."""
    for name, r in result.items():
        print(f"{name} [{mode}]: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped, "
              f"{r['errors']} errors")
        for t in r["failed_tests"]:
            why = next((reason for frag, reason in accepted.items() if frag in t), None)
            print(f"    FAILED {t}" + (f"  [accepted with unickpt: {why}]" if why and mode == "unickpt" else ""))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
