"""Accelerate's own checkpointing tests, run against Accelerate alone and through unickpt.

``UNICKPT_ACCELERATE=1`` must behave exactly as Accelerate's own ``save_state`` / ``load_state``;
Accelerate's test suite is the judge. This runner takes the tests from the sdist of the installed
Accelerate version (they are not in the wheel), runs two suites in a subprocess each, with the
variable unset (``baseline``) or set (``unickpt``), and reads every test's outcome from pytest's
junit XML:

  accelerate-state-checkpointing   tests/test_state_checkpointing.py
  accelerate-accelerator           tests/test_accelerator.py -k 'save or load or state or checkpoint'

Usage::

    .venv/bin/python tests/suites/accelerate.py --mode baseline|unickpt|both [--source DIR] [--json OUT]

Without ``--source`` the sdist is downloaded with pip from the package registry into a cache outside
the repository (``$UNICKPT_SUITE_CACHE``, default ``~/.cache/unickpt/suites``) and unpacked there.
``--mode both`` runs the baseline and unickpt and exits non-zero unless every test that passes with
Accelerate alone also passes through unickpt (CI does this). The suites need ``parameterized`` and, for
the stateful-dataloader tests, ``torchdata`` (install it with ``--no-deps``: it must not replace torch).

The file has no ``test_`` prefix, so the project's own pytest run does not collect it. Import it by
path (its name would shadow the ``accelerate`` package on ``sys.path``)::

    spec = importlib.util.spec_from_file_location("accelerate_suite", "tests/suites/accelerate.py")
    suite = importlib.util.module_from_spec(spec); spec.loader.exec_module(suite)
    suite.run("unickpt", source_dir)   # {suite_name: {"passed", "failed", "skipped", "errors", "failed_tests"}}
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib.metadata import version

SUITES = {
    "accelerate-state-checkpointing": ["tests/test_state_checkpointing.py"],
    "accelerate-accelerator": ["tests/test_accelerator.py", "-k", "save or load or state or checkpoint"],
}
TIMEOUT_S = {"accelerate-state-checkpointing": 300, "accelerate-accelerator": 300}  # per suite and mode
MODES = ("baseline", "unickpt")

# Tests of these suites that do not pass with Accelerate alone on a CPU-only machine, and why (they
# skip themselves; nothing is excluded by this runner, and CI compares against a baseline run).
KNOWN_NOT_PASSING_AT_BASELINE = {
    "tests/test_state_checkpointing.py::CheckpointTest_use_safetensors::test_map_location": "skipped: requires a GPU",
    "tests/test_state_checkpointing.py::CheckpointTest_use_pytorch::test_map_location": "skipped: requires a GPU",
    "tests/test_accelerator.py::AcceleratorTester::test_get_state_dict_from_offload_use_pytorch":
        "skipped: requires a GPU",
    "tests/test_accelerator.py::AcceleratorTester::test_get_state_dict_from_offload_use_safetensors":
        "skipped: requires a GPU",
}

ACCEPTED: dict[str, str] = {}  # differences accepted by run_suites.py (test -> reason): none

_PROBE = ("import accelerate\nfrom accelerate import Accelerator\n"
          "raise SystemExit(0 if getattr(Accelerator.save_state, '__unickpt__', False) else 3)")


def cache_dir() -> str:
    """Where downloaded sdists are unpacked (outside the repository)."""
    return os.environ.get("UNICKPT_SUITE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "unickpt",
                                                                  "suites")


def fetch_source(accelerate_version: str | None = None) -> str:
    """Download (once) and unpack the Accelerate sdist; return the unpacked folder (it holds ``tests/``).

    Uses ``pip download --no-deps --no-binary :all: accelerate==<version>`` of this interpreter; the
    version defaults to the installed Accelerate's."""
    ver = accelerate_version or version("accelerate")
    root = os.path.join(cache_dir(), f"accelerate-{ver}")
    src = os.path.join(root, f"accelerate-{ver}")
    if os.path.isdir(os.path.join(src, "tests")):
        return src
    os.makedirs(root, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"accelerate=={ver}", "-d", root], check=True)
    archive = os.path.join(root, f"accelerate-{ver}.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    if not os.path.isdir(os.path.join(src, "tests")):
        raise RuntimeError(f"{archive} holds no accelerate-{ver}/tests folder")
    return src


def _env(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICKPT_ACCELERATE")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTEST_ADDOPTS", None)
    if mode == "unickpt":
        env["UNICKPT_ACCELERATE"] = "1"
    return env


def _outcomes(xml_path: str) -> dict[str, str]:
    """``{nodeid: "passed" | "failed" | "error" | "skipped"}`` from pytest's junit XML."""
    out: dict[str, str] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = case.get("name", "")
        # classname is "tests.test_x.Class" (or "tests.test_x" for functions): back to a pytest nodeid
        file_parts = [p for p in module if not p[:1].isupper()]
        classes = [p for p in module if p[:1].isupper()]
        nodeid = "/".join(file_parts) + ".py" + "".join(f"::{c}" for c in classes) + f"::{name}"
        tags = {child.tag for child in case}
        if "error" in tags:
            outcome = "error"
        elif "failure" in tags:
            outcome = "failed"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        if out.get(nodeid) in ("failed", "error"):  # a teardown error after a pass/failure: keep the worst
            continue
        out[nodeid] = outcome
    return out


def run_suite(name: str, mode: str, source: str) -> dict:
    """Run one suite in ``mode``; returns ``{"passed", "failed", "skipped", "errors", "failed_tests",
    "outcomes", "seconds"}`` (``failed_tests``: nodeids that failed or errored)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    env = _env(mode)
    if mode == "unickpt":  # the suite must really go through unickpt, or it proves nothing
        probe = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=source, capture_output=True, text=True)
        if probe.returncode != 0:
            raise RuntimeError("UNICKPT_ACCELERATE=1 did not patch Accelerator.save_state (is unickpt installed "
                               f"with its startup hook?):\n{probe.stdout}{probe.stderr}")
    with tempfile.TemporaryDirectory(prefix="unickpt-suite-") as tmp:
        xml_path = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--junitxml={xml_path}", *SUITES[name]]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, cwd=source, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=TIMEOUT_S[name], start_new_session=True)
            output, timed_out = proc.stdout, False
        except subprocess.TimeoutExpired as e:
            output, timed_out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else \
                (e.stdout or ""), True
        seconds = round(time.monotonic() - t0, 1)
        outcomes = _outcomes(xml_path) if os.path.exists(xml_path) else {}
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped", "error")}
    failed = sorted(n for n, v in outcomes.items() if v in ("failed", "error"))
    if timed_out or not outcomes:
        counts["error"] += 1
        failed.append(f"{name}: {'timed out after %d s' % TIMEOUT_S[name] if timed_out else 'no junit XML'}")
    if failed:  # the failures' tracebacks, for the CI log
        sys.stderr.write(f"--- {mode} {name}: last lines of pytest's output ---\n{output[-12000:]}\n")
    return {"passed": counts["passed"], "failed": counts["failed"], "skipped": counts["skipped"],
            "errors": counts["error"], "failed_tests": failed, "outcomes": outcomes, "seconds": seconds}


def run(mode: str, source: str | None = None) -> dict:
    """Run every suite in ``mode`` (``"baseline"``: Accelerate alone, ``"unickpt"``:
    ``UNICKPT_ACCELERATE=1``) on the Accelerate sources in ``source`` (None: download them).

    Returns ``{suite_name: {"passed": int, "failed": int, "skipped": int, "errors": int,
    "failed_tests": [nodeids], "passed_tests": [nodeids]}}`` (``passed_tests`` lets
    ``run_suites.py`` compare test by test)."""
    source = source or fetch_source()
    results = {}
    for name in SUITES:
        r = run_suite(name, mode, source)
        results[name] = {k: r[k] for k in ("passed", "failed", "skipped", "errors", "failed_tests")}
        results[name]["passed_tests"] = sorted(n for n, v in r["outcomes"].items() if v == "passed")
    return results


def regressions(baseline: dict[str, dict[str, str]], unickpt: dict[str, dict[str, str]]) -> list[str]:
    """Tests that pass with Accelerate alone but not through unickpt (``{suite: outcomes}`` each)."""
    out = []
    for name, outcomes in baseline.items():
        for nodeid, outcome in sorted(outcomes.items()):
            if outcome == "passed" and unickpt.get(name, {}).get(nodeid) != "passed":
                out.append(f"{name}: {nodeid} ({unickpt.get(name, {}).get(nodeid, 'not run')} through unickpt)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=[*MODES, "both"], required=True)
    parser.add_argument("--source", help="unpacked Accelerate sdist (default: download it)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    source = args.source or fetch_source()
    modes = list(MODES) if args.mode == "both" else [args.mode]
    full = {m: {name: run_suite(name, m, source) for name in SUITES} for m in modes}
    report: dict = {}
    for m in modes:
        for name, r in full[m].items():
            print(f"{m:8s} {name:32s} {r['passed']:3d} passed {r['failed']:3d} failed {r['skipped']:3d} skipped "
                  f"{r['errors']:3d} errors  {r['seconds']:6.1f} s")
            for nodeid in r["failed_tests"]:
                print(f"         FAILED {nodeid}")
        report[m] = {name: {k: r[k] for k in ("passed", "failed", "skipped", "errors", "failed_tests", "seconds")}
                     for name, r in full[m].items()}
    status = 0
    if args.mode == "both":
        base = {name: r["outcomes"] for name, r in full["baseline"].items()}
        lost = regressions(base, {name: r["outcomes"] for name, r in full["unickpt"].items()})
        report["regressions"] = lost
        if not any(o == "passed" for outcomes in base.values() for o in outcomes.values()):
            print("no test passed at baseline: the suites did not run")
            status = 1
        for line in lost:
            print(f"REGRESSION {line}")
        status = status or (1 if lost else 0)
    else:
        status = 1 if any(r["failed"] or r["errors"] for r in full[args.mode].values()) else 0
    last = full[modes[-1]].values()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    print(f"accelerate-{modes[-1]}: {sum(r['passed'] for r in last)} passed, "
          f"{sum(r['failed'] + r['errors'] for r in last)} failed, {sum(r['skipped'] for r in last)} skipped")
    return status


if __name__ == "__main__":
    sys.exit(main())
