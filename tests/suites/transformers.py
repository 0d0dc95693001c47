"""transformers' own Trainer checkpoint tests, run against transformers alone and with ``UNICKPT_TRANSFORMERS=1``.

The judge of ``unickpt.transformers`` is transformers' own test suite: every test that passes with
Trainer alone (``baseline``) must pass with the plugin switched on by the environment variable
(``unickpt``), except tests that mock or count ``torch.save`` / ``safe_save_file`` calls (listed in
``ACCEPTED`` with the reason).

Getting the sources (tests are not shipped in the wheel; use the tag of the installed transformers)::

    git clone --depth 1 --branch v5.24.0 https://github.com/huggingface/transformers /tmp/transformers

Running (from the repository root, with the project's virtual environment)::

    .venv/bin/python tests/suites/transformers.py --source /tmp/transformers --mode baseline --json base.json
    .venv/bin/python tests/suites/transformers.py --source /tmp/transformers --mode unickpt --json ours.json
    .venv/bin/python tests/suites/run_suites.py --transformers-src /tmp/transformers     # both, compared

Suites (files missing from the checkout are left out: the checkpoint tests moved from
``test_trainer.py`` to ``test_trainer_checkpointing.py`` in later versions):

- ``transformers-trainer-checkpointing``: ``tests/trainer/test_trainer_checkpointing.py`` and
  ``tests/trainer/test_trainer_resume.py``;
- ``transformers-trainer``: ``tests/trainer/test_trainer.py -k "checkpoint or resume or save"``;
- ``transformers-trainer-callback``: ``tests/trainer/test_trainer_callback.py -k "checkpoint or save or
  resume or Stateful"`` (with the stateful callbacks saved in ``trainer_state.json`` and restored on resume).

Each runs as one pytest subprocess (rootdir and cwd the checkout, junit XML for per-test outcomes)
under a per-suite timeout (``UNICKPT_SUITE_TIMEOUT_S``, default 1800 s), on the CPU
(``CUDA_VISIBLE_DEVICES=""``). Tests marked slow or needing the Hub run as transformers' own CI
decides (``RUN_SLOW`` unset: skipped).

``run(mode, source)`` returns ``{suite: counts}`` as :func:`junit_report.parse_junit` gives them.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from junit_report import empty_counts, print_counts, run_pytest  # noqa: E402 - the runners' shared junit reading

__all__ = ["SUITES", "ACCEPTED", "run", "run_suite", "main"]

SUITES: dict[str, tuple[list[str], str | None]] = {
    "transformers-trainer-checkpointing": (["tests/trainer/test_trainer_checkpointing.py",
                                            "tests/trainer/test_trainer_resume.py"], None),
    "transformers-trainer": (["tests/trainer/test_trainer.py"], "checkpoint or resume or save"),
    "transformers-trainer-callback": (["tests/trainer/test_trainer_callback.py"], "checkpoint or save or resume or Stateful"),
}
ACCEPTED: dict[str, str] = {}  # node-id fragment -> why it cannot pass with unickpt (none known yet)
MODES = ("baseline", "unickpt")


def _env(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICKPT_TRANSFORMERS")}
    if mode == "unickpt":
        env["UNICKPT_TRANSFORMERS"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["HF_HUB_OFFLINE"] = env.get("HF_HUB_OFFLINE", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_suite(name: str, mode: str, source: str, timeout_s: float | None = None) -> dict:
    """Run suite ``name`` in ``mode`` from the transformers checkout ``source``; its counts. A timeout
    counts as one error (``failed_tests`` names ``<suite timeout>``) on top of what had finished."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    root = Path(source).resolve()
    files, keyword = SUITES[name]
    present = [f for f in files if (root / f).is_file()]
    if not present:
        return empty_counts()
    timeout_s = timeout_s or float(os.environ.get("UNICKPT_SUITE_TIMEOUT_S", "1800"))
    with tempfile.TemporaryDirectory(prefix="unickpt-suite-") as tmp:
        xml_path = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", f"--junitxml={xml_path}",
               "-o", "junit_family=xunit2", "--rootdir", str(root), f"--basetemp={Path(tmp) / 'pytest'}",
               *(["-k", keyword] if keyword else []), *present]
        return run_pytest(cmd, root, _env(mode), xml_path, timeout_s)


def run(mode: str, source: str) -> dict:
    """Every suite in ``mode`` from the checkout ``source``: ``{suite: counts}``."""
    return {name: run_suite(name, mode, source) for name in SUITES}


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--source DIR --mode baseline|unickpt [--json OUT] [--suite NAME]``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True, help="a huggingface/transformers checkout (holding tests/trainer)")
    ap.add_argument("--mode", required=True, choices=MODES)
    ap.add_argument("--json", help="write the result dict here")
    ap.add_argument("--suite", action="append", choices=sorted(SUITES), help="only these suites (repeatable)")
    args = ap.parse_args(argv)
    result = {name: run_suite(name, args.mode, args.source) for name in (args.suite or SUITES)}
    print_counts(result, args.mode, ACCEPTED, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
