"""Lightning's own checkpoint tests, run against Lightning alone and with ``UNICKPT_LIGHTNING=1``.

The judge of ``unickpt.lightning`` is Lightning's own test suite: every test that passes with the
framework alone (``baseline``) must pass with the plugin switched on by the environment variable
(``unickpt``), except the kinds of difference named in ``docs/lightning.md`` (tests that count or
mock ``torch.save`` / ``TorchCheckpointIO`` calls). Tests that ``torch.load`` the ``.ckpt`` file
themselves pass: a pack is ``torch.save``'s zip archive (``unickpt/lightning/_torchzip.py``).

Getting the sources (tests are not shipped in the wheel; use the tag of the installed lightning,
2.6.6, or the nearest one present, 2.6.5)::

    git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    # or, from a bare mirror:
    git --git-dir=MIRROR archive 2.6.5 tests/tests_pytorch | tar -x -C /tmp/pl

Running (from the repository root, with the project's virtual environment)::

    .venv/bin/python tests/suites/lightning.py --source /tmp/pl --mode baseline --json base.json
    .venv/bin/python tests/suites/lightning.py --source /tmp/pl --mode unickpt --json ours.json

Suites: ``lightning-model-checkpoint`` (``checkpointing/test_model_checkpoint.py``) and
``lightning-checkpoint-misc`` (callback frequency, torch saving, trainer checkpoint, checkpoint-IO
plugin, async checkpoint, checkpoint connector). Each runs as one pytest subprocess (rootdir
``SOURCE/tests``, cwd a temporary folder, junit XML for per-test outcomes) under a per-suite timeout
(``UNICKPT_SUITE_TIMEOUT_S``, default 1800 s). Lightning's test-only imports (``cloudpickle``, ``tensorboardX``,
``jsonargparse``) are installed into the running interpreter's environment with pip when missing;
they are not dependencies of unickpt. Lightning's conftest restores the environment after each
test but keeps what was set before the session, so ``UNICKPT_LIGHTNING=1`` reaches every Trainer.

``run(mode, source)`` returns ``{suite: {"passed", "failed", "skipped", "errors", "failed_tests",
"passed_tests"}}`` (node ids of failed and errored tests, and of passed ones). ``ACCEPTED`` names the
tests that cannot pass with unickpt and why (``tests/suites/run_suites.py`` reports them apart).
The file is named after the framework; import it by path (as ``run_suites.py`` does), not with
``tests/suites`` on ``sys.path`` in a process that also imports the real ``lightning``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from junit_report import print_counts, run_pytest  # noqa: E402 - the runners' shared junit reading

__all__ = ["SUITES", "run", "run_suite", "main"]

SUITES: dict[str, list[str]] = {
    "lightning-model-checkpoint": ["tests_pytorch/checkpointing/test_model_checkpoint.py"],
    "lightning-checkpoint-misc": [
        "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
        "tests_pytorch/checkpointing/test_torch_saving.py",
        "tests_pytorch/checkpointing/test_trainer_checkpoint.py",
        "tests_pytorch/plugins/test_checkpoint_io_plugin.py",
        "tests_pytorch/plugins/test_async_checkpoint.py",
        "tests_pytorch/trainer/connectors/test_checkpoint_connector.py",
    ],
}
_COUNTS_SAVE = "mocks torch.save and counts its calls: unickpt writes without torch.save"
# accepted differences: node-id fragments -> why the test cannot pass with unickpt (see docs/lightning.md)
ACCEPTED: dict[str, str] = {
    "test_model_checkpoint.py::test_model_checkpoint_no_extraneous_invocations": _COUNTS_SAVE,
    "test_checkpoint_callback_frequency.py::test_default_checkpoint_freq": _COUNTS_SAVE,
    "test_checkpoint_callback_frequency.py::test_top_k": _COUNTS_SAVE,
    "test_trainer_checkpoint.py::test_trainer_save_checkpoint_storage_options":
        "mocks TorchCheckpointIO.save_checkpoint and expects its calls (and passes a str as storage_options, "
        "which unickpt rejects: it takes a dict of fsspec options)",
}
TEST_DEPS = {"cloudpickle": "cloudpickle", "jsonargparse": "jsonargparse", "tensorboardX": "tensorboardX"}  # module -> pip
MODES = ("baseline", "unickpt")


def _tests_dir(source: str) -> Path:
    """``SOURCE/tests`` (``SOURCE`` is a Lightning checkout, or its ``tests`` folder)."""
    root = Path(source).resolve()
    for cand in (root / "tests", root):
        if (cand / "tests_pytorch" / "conftest.py").is_file():
            return cand
    raise FileNotFoundError(f"{source!r} holds no tests/tests_pytorch/conftest.py (a Lightning source checkout)")


def _ensure_test_deps(python: str) -> None:
    """pip-install Lightning's test-only imports into ``python``'s environment when missing."""
    missing = []
    for module, dist in TEST_DEPS.items():
        probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True)
        if probe.returncode != 0:
            missing.append(dist)
    if missing:
        subprocess.run([python, "-m", "pip", "install", "-q", *missing], check=True)


def _env(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICKPT_LIGHTNING")}
    if mode == "unickpt":
        env["UNICKPT_LIGHTNING"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the source tree's conftest checks that tests leave no artifacts
    return env


def run_suite(name: str, mode: str, source: str, timeout_s: float | None = None, python: str | None = None,
              extra_args: list[str] | None = None) -> dict:
    """Run suite ``name`` in ``mode`` (``"baseline"`` or ``"unickpt"``) from Lightning sources
    ``source``; return its counts (see :func:`run`). A timeout counts as one error
    (``failed_tests`` names ``<suite timeout>``) on top of whatever had finished."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    python = python or sys.executable
    tests = _tests_dir(source)
    timeout_s = timeout_s or float(os.environ.get("UNICKPT_SUITE_TIMEOUT_S", "1800"))
    with tempfile.TemporaryDirectory(prefix="unickpt-suite-") as tmp:
        xml_path = Path(tmp) / "junit.xml"
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore",
               f"--junitxml={xml_path}", "-o", "junit_family=xunit2", "--rootdir", str(tests),
               f"--basetemp={Path(tmp) / 'pytest'}", *(str(tests / f) for f in SUITES[name]), *(extra_args or [])]
        work = Path(tmp) / "cwd"  # not the source tree: a logger writing "memory://x" makes a ./memory: folder,
        work.mkdir()  # which Lightning's conftest reports as an artifact left in its tests folder
        return run_pytest(cmd, work, _env(mode), xml_path, timeout_s)


def run(mode: str, source: str) -> dict:
    """Run every suite in ``mode`` (``"baseline"``: Lightning alone; ``"unickpt"``: with
    ``UNICKPT_LIGHTNING=1``) from the Lightning source tree ``source``.

    Returns ``{suite_name: {"passed": int, "failed": int, "skipped": int, "errors": int,
    "failed_tests": [nodeid, ...], "passed_tests": [nodeid, ...]}}``.
    """
    _ensure_test_deps(sys.executable)
    return {name: run_suite(name, mode, source) for name in SUITES}


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--source DIR --mode baseline|unickpt [--json OUT] [--suite NAME]``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True, help="Lightning source checkout (holding tests/tests_pytorch)")
    ap.add_argument("--mode", required=True, choices=MODES)
    ap.add_argument("--json", help="write the result dict here")
    ap.add_argument("--suite", action="append", choices=sorted(SUITES), help="only these suites (repeatable)")
    args = ap.parse_args(argv)
    _ensure_test_deps(sys.executable)
    result = {name: run_suite(name, args.mode, args.source) for name in (args.suite or SUITES)}
    print_counts(result, args.mode, ACCEPTED, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
