"""megatron-core's own ``dist_checkpointing`` tests, run with megatron-core alone and with unickpt as the
default sharded save strategy.

The judge of ``unickpt.megatron`` is megatron-core's own test suite (Megatron-LM
``tests/unit_tests/dist_checkpointing``), run as Megatron's CI runs it (``torch.distributed.run
--nproc_per_node 8 -m pytest``, every rank a pytest process) on a CPU-only torch through the test-only
plugin ``tests/suites/megatron_cpu/unickpt_megatron_cpu.py`` (gloo, CPU tensors, CUDA calls stubbed;
see its docstring). Modes:

- ``baseline``: megatron-core alone (its conftest makes ``torch_dist`` the default sharded strategy);
- ``unickpt``: the same tests, no test file edited, after ``unickpt.megatron.launch.install()``, the
  switch behind ``--ckpt-format unickpt`` (the default ``torch_dist`` save strategy becomes unickpt's;
  tests that build ``TorchDistSaveShardedStrategy`` themselves still use torch_dist). The run fails
  unless unickpt really saved (the plugin counts its saves).

Suites (CPU subsets; a test that cannot run on the CPU fails or skips in both modes, the baseline
decides what counts)::

  megatron-dist-ckpt       test_serialization, test_async_save, test_torch_dist, test_nonpersistent,
                           test_global_metadata_reuse, test_checkpointable, test_safe_globals, test_mapping
  megatron-parallel-models test_fully_parallel, test_pipeline_parallel_layout, models/test_mlp_glu,
                           models/test_t5_model, test_optimizer (TestOptimizer, TestFP32Optimizer)

Getting the sources: the megatron-core sdist on PyPI holds no tests, so the runner takes ``--source DIR``,
an export of Megatron-LM at the installed version's tag (``core_v0.16.1``) with its tests and the
``megatron/training`` code they import, WITHOUT ``megatron/core`` (the installed megatron-core is the
one tested; ``megatron`` is a namespace package, so the two halves join)::

    mkdir -p /tmp/mlm && git -C MEGATRON_LM_GIT_DIR archive core_v0.16.1 tests/__init__.py tests/unit_tests \\
        tests/test_utils megatron/training megatron/legacy megatron/rl megatron/post_training | tar -x -C /tmp/mlm

Never commit them. Running (repository root, the project's virtual environment)::

    .venv/bin/python tests/suites/megatron.py --source /tmp/mlm --mode both [--json OUT]

How a run goes: the suite's test ids are collected once (one pytest process, ``--collect-only``); each
test file runs as one ``torchrun`` of 8 ranks; the plugin streams every rank's outcomes to a file as
they happen. A test counts as passed when it passed on every rank (some ranks may skip), as failed
when it failed on any (its first error line, from the lowest such rank, is kept). A run is killed
(every process of it, found by its environment) when no rank has recorded anything for
``UNICKPT_MCORE_TEST_TIMEOUT_S`` (default 300 s: the per-test timeout; ranks left waiting in a
collective that another rank never makes would otherwise wait for gloo's 30 minutes) or after
``UNICKPT_MCORE_FILE_TIMEOUT_S`` (default 1800 s). The tests it did not reach run in a new torchrun;
a test that some rank started but that did not finish runs alone (one torchrun, twice the per-test
timeout) and has failed with ``timeout`` if it hangs again; a test that fails after an earlier
failure of the same run (maybe its aftermath) runs once more in a fresh run, whose outcome counts.
No run waits forever.

``run(mode, source)`` returns ``{suite: {"passed", "failed", "skipped", "errors", "failed_tests",
"passed_tests", "errors_by_test", "tests", "seconds"}}``. ``ACCEPTED`` lists the tests that cannot pass
with unickpt and why (``run_suites.py`` and ``--mode both`` report them apart); any other test that
passes at baseline and not with unickpt makes ``--mode both`` exit 1. Import this file by path (its
name would shadow the ``megatron`` package on ``sys.path``), as ``run_suites.py`` does.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["SUITES", "ACCEPTED", "run", "run_suite", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN_DIR = os.path.join(HERE, "megatron_cpu")
NPROC = 8  # Megatron's CI runs the unit tests on 8 ranks (tests/unit_tests/run_ci_test.sh, GPUS_PER_NODE)
MODES = ("baseline", "unickpt")
_D = "tests/unit_tests/dist_checkpointing/"
SUITES: dict[str, list[list[str]]] = {  # one list per torchrun: pytest arguments
    "megatron-dist-ckpt": [[_D + f] for f in (
        "test_serialization.py", "test_async_save.py", "test_torch_dist.py", "test_nonpersistent.py",
        "test_global_metadata_reuse.py", "test_checkpointable.py", "test_safe_globals.py", "test_mapping.py")],
    "megatron-parallel-models": [[_D + "test_fully_parallel.py"], [_D + "test_pipeline_parallel_layout.py"],
                                 [_D + "models/test_mlp_glu.py"], [_D + "models/test_t5_model.py"],
                                 [_D + "test_optimizer.py::TestOptimizer", _D + "test_optimizer.py::TestFP32Optimizer"]],
}

_OWN_FILES = "opens torch_dist's own files after a default save ({}); unickpt writes metadata.json + unickpt/"
ACCEPTED: dict[str, str] = {  # test id fragment -> why it cannot pass with unickpt (each read in the test)
    "test_torch_dist.py::TestCachedMetadata::test_cached_metadata": _OWN_FILES.format("unpickles ckpt_dir/.metadata"),
    "test_torch_dist.py::TestCPUTensors::test_cpu_tensors_dont_take_too_much_space":
        _OWN_FILES.format("stats __0_0.distcp and __0_1.distcp"),
    "test_nonpersistent.py::TestNonPersistentSaveAndLoad::test_basic_save_load_scenarios":
        _OWN_FILES.format("compares every file of two checkpoints byte for byte but torch_dist's .metadata, so "
                          "the unickpt/ folder is compared as a file"),
    "test_global_metadata_reuse.py::": "asserts torch_dist's internal classes: the save and load strategies' "
        "cached_global_metadata / validated_loaded_metadata_reuse and torch DCP's _DistWrapper.reduce_scatter",
    # by design (docs/megatron.md): unickpt's metadata and objects are pickle-free, and a load never casts
    "test_serialization.py::TestSerialization::test_sharded_object_serialization":
        "saves an io.BytesIO in a ShardedObject, which has no tagged-JSON form: unickpt refuses the save unless "
        "pickles are allowed (UnickptSaveShardedStrategy(allow_pickle=True)); torch_dist pickles it silently",
    "test_serialization.py::TestSerialization::test_tensor_shape_mismatch":
        "loads int64 'keyB' (saved) into float32 tensors with allow_shape_mismatch: unickpt raises a "
        "CheckpointingException naming key, dtypes and shapes instead of casting; torch_dist casts",
}


def _timeout(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(mode: str, out: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNICKPT_MCORE_", "PYTEST_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([PLUGIN_DIR] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["UNICKPT_MCORE_OUT"] = out
    env["UNICKPT_MCORE_MODE"] = mode
    return env


def check_source(source: str) -> None:
    """Raise ValueError unless ``source`` holds Megatron's tests and megatron.training but not megatron/core."""
    for need in ("tests/unit_tests/conftest.py", _D + "conftest.py", "megatron/training/__init__.py"):
        if not os.path.exists(os.path.join(source, need)):
            raise ValueError(f"{source}: no {need} (export it as this file's docstring says)")
    if os.path.exists(os.path.join(source, "megatron", "core")):
        raise ValueError(f"{source}: holds megatron/core, which would shadow the installed megatron-core; "
                         "export without it")


def collect(source: str, args: list[str]) -> list[str]:
    """The test ids that ``pytest args`` selects (one process, no test runs)."""
    with tempfile.TemporaryDirectory(prefix="unickpt-mcore-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "unickpt_megatron_cpu", "-p", "no:cacheprovider",
                               "-o", "addopts=", "--collect-only", "-q", *args], cwd=source,
                              env=_env("baseline", tmp), capture_output=True, text=True, timeout=600)
    ids = [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise RuntimeError(f"collected no test from {args}:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return ids


def _kill_run(tmp: str) -> None:
    """SIGKILL every process of one run: those whose environment holds ``UNICKPT_MCORE_OUT=<tmp>``.
    torchrun starts its ranks in sessions of their own and megatron's checkpoint workers are spawned
    from the ranks, so neither killing torchrun's process group nor its children would reach them all."""
    mark = f"UNICKPT_MCORE_OUT={tmp}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    os.kill(int(pid), 9)
        except OSError:  # gone, or not ours to read
            pass


def _torchrun(mode: str, source: str, args: list[str], limit_s: int) -> tuple[dict, bool, str, int]:
    """One torchrun of ``NPROC`` pytest ranks; ``(per-rank records, timed out, output tail, unickpt saves)``.

    Killed (its whole process group) when no rank has recorded anything for ``UNICKPT_MCORE_TEST_TIMEOUT_S``
    (one test, or a desynchronized pair of them, runs that long: ranks wait in collectives that never
    complete, gloo's own timeout being 30 minutes) or when the run has lasted ``limit_s``."""
    stall_s = _timeout("UNICKPT_MCORE_TEST_TIMEOUT_S", 300)
    tmp = tempfile.mkdtemp(prefix="unickpt-mcore-")
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={NPROC}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "pytest", "-p", "unickpt_megatron_cpu",
               "-p", "no:cacheprovider", "-o", "addopts=", "-q", "-rfE", *args]
        env = _env(mode, tmp)
        env["UNICKPT_MCORE_TMP"] = tmp
        log_path = os.path.join(tmp, "output.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        start = last = time.monotonic()
        seen = 0.0
        timed_out = False
        while proc.poll() is None:
            time.sleep(2)
            now = time.monotonic()
            mtimes = [os.path.getmtime(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.endswith(".jsonl")]
            if mtimes and max(mtimes) > seen:
                seen, last = max(mtimes), now
            if now - last > stall_s or now - start > limit_s:
                _kill_run(tmp)
                proc.wait()
                timed_out = True
        _kill_run(tmp)  # a checkpoint worker left behind by a failed test
        with open(log_path, errors="replace") as f:
            output = f.read()[-6000:]
        records, saves = {}, 0
        for rank in range(NPROC):
            path = os.path.join(tmp, f"rank{rank}.jsonl")
            records[rank] = []
            if os.path.exists(path):
                for line in open(path):
                    try:
                        entry = json.loads(line)
                    except ValueError:  # a line cut short by the kill
                        continue
                    if "saves" in entry:
                        saves += entry["saves"]
                    else:
                        records[rank].append(entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftover worker may still be writing there
    sys.stderr.write(f"{mode} {args[0].split('::')[0]} ({len(args)} ids): {time.monotonic() - start:.0f} s"
                     f"{', killed (per-test or run timeout)' if timed_out else ''}\n")
    return records, timed_out, output, saves


def _outcomes(records: dict[int, list[dict]]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """``({test id: (outcome, first error line)}, test ids that some rank started)`` from the
    ranks' records; outcome ``passed`` / ``failed`` / ``skipped`` or ``incomplete`` (not finished on
    every rank)."""
    per_rank: dict[str, dict[int, tuple[str, str]]] = {}
    order: list[str] = []
    for rank, entries in records.items():
        for e in entries:
            nodeid = e["nodeid"]
            if e["when"] == "start":
                order.append(nodeid)
                per_rank.setdefault(nodeid, {})[rank] = ("incomplete", "")
                continue
            prev = per_rank.setdefault(nodeid, {}).get(rank, ("incomplete", ""))
            if e["outcome"] == "failed":
                if prev[0] != "failed":
                    per_rank[nodeid][rank] = ("failed", f"rank {rank}: {e['error']}")
            elif e["when"] == "teardown":
                if prev[0] == "incomplete":  # teardown ran without a call report: the setup skipped
                    per_rank[nodeid][rank] = ("skipped", "")
                elif prev[0] == "called":
                    per_rank[nodeid][rank] = ("passed", "")
            elif e["outcome"] == "skipped":
                per_rank[nodeid][rank] = ("skipped_", "")
            elif e["when"] == "call":
                per_rank[nodeid][rank] = ("called", "")
    out = {}
    for nodeid, ranks in per_rank.items():
        states = [ranks.get(r, ("incomplete", ""))for r in range(len(records))]
        kinds = {s[0].rstrip("_") for s in states}
        if "failed" in kinds:
            out[nodeid] = ("failed", next(s[1] for s in states if s[0] == "failed"))
        elif kinds & {"incomplete", "called"}:
            out[nodeid] = ("incomplete", "")
        elif "passed" in kinds:
            out[nodeid] = ("passed", "")
        else:
            out[nodeid] = ("skipped", "")
    return out, order


def run_suite(name: str, mode: str, source: str) -> dict:
    """Run one suite in ``mode``; ``{"passed", "failed", "skipped", "errors", "failed_tests", "passed_tests",
    "errors_by_test", "tests", "seconds", "saves"}`` (``errors_by_test``: test id -> first error line,
    ``"timeout"`` for a test that did not end alone within ``UNICKPT_MCORE_TEST_TIMEOUT_S``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    t0 = time.monotonic()
    final: dict[str, tuple[str, str]] = {}
    saves = 0
    collected = collect(source, [a for args in SUITES[name] for a in args])
    for args in SUITES[name]:
        remaining = [t for t in collected if any(t == a or t.startswith(a + "::") for a in args)]
        retried: set[str] = set()
        alone: list[str] = []
        while remaining:
            records, timed_out, tail, n = _torchrun(mode, source, remaining, _timeout("UNICKPT_MCORE_FILE_TIMEOUT_S", 1800))
            saves += n
            got, started = _outcomes(records)
            left, seen_failure = [], False
            for nodeid in remaining:
                outcome = got.get(nodeid, ("incomplete", ""))
                if outcome[0] == "incomplete":
                    (alone if nodeid in started else left).append(nodeid)  # hung or crashed in it / not reached
                elif outcome[0] == "failed" and seen_failure and nodeid not in retried:
                    left.append(nodeid)  # maybe the earlier failure's aftermath: once more, in a fresh run
                    retried.add(nodeid)
                else:
                    final[nodeid] = outcome
                seen_failure = seen_failure or outcome[0] == "failed"
            if timed_out or left:
                sys.stderr.write(f"--- {mode} {name}: {'killed; ' if timed_out else ''}{len(left)} test(s) in a new run, "
                                 f"{len(alone)} alone; output tail:\n{tail[-3000:]}\n")
            if left == remaining:  # no progress (the run did not start?): do not loop
                final.update((t, ("failed", "did not run: " + (tail.strip().splitlines() or [""])[-1][:200])) for t in left)
                break
            remaining = left
        for nodeid in alone:
            records, timed_out, tail, n = _torchrun(mode, source, [nodeid], 2 * _timeout("UNICKPT_MCORE_TEST_TIMEOUT_S", 300))
            saves += n
            outcome = _outcomes(records)[0].get(nodeid, ("incomplete", ""))
            final[nodeid] = ("failed", "timeout") if timed_out and outcome[0] == "incomplete" else \
                ("failed", "did not finish on every rank") if outcome[0] == "incomplete" else outcome
    progress = os.environ.get("UNICKPT_MCORE_PROGRESS")
    if progress:  # one line per test, for a reader that cannot wait for the end
        with open(progress, "a") as f:
            f.writelines(json.dumps({"mode": mode, "suite": name, "test": t, "outcome": o[0], "error": o[1]}) + "\n"
                         for t, o in sorted(final.items()))
    failed = sorted(t for t, o in final.items() if o[0] == "failed")
    return {"passed": sum(o[0] == "passed" for o in final.values()), "failed": len(failed),
            "skipped": sum(o[0] == "skipped" for o in final.values()), "errors": 0, "failed_tests": failed,
            "passed_tests": sorted(t for t, o in final.items() if o[0] == "passed"),
            "errors_by_test": {t: final[t][1] for t in failed}, "tests": len(final),
            "seconds": round(time.monotonic() - t0, 1), "saves": saves}


def run(mode: str, source: str | None = None, suites: list[str] | None = None) -> dict:
    """Every suite (or those named in ``suites``) in ``mode`` on the exported Megatron-LM sources in
    ``source`` (required: see the docstring). ``UNICKPT_MCORE_PROGRESS=FILE`` appends one JSON line per
    test outcome to FILE as each test file finishes.

    Raises RuntimeError in ``unickpt`` mode when unickpt saved nothing (the switch did not take)."""
    if not source:
        raise ValueError("megatron's tests are not in the megatron-core sdist: pass the exported sources "
                         "(see tests/suites/megatron.py's docstring)")
    check_source(source)
    results = {name: run_suite(name, mode, source) for name in suites or SUITES}
    if mode == "unickpt" and not sum(r["saves"] for r in results.values()):
        raise RuntimeError("unickpt mode saved nothing through unickpt: unickpt.megatron.launch.install() did not "
                           "take, or no test run reached a save through megatron's default strategy (the "
                           "megatron-parallel-models tests build their strategies themselves: run it with "
                           "megatron-dist-ckpt)")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=[*MODES, "both"], required=True)
    parser.add_argument("--source", required=True, help="exported Megatron-LM sources (see the docstring)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--suite", choices=list(SUITES), action="append", help="only these suites (default: all)")
    args = parser.parse_args(argv)
    modes = list(MODES) if args.mode == "both" else [args.mode]
    full = {m: run(m, args.source, args.suite) for m in modes}
    for m in modes:
        for name, r in full[m].items():
            print(f"{m:8s} {name:26s} {r['tests']:3d} tests {r['passed']:3d} passed {r['failed']:3d} failed "
                  f"{r['skipped']:3d} skipped  {r['seconds']:7.1f} s" + (f"  ({r['saves']} unickpt saves)" if m == "unickpt" else ""))
    report: dict = {m: full[m] for m in modes}
    status = 0
    if args.mode == "both":  # run_suites.py's report, loaded by path (tests/suites need not be on sys.path)
        compare_modes = runpy.run_path(os.path.join(HERE, "run_suites.py"))["compare_modes"]
        regressions, report["accepted"], status = compare_modes(full, ACCEPTED,
                                                                lambda why, error: error + (f"  [{why}]" if why else ""))
        report["regressions"] = list(regressions)  # the test ids only
    else:
        for name, r in full[args.mode].items():
            for t in r["failed_tests"]:
                print(f"    FAILED {t}: {r['errors_by_test'][t]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
