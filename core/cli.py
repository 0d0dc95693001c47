"""The ``unickpt`` command: ``inspect``, ``verify`` or ``diff`` checkpoints, ``ls`` a checkpoint root."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .checkpointer import list_checkpoints
from .errors import UnickptError
from .metadata import read_metadata
from .storage import Storage
from .diff import diff_checkpoints
from .verify import verify_checkpoint

__all__ = ["main"]


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = Storage(args.path)
    if not storage.exists(storage.join(args.path, "metadata.json")) and list_checkpoints(args.path):
        raise UnickptError(f"{args.path!r} is a checkpoint root, not a checkpoint; "
                           f"see `unickpt ls {args.path}` and inspect one of its step_<N> directories")
    meta = read_metadata(storage, args.path)
    if args.json:
        print(storage.read_bytes(storage.join(args.path, "metadata.json")).decode())
        return 0
    total = sum(t.nbytes for t in meta.tensors.values())
    print(f"checkpoint  {args.path}")
    print(f"format      unickpt v{meta.format_version}   step {meta.step}   framework {meta.framework or '-'}")
    print(f"layout      {json.dumps(meta.layout)}")
    print(f"tensors     {len(meta.tensors)} ({_human(total)}), {len(meta.aliases)} aliases, "
          f"{len(meta.per_rank.get('fqns', []))} per-rank objects")
    rows = [(fqn, t.dtype, "x".join(map(str, t.shape)) or "scalar", str(len(t.chunks)), _human(t.nbytes))
            for fqn, t in sorted(meta.tensors.items())]
    rows += [(fqn, "alias", f"-> {target}", "", "") for fqn, target in sorted(meta.aliases.items())]
    header = ("fqn", "dtype", "shape", "chunks", "bytes")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(5)]
    print()
    for row in [header] + rows:
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    if args.chunks:
        print()
        for fqn, t in sorted(meta.tensors.items()):
            for c in t.chunks:
                print(f"{fqn}  {c.spec}  {c.file}@{c.byte_offset}+{c.byte_length}  {c.checksum}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    storage = Storage(args.root)
    if not storage.isdir(args.root):
        raise UnickptError(f"{args.root!r} is not a directory")
    entries = list_checkpoints(args.root)
    latest = None
    latest_path = storage.join(args.root, "latest")
    if storage.exists(latest_path):
        latest = storage.read_bytes(latest_path).decode().strip()
    rows = []
    for step, committed in entries:
        name = f"step_{step}"
        size = storage.du(storage.join(args.root, name))
        rows.append({"name": name, "step": step, "committed": committed, "bytes": size, "latest": name == latest})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no checkpoints under {args.root}")
        return 0
    print(f"{'checkpoint':<16}{'step':>10}  {'status':<11}{'size':>10}")
    for r in rows:
        status = "committed" if r["committed"] else "INCOMPLETE"
        mark = "  <- latest" if r["latest"] else ""
        print(f"{r['name']:<16}{r['step']:>10}  {status:<11}{_human(r['bytes']):>10}{mark}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    problems, checked = verify_checkpoint(args.path)
    if args.json:
        print(json.dumps({"path": args.path, "bytes_checked": checked, "ok": not problems,
                          "problems": [p.__dict__ for p in problems]}, indent=1))
    elif problems:
        print(f"{args.path}: {len(problems)} bad chunk(s) or file(s) ({_human(checked)} checked)")
        for p in problems:
            print(f"  {p.file}  [{p.key}]  {p.error}")
    else:
        print(f"{args.path}: OK ({_human(checked)} checked against their checksums)")
    return 1 if problems else 0


def cmd_diff(args: argparse.Namespace) -> int:
    diffs = diff_checkpoints(args.a, args.b, atol=args.atol)
    if args.json:
        print(json.dumps([d.__dict__ for d in diffs], indent=1))
    elif not diffs:
        print(f"identical: {args.a} and {args.b}" + (f" (atol {args.atol})" if args.atol else " (bitwise)"))
    else:
        width = max(len(d.key) for d in diffs)
        for d in diffs:
            print(f"{d.key:<{width}}  {d.kind:<13} {d.detail}")
    return 1 if diffs else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unickpt", description="Inspect and verify unickpt checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="show a checkpoint's step, layout and tensors")
    p.add_argument("path")
    p.add_argument("--chunks", action="store_true", help="also list every stored chunk")
    p.add_argument("--json", action="store_true", help="print metadata.json")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("verify", help="read every stored byte and check it against its checksum")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("diff", help="which keys, dtypes, shapes and values differ between two checkpoints")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="tolerate |a-b| up to this (default: bitwise)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_diff)
    p = sub.add_parser("ls", help="list the checkpoints under a root, committed or not")
    p.add_argument("root")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_ls)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (UnickptError, OSError, ValueError, KeyError, ImportError) as e:
        print(f"unickpt {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
