"""Run the frameworks' own checkpoint test suites, baseline and with unickpt switched on, and print
the comparison table (the judge of the plugins' drop-in claim).

Each framework's runner is a module beside this one with ``run(mode, source) -> {suite: counts}``
(``mode``: ``"baseline"``, the framework alone, or ``"unickpt"``, the same tests with unickpt
switched on as a user would; counts: ``passed``, ``failed``, ``skipped``, ``errors``,
``failed_tests``):

- ``lightning.py``: Lightning's ``tests/tests_pytorch`` checkpoint tests with ``UNICKPT_LIGHTNING=1``;
  ``--lightning-src``: a Lightning-AI/pytorch-lightning source tree at the installed version's tag;
- ``torch_dcp.py``: PyTorch's ``test/distributed/checkpoint`` CPU tests with ``FileSystemWriter/Reader``
  replaced by ``unickpt.fsdp.StorageWriter/Reader``; ``--torch-src``: a folder holding those files;
- ``accelerate.py``: Accelerate's ``tests/test_state_checkpointing.py`` and the save/load subset of
  ``tests/test_accelerator.py`` with ``UNICKPT_ACCELERATE=1``; downloads the accelerate sdist itself
  unless ``--accelerate-src`` is given (CI runs this one, see ``.ci/run``);
- ``deepspeed.py``: DeepSpeed's ``tests/unit/checkpoint`` on the CPU with ``"unickpt": {"enabled": true}``
  added to every ``deepspeed.initialize`` config; ``--deepspeed-src``: a folder holding DeepSpeed's
  ``tests/`` (exported with ``git archive``, see that file);
- ``megatron.py``: megatron-core's ``tests/unit_tests/dist_checkpointing`` (CPU subset, 8 ranks under
  torchrun) with unickpt as the default sharded save strategy; ``--megatron-src``: a folder holding
  Megatron-LM's tests and ``megatron/training`` at the installed version's tag (exported with
  ``git archive``, see that file).
- ``transformers.py``: transformers' Trainer checkpoint tests (``tests/trainer``) with
  ``UNICKPT_TRANSFORMERS=1``; ``--transformers-src``: a huggingface/transformers checkout at the
  installed version's tag.

The sources are fetched by the developer and never committed (see each runner's docstring).

    python tests/suites/run_suites.py --lightning-src /tmp/lightning --torch-src /tmp/torch-dcp-tests \\
        [--accelerate] [--json results.json]

Prints one row per suite: passed at baseline, passed with unickpt, and the tests that pass at baseline
but not with unickpt. Exit status 1 when there is such a test (an accepted difference is listed by
the runner in its ``ACCEPTED`` dict with its reason, and reported but not counted as a failure).
A runner's own ``--mode both`` (``deepspeed.py``, ``megatron.py``) prints its comparison with :func:`compare_modes`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def _runner(name: str):
    """The runner module ``tests/suites/<name>.py``, imported from its file under a name of its own
    (``lightning.py`` on ``sys.path`` would shadow the real ``lightning`` package, or be shadowed)."""
    spec = importlib.util.spec_from_file_location(f"unickpt_suite_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compare(runner_name: str, source: str | None) -> list[dict]:
    """Run one framework's suites in both modes; one row per suite."""
    runner = _runner(runner_name)
    base, ours = runner.run("baseline", source), runner.run("unickpt", source)
    accepted = getattr(runner, "ACCEPTED", {})
    rows = []
    for suite, b in base.items():
        u = ours.get(suite, {"passed": 0, "failed_tests": []})
        lost = sorted(set(b.get("passed_tests", [])) - set(u.get("passed_tests", []))) if "passed_tests" in b \
            else sorted(set(u.get("failed_tests", [])) - set(b.get("failed_tests", [])))
        rows.append({"suite": suite, "baseline_passed": b["passed"], "unickpt_passed": u["passed"],
                     "baseline": b, "unickpt": u,
                     "regressions": [t for t in lost if not any(t.endswith(a) or a in t for a in accepted)],
                     "accepted": {t: r for t in lost for a, r in accepted.items() if t.endswith(a) or a in t}})
    return rows


def compare_modes(full: dict, accepted: dict[str, str],
                  detail: Callable[[str | None, str], str]) -> tuple[dict[str, str], dict[str, str], int]:
    """The ``--mode both`` report of a runner's ``main`` over its results ``full`` (``{"baseline": {suite:
    counts}, "unickpt": {suite: counts}}``; counts with ``tests``, ``passed``, ``passed_tests``,
    ``errors_by_test`` and maybe ``skip_reasons``): prints one table row per suite, then one line per test
    that passes at baseline but not with unickpt, suite by suite and sorted (``accepted  `` or ``REGRESSION``,
    the test id and ``detail(reason, error)``). ``accepted``: the runner's ``ACCEPTED`` (test id fragment ->
    reason; the first fragment found in a test id gives its reason).

    Returns ``(regressions, accepted differences, exit status)``: those tests not accepted, each with its
    error with unickpt (the first error line, the skip reason or ``"not run"``), those accepted, each with
    its reason (both in the order printed), and 1 when there is a regression or no test passed at baseline
    (the suites did not run), else 0."""
    print("\n| suite | tests | baseline passed | with unickpt passed |\n|---|---|---|---|")
    lost: list[tuple[str, str | None, str]] = []
    for name, b in full["baseline"].items():
        u = full["unickpt"][name]
        print(f"| {name} | {b['tests']} | {b['passed']} | {u['passed']} |")
        lost += [(t, next((why for frag, why in accepted.items() if frag in t), None),
                  u["errors_by_test"].get(t, u.get("skip_reasons", {}).get(t, "not run")))
                 for t in sorted(set(b["passed_tests"]) - set(u["passed_tests"]))]
    for t, why, error in lost:
        print(f"{'accepted  ' if why else 'REGRESSION'} {t}: {detail(why, error)}")
    regressions = {t: error for t, why, error in lost if why is None}
    status = 1 if regressions else 0
    if not any(b["passed"] for b in full["baseline"].values()):
        print("no test passed at baseline: the suites did not run")
        status = 1
    return regressions, {t: why for t, why, _ in lost if why}, status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lightning-src")
    ap.add_argument("--torch-src")
    ap.add_argument("--accelerate", action="store_true", help="also run Accelerate's suites")
    ap.add_argument("--accelerate-src")
    ap.add_argument("--deepspeed-src")
    ap.add_argument("--megatron-src")
    ap.add_argument("--transformers-src")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    if args.lightning_src:
        rows += compare("lightning", args.lightning_src)
    if args.torch_src:
        rows += compare("torch_dcp", args.torch_src)
    if args.accelerate or args.accelerate_src:
        rows += compare("accelerate", args.accelerate_src)
    if args.deepspeed_src:
        rows += compare("deepspeed", args.deepspeed_src)
    if args.megatron_src:
        rows += compare("megatron", args.megatron_src)
    if args.transformers_src:
        rows += compare("transformers", args.transformers_src)
    if not rows:
        ap.error("name at least one suite source")
    print(f"\n| suite | baseline passed | with unickpt passed | regressions | accepted differences |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['suite']} | {r['baseline_passed']} | {r['unickpt_passed']} | {len(r['regressions'])} | "
              f"{len(r['accepted'])} |")
    for r in rows:
        for t in r["regressions"]:
            print(f"REGRESSION {r['suite']}: {t}")
        for t, why in r["accepted"].items():
            print(f"accepted   {r['suite']}: {t}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["regressions"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
