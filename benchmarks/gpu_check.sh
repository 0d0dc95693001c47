#!/usr/bin/env bash
# The device machine's one command (issue #23): check the Python environment, install this working tree
# without network, then run benchmarks/gpu_check.py (PYTHONUNBUFFERED=1), which writes $OUT/gpu_check.json
# (benchmarks/results/gpu_check.json without $OUT) and a copy of its output to $OUT/gpu_check.log.
#
#   bash benchmarks/gpu_check.sh [gpu_check.py arguments]       # e.g. --dry-run on a CPU machine
#
# Python: $PYTHON, else python3 on PATH (the device machine's, with torch + CUDA). Needs torch, numpy,
# fsspec and xxhash there (missing ones fail here, clearly, with a JSON saying so); torch_checkpointing
# is installed from .whl/ (pure Python, --no-deps) when it is not importable: the device has no network,
# so download the wheel here first (never committed; .whl/ is ignored) and carry it:
#   python3 -m pip download --no-deps -d .whl torch-checkpointing==0.1.1     # then run(..., carry=[".whl"])
# Exit code: gpu_check.py's (0 done, 1 a phase raised, 2 setup error, 3 watchdog), or 2 when the
# environment is unusable. The device image's python3 (3.12, /opt/torch/.venv) has torch, numpy, fsspec,
# xxhash, safetensors, setuptools and wheel; only torch_checkpointing travels (.whl/, carried).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/benchmarks/results}"
mkdir -p "$OUT_DIR"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
say() { echo "[gpu_check.sh] $*"; }
fail() {  # a JSON that says why, so that the run's files still explain it
    say "FAILED: $1"
    "$PY" - "$OUT_DIR/gpu_check.json" "$1" <<'EOF' 2>/dev/null || true
import json, sys
json.dump({"schema": "unickpt-gpu-check/1", "status": "error", "error": sys.argv[2]}, open(sys.argv[1], "w"))
EOF
    exit 2
}

command -v "$PY" >/dev/null 2>&1 || fail "no python: $PY"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # absolute, venv kept
say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
# 1. what unickpt needs at run time (torch, numpy, fsspec, xxhash); safetensors is optional
missing=$("$PY" - <<'EOF'
import importlib
bad = []
for m in ("torch", "numpy", "fsspec", "xxhash"):
    try:
        mod = importlib.import_module(m)
        print(f"[gpu_check.sh]   {m} {getattr(mod, '__version__', 'ok')}", flush=True)
    except Exception as e:
        bad.append(f"{m} ({type(e).__name__}: {e})")
import torch
print(f"[gpu_check.sh]   cuda available: {torch.cuda.is_available()}, torch.version.cuda: {torch.version.cuda}", flush=True)
print("MISSING " + "; ".join(bad) if bad else "MISSING-NONE")
EOF
)
echo "$missing" | grep -v '^MISSING' || true
echo "$missing" | grep -q '^MISSING-NONE' || fail "missing Python modules: $(echo "$missing" | grep '^MISSING' | cut -c9-)"

# 2. this tree, editable, without network; else an import path that maps 'unickpt' to core/
if "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e "$ROOT" >"$OUT_DIR/pip_install.log" 2>&1; then
    say "installed the tree editable (pip --no-deps --no-build-isolation --no-index -e .)"
else
    say "pip install -e failed (see pip_install.log); using an import path to core/ instead"
    SHIM="$(mktemp -d)/path"
    mkdir -p "$SHIM"
    ln -s "$ROOT/core" "$SHIM/unickpt"
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
where=$(cd /tmp && "$PY" -c 'import unickpt, os; print(os.path.realpath(unickpt.__file__))' 2>&1) || fail "import unickpt: $where"
case "$where" in
    "$ROOT"/*) say "unickpt from $where" ;;
    *) fail "import unickpt finds $where, not this tree ($ROOT)" ;;
esac

# 3. torch_checkpointing (a comparison system; optional): the wheel that travels with the tree
if ! "$PY" -c 'import torch_checkpointing' >/dev/null 2>&1; then
    whl=$(ls "$ROOT"/.whl/torch_checkpointing-*.whl 2>/dev/null | tail -1)
    if [ -n "$whl" ]; then
        if "$PY" -m pip install -q --no-deps --no-index "$whl" >>"$OUT_DIR/pip_install.log" 2>&1; then
            say "installed $(basename "$whl")"
        else  # a pure-Python wheel imports from the zip itself
            export PYTHONPATH="$whl${PYTHONPATH:+:$PYTHONPATH}"
            say "torch_checkpointing imported from $(basename "$whl") on PYTHONPATH"
        fi
    fi
fi
"$PY" -c 'import torch_checkpointing' >/dev/null 2>&1 && say "torch_checkpointing ok" \
    || say "torch_checkpointing not importable: that system is reported as skipped"

# 4. the check itself
say "running benchmarks/gpu_check.py $*"
"$PY" "$ROOT/benchmarks/gpu_check.py" --out "$OUT_DIR/gpu_check.json" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
rc=${PIPESTATUS[0]}
say "exit $rc; results in $OUT_DIR/gpu_check.json"
exit "$rc"
