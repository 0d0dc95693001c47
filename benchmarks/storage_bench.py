"""Storage benchmark: unickpt save and load throughput on local disk vs an S3-compatible server.

The S3 server is moto's server mode on 127.0.0.1 (started here), reached through s3fs, so the
numbers measure unickpt's object-store path (multipart uploads, ranged GETs, retries) plus the
local server's own cost — not a real network. One process; the state is one float32 tensor per
64 MiB. Output: JSON (``--out``) and a printed table.

Run: ``python benchmarks/storage_bench.py [--size-mb 256] [--repeats 3]``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch

import unickpt

HERE = os.path.dirname(os.path.abspath(__file__))


def _state(size_mb: float) -> dict:
    n = max(1, int(size_mb * 1e6 / (64 << 20)))
    per = int(size_mb * 1e6 / 4 / n)
    return {f"t{i}": torch.randn(per, generator=torch.Generator().manual_seed(i)) for i in range(n)}


def _measure(root: str, state: dict, repeats: int, options: dict | None) -> dict:
    nbytes = sum(t.numel() * 4 for t in state.values())
    saves, loads = [], []
    for i in range(repeats):
        path = f"{root}/c{i}"
        t0 = time.perf_counter()
        unickpt.save(path, state, storage_options=options)
        saves.append(time.perf_counter() - t0)
        out = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        unickpt.load(path, out, storage_options=options)
        loads.append(time.perf_counter() - t0)
        assert all(torch.equal(out[k], state[k]) for k in state)
    return {"bytes": nbytes, "save_s": statistics.median(saves), "load_s": statistics.median(loads),
            "save_gbps": nbytes / statistics.median(saves) / 1e9, "load_gbps": nbytes / statistics.median(loads) / 1e9,
            "save_samples_s": saves, "load_samples_s": loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "storage.json"))
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer
    import s3fs

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}, "use_listings_cache": False}
    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket="bench")
    local = tempfile.mkdtemp(prefix="unickpt_storagebench_")
    state = _state(args.size_mb)
    try:
        results = {"local": _measure(local, state, args.repeats, None),
                   "s3 (moto on 127.0.0.1)": _measure("s3://bench/run", state, args.repeats, options)}
    finally:
        server.stop()
        shutil.rmtree(local, ignore_errors=True)
    print(f"{'storage':<24}{'MB':>8}{'save s':>9}{'save GB/s':>11}{'load s':>9}{'load GB/s':>11}")
    for name, r in results.items():
        print(f"{name:<24}{r['bytes'] / 1e6:>8.0f}{r['save_s']:>9.2f}{r['save_gbps']:>11.2f}{r['load_s']:>9.2f}"
              f"{r['load_gbps']:>11.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__}, "results": results,
                   "notes": "sync saves (fsync locally; multipart upload + size check on S3); loads verify checksums"},
                  f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
