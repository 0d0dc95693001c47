"""PyTorch's own DCP tests, run against DCP's ``FileSystemWriter/Reader`` (baseline) or with unickpt's
``StorageWriter/StorageReader`` swapped in (unickpt): the judge of "behaves exactly like DCP's
filesystem writer and reader".

Usage::

    .venv/bin/python tests/suites/torch_dcp.py --source DIR --mode baseline|unickpt [--json OUT]

``--source`` is a directory holding files of PyTorch's ``test/distributed/checkpoint/``, at the
tag matching the installed torch (``v2.13.0``): a developer gets them from a PyTorch checkout
(``git clone --depth 1 -b v2.13.0 https://github.com/pytorch/pytorch`` then pass
``pytorch/test/distributed/checkpoint``), or copies single files from there into a scratch
directory. They are never committed here. (The recorded results used ``test_file_system_checkpoint_cpu.py``,
``test_file_system_checkpoint.py`` and ``test_format_utils.py`` in versions from PyTorch's history
that import with torch 2.13's ``torch.testing._internal``: a newer ``test_format_utils.py`` needs
``HardwareClassification``, a newer ``e2e/test_e2e_save_and_load.py`` ``_get_device_type``, which
2.13 lacks.) The runner runs the CPU-runnable files among
:data:`FILES` that are present (gloo process groups, no CUDA): ``test_file_system_checkpoint_cpu.py``
(ShardedTensor save/load and resharding on 2 ranks, bytes, no-dist), ``test_file_system_checkpoint.py``
(no-dist; its NCCL tests skip), ``test_format_utils.py`` (``dcp_to_torch_save`` /
``torch_save_to_dcp``), and the others listed, whose CUDA-only tests are reported as skipped.
Its test modules import ``torch.testing._internal`` (shipped with torch) and need ``expecttest``.

In ``unickpt`` mode the pytest plugin ``tests/suites/unickpt_dcp_swap.py`` (``-p``) and, for the
spawned ranks of ``MultiProcessTestCase``, a generated ``sitecustomize.py`` (``UNICKPT_DCP_SWAP=1``)
replace DCP's writer and reader (see that module). Per-test outcomes come from pytest's junit XML;
each suite (file) runs in its own pytest process with a timeout (``--timeout-s``, default 1800 s),
a suite that times out counts as one error.

``run(mode, source)`` returns ``{"torch-dcp": {"passed", "failed", "skipped", "errors",
"failed_tests": [nodeids of failed and erroring tests], "passed_tests": [nodeids]}}``.
:data:`ACCEPTED` lists the tests expected to differ with unickpt, with the reason (none at present).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

SUITE = "torch-dcp"
HERE = os.path.dirname(os.path.abspath(__file__))
FILES = [
    "test_file_system_checkpoint_cpu.py",
    "test_file_system_checkpoint.py",
    "test_format_utils.py",
    "test_dtensor_checkpoint.py",
    "test_save_load_api.py",
    "test_state_dict_utils.py",
    "test_checkpoint.py",
    "test_fsdp_model_state.py",
    "test_list_stored_state_dict.py",
    "test_dcp_to_torch_save.py",
]
"""The files of ``test/distributed/checkpoint/`` this suite runs (those present in ``--source``)."""
MODES = ("baseline", "unickpt")
ACCEPTED: dict[str, str] = {}
"""Tests (nodeid suffixes) that pass at baseline and are expected to fail with unickpt, with the reason:
tests that match DCP's exact error text or inspect DCP's own file names (``.metadata``,
``__0_0.distcp``) would go here; none of the files above does."""
_SITECUSTOMIZE = "import os\nif os.environ.get('UNICKPT_DCP_SWAP') == '1':\n    import unickpt_dcp_swap\n"


def _env(mode: str, scratch: str) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    paths = []
    if mode == "unickpt":
        # only the plugin and the sitecustomize go on the path, copied into the scratch directory:
        # tests/suites itself holds lightning.py / accelerate.py, which would shadow those packages
        shutil.copy(os.path.join(HERE, "unickpt_dcp_swap.py"), os.path.join(scratch, "unickpt_dcp_swap.py"))
        with open(os.path.join(scratch, "sitecustomize.py"), "w") as f:
            f.write(_SITECUSTOMIZE)
        paths.append(scratch)
        env["UNICKPT_DCP_SWAP"] = "1"
    else:
        env.pop("UNICKPT_DCP_SWAP", None)
    rest = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    if paths or rest:
        env["PYTHONPATH"] = os.pathsep.join(paths + rest)
    return env


def _count(xml_path: str, file: str, out: dict) -> None:
    root = ET.parse(xml_path).getroot()
    for case in root.iter("testcase"):
        nodeid = f"{file}::{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "error" in kinds:
            out["errors"] += 1
            out["failed_tests"].append(nodeid)
        elif "failure" in kinds:
            out["failed"] += 1
            out["failed_tests"].append(nodeid)
        elif "skipped" in kinds:
            out["skipped"] += 1
        else:
            out["passed"] += 1
            out["passed_tests"].append(nodeid)


def run(mode: str, source: str, timeout_s: float = 1800.0, files: list[str] | None = None) -> dict:
    """Run the suite in ``mode`` ("baseline": DCP's own filesystem writer/reader; "unickpt": unickpt's
    swapped in) over the test files in ``source``. Returns ``{"torch-dcp": {"passed": int, "failed": int,
    "skipped": int, "errors": int, "failed_tests": [nodeid, ...], "passed_tests": [nodeid, ...]}}``. Raises ValueError for an unknown
    mode, FileNotFoundError when ``source`` holds none of :data:`FILES`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    present = [f for f in (files or FILES) if os.path.isfile(os.path.join(source, f))]
    if not present:
        raise FileNotFoundError(f"{source!r} holds none of {files or FILES} (PyTorch's test/distributed/checkpoint files)")
    if subprocess.run([sys.executable, "-c", "import expecttest"], capture_output=True).returncode:
        # torch.testing._internal's test-only import (not a dependency of the product)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "expecttest"], check=True)
    out = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failed_tests": [], "passed_tests": []}
    with tempfile.TemporaryDirectory(prefix="torch-dcp-suite-") as scratch:
        env = _env(mode, scratch)
        for file in present:
            xml_path = os.path.join(scratch, file + ".xml")
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", source,
                   f"--junitxml={xml_path}", "-o", "junit_family=xunit1", os.path.join(source, file)]
            if mode == "unickpt":
                cmd[3:3] = ["-p", "unickpt_dcp_swap"]
            try:
                subprocess.run(cmd, cwd=source, env=env, timeout=timeout_s, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                out["errors"] += 1
                out["failed_tests"].append(f"{file} (timed out after {timeout_s:.0f} s)")
                continue
            if not os.path.exists(xml_path):
                out["errors"] += 1
                out["failed_tests"].append(f"{file} (pytest wrote no report)")
                continue
            _count(xml_path, file, out)
    return {SUITE: out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="directory with PyTorch's test/distributed/checkpoint files")
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--json", help="write the result as JSON to this file")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per-file (suite) timeout")
    p.add_argument("--files", nargs="*", help="only these files of the source directory")
    args = p.parse_args(argv)
    result = run(args.mode, args.source, timeout_s=args.timeout_s, files=args.files)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
