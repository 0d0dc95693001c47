"""The ``unickpt`` command: ``inspect``, ``verify``, ``diff``, ``export`` and ``import`` checkpoints,
``ls``, ``rm`` and ``prune`` them under a root. See docs/cli.md.

Exit codes: 0 success; 1 ``verify`` found damage or ``diff`` found differences; 2 an error (one line
on stderr, ``unickpt <command>: <message>``; ``--debug`` shows the traceback) or a usage error.
Progress bars (tqdm) go to stderr, only when it is a terminal and ``--quiet`` is not given.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import sys
from typing import Any, Callable, Iterator, Sequence

from ..errors import RankFailuresError, UnickptError
from ..lifecycle.directory import CheckpointDir
from ..lifecycle.root import list_checkpoints
from ..storage import open_storage
from .diff import diff_checkpoints
from .verify import verify_checkpoint

__all__ = ["main"]

EXIT_FOUND = 1  # verify: damage; diff: differences
EXIT_ERROR = 2
EXIT_PIPE = 128 + 13  # stdout's reader left (`unickpt ls | head`): what a shell reports for a SIGPIPE death


@contextlib.contextmanager
def _progress(args: argparse.Namespace, desc: str) -> Iterator[Callable[[int, int], None] | None]:
    """A ``progress(done, total)`` callback drawing a tqdm bar on stderr, or None when quiet, when
    stderr is not a terminal, or when tqdm is not installed."""
    if getattr(args, "quiet", False) or not sys.stderr.isatty():
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.refresh()  # the final state, even within tqdm's refresh interval

    try:
        yield update
    finally:
        bar.close()


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""


def _chunk_count(t: Any) -> str:
    """The chunks of a tensor, without reading index files: a split tensor (format v2) shows its rule."""
    if t.split is None:
        return str(len(t.explicit))
    return f"{t.split.nonempty(t.shape)} (split dim {t.split.dim} / {t.split.parts})"


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = open_storage(args.path)
    if storage.exists(args.path) and not storage.isdir(args.path):
        raise UnickptError(f"{args.path!r} is a file, not a checkpoint directory (a Lightning .ckpt written by "
                           "UnickptCheckpointIO packs one: load it with Lightning, or `unickpt import` other files)")
    ckpt = CheckpointDir(storage, args.path)
    if not ckpt.is_committed() and list_checkpoints(args.path):
        raise UnickptError(f"{args.path!r} is a checkpoint root, not a checkpoint; "
                           f"see `unickpt ls {args.path}` and inspect one of its step_<N> directories")
    meta = ckpt.read_metadata()
    if args.json:
        print(ckpt.metadata_bytes().decode())
        return 0
    total = sum(t.nbytes for t in meta.tensors.values())
    print(f"checkpoint  {args.path}")
    step = "-" if meta.step is None else meta.step
    print(f"format      unickpt v{meta.format_version}   step {step}   framework {meta.framework or '-'}")
    print(f"layout      {json.dumps(meta.layout)}")
    print(f"tensors     {len(meta.tensors)} ({_human(total)}), {len(meta.aliases)} aliases, "
          f"{len(meta.per_rank.get('fqns', []))} per-rank objects")
    rows = [(fqn, t.dtype, "x".join(map(str, t.shape)) or "scalar", _chunk_count(t), _human(t.nbytes))
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


def _memory_tiers(root: str, memory_dir: str | None) -> tuple[str | None, dict[int, dict]]:
    """This node's memory-tier copies of the run whose persistent root is ``root`` (docs/tiers.md):
    ``(run directory or None, {step: {"memory": {world: [ranks]}, "peer": {world: [ranks]}}})``."""
    from ..options import DEFAULT_MEMORY_DIR, env
    from ..tiers.node_dirs import RANK_DIR, MemoryLayout

    layout = MemoryLayout(memory_dir or env().memory_dir or DEFAULT_MEMORY_DIR, root)
    run = layout.run_dir
    if not os.path.isdir(run):
        return None, {}
    found: dict[int, dict] = {}
    for kind, tier in (("own", "memory"), ("peer", "peer")):
        kind_dir = os.path.join(run, kind)
        for name in sorted(os.listdir(kind_dir)) if os.path.isdir(kind_dir) else []:
            m = RANK_DIR.match(name)
            if not m:
                continue
            rank, world = int(m.group(1)), int(m.group(2))
            for step in layout.committed(kind, rank, world):
                found.setdefault(step, {"memory": {}, "peer": {}})[tier].setdefault(world, []).append(rank)
    return run, found


def _ranks(by_world: dict) -> str:
    """``ranks 0,1`` (``of 4`` when several world sizes are present)."""
    parts = [",".join(map(str, sorted(ranks))) + (f" of {w}" if len(by_world) > 1 else "")
             for w, ranks in sorted(by_world.items())]
    return "ranks " + "; ".join(parts)


def cmd_ls(args: argparse.Namespace) -> int:
    storage = open_storage(args.root)
    run, memory = _memory_tiers(args.root, args.memory_dir)
    persisted = storage.isdir(args.root)  # absent before the first persistent save of a tiered run
    if not persisted and not memory:
        raise UnickptError(f"{args.root!r} is not a directory, and this node's memory tiers hold no copies of it")
    entries = dict(list_checkpoints(args.root)) if persisted else {}
    latest = None
    latest_path = storage.join(args.root, "latest")
    if persisted and storage.exists(latest_path):
        latest = storage.read_bytes(latest_path).decode().strip()
    rows: list[dict[str, Any]] = []  # printed, or written as JSON
    for step in sorted(set(entries) | set(memory)):
        name = f"step_{step}"
        committed = entries.get(step)
        size = storage.du(storage.join(args.root, name)) if committed is not None else 0
        tiers = [] if not committed else ["storage"]
        mem = memory.get(step, {"memory": {}, "peer": {}})
        tiers += [t for t in ("memory", "peer") if mem[t]]
        row = {"name": name, "step": step, "committed": committed, "bytes": size, "latest": name == latest,
               "tiers": tiers}
        if run is not None:
            row["memory"] = {str(w): sorted(r) for w, r in mem["memory"].items()}
            row["peer"] = {str(w): sorted(r) for w, r in mem["peer"].items()}
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        hint = " (it is a checkpoint itself: see `unickpt inspect`)" if CheckpointDir(
            storage, args.root).is_committed() else ""
        print(f"no checkpoints under {args.root}{hint}")
        return 0
    if run is not None:
        print(f"memory tiers of this node: {run}")
    print(f"{'checkpoint':<16}{'step':>10}  {'status':<12}{'size':>10}  tiers")
    for r in rows:
        status = {True: "committed", False: "INCOMPLETE", None: "memory only"}[r["committed"]]
        where = ["storage"] if r["committed"] else []
        if run is not None and r["memory"]:
            where.append(f"memory ({_ranks({int(w): v for w, v in r['memory'].items()})})")
        if run is not None and r["peer"]:
            where.append(f"peer copies ({_ranks({int(w): v for w, v in r['peer'].items()})})")
        mark = "  <- latest" if r["latest"] else ""
        shown = _human(r["bytes"]) if r["committed"] is not None else "-"
        print(f"{r['name']:<16}{r['step']:>10}  {status:<12}{shown:>10}  {', '.join(where) or '-'}{mark}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with _progress(args, "verify") as progress:
        problems, checked = verify_checkpoint(args.path, progress=progress)
    if args.json:
        print(json.dumps({"path": args.path, "bytes_checked": checked, "ok": not problems,
                          "problems": [p.__dict__ for p in problems]}, indent=1))
    elif problems:
        print(f"{args.path}: {len(problems)} bad chunk(s) or file(s) ({_human(checked)} checked)")
        for p in problems:
            print(f"  {p.file}  [{p.key}]  {p.error}")
    else:
        print(f"{args.path}: OK ({_human(checked)} checked against their checksums)")
    return EXIT_FOUND if problems else 0


def cmd_diff(args: argparse.Namespace) -> int:
    with _progress(args, "diff") as progress:
        diffs = diff_checkpoints(args.a, args.b, atol=args.atol, allow_pickle=args.allow_pickle, progress=progress)
    if args.json:
        print(json.dumps([d.__dict__ for d in diffs], indent=1))
    elif not diffs:
        print(f"identical: {args.a} and {args.b}" + (f" (atol {args.atol})" if args.atol else " (bitwise)"))
    else:
        width = max(len(d.key) for d in diffs)
        for d in diffs:
            print(f"{d.key:<{width}}  {d.kind:<13} {d.detail}")
    return EXIT_FOUND if diffs else 0


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_checkpoint

    with _progress(args, "export") as progress:
        res = export_checkpoint(args.path, args.out, format=args.format, max_shard_size=args.max_shard_size,
                                dtype=args.dtype, keys=args.keys, strip_prefix=not args.keep_prefix,
                                progress=progress, to=args.to, model_config=_model_config(args.model_config))
    if args.json:
        print(json.dumps(res.as_dict(), indent=1))
    else:
        print(f"exported {len(res.weight_map)} tensors ({_human(res.total_bytes)}) to {res.out} as {res.format}: "
              f"{len(res.files)} file(s)" + (f" + {res.index}" if res.index else "")
              + "".join(f" + {f}" for f in res.extra_files))
    return 0


def _model_config(text: str | None) -> dict | None:
    """``--model-config``: a JSON object, or the path of a JSON file holding one."""
    if text is None:
        return None
    try:
        doc = json.loads(text) if text.lstrip().startswith("{") else json.load(open(text))
    except (OSError, ValueError) as e:
        raise UnickptError(f"--model-config {text!r} is neither a JSON object nor a JSON file ({e})") from None
    if not isinstance(doc, dict):
        raise UnickptError(f"--model-config must be a JSON object, got {type(doc).__name__}")
    return doc


def cmd_import(args: argparse.Namespace) -> int:
    from .importers import import_checkpoint

    res = import_checkpoint(args.src, args.out, source=args.source, allow_pickle=args.allow_pickle,
                            prefix=args.prefix, step=args.step, tag=args.tag, to=args.to,
                            model_config=_model_config(args.model_config))
    if args.json:
        print(json.dumps(res.as_dict(), indent=1))
    else:
        print(f"imported {res.source} checkpoint {res.src} -> {res.out}: {res.tensors} tensors "
              f"({_human(res.tensor_bytes)}), {res.objects} other values")
    return 0


def _print_removals(args: argparse.Namespace, removals: list) -> None:
    if args.json:
        print(json.dumps([r.__dict__ for r in removals], indent=1))
        return
    verb = "would remove" if args.dry_run else "removed"
    for r in removals:
        kind = "committed" if r.committed else "incomplete"
        print(f"{verb} {r.path} ({r.reason if r.reason.startswith(kind) else f'{kind}; {r.reason}'})")
    if not removals:
        print("nothing to remove")


def cmd_rm(args: argparse.Namespace) -> int:
    from ..lifecycle.root import remove_checkpoint

    removals, errors = [], []
    for path in args.paths:  # one refusal does not stop the others
        try:
            removals.append(remove_checkpoint(path, force=args.force, dry_run=args.dry_run))
        except (UnickptError, OSError) as e:
            errors.append(str(e))
    if removals or not errors:
        _print_removals(args, removals)
    for message in errors:
        print(f"unickpt rm: {message}", file=sys.stderr)
    return EXIT_ERROR if errors else 0


def cmd_prune(args: argparse.Namespace) -> int:
    from ..lifecycle.root import prune_checkpoints

    skipped: list[str] = []
    _print_removals(args, prune_checkpoints(args.root, args.keep_last, dry_run=args.dry_run, skipped=skipped))
    for reason in skipped:  # kept although due: say why, on stderr (the result is still a success)
        print(f"unickpt prune: kept {reason}", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unickpt", description="Inspect, verify, compare, convert and manage "
                                     "unickpt checkpoints (see docs/cli.md).")
    common = argparse.ArgumentParser(add_help=False)  # accepted before or after the command
    for parent, default in ((parser, False), (common, argparse.SUPPRESS)):
        parent.add_argument("-q", "--quiet", action="store_true", default=default, help="no progress bars")
        parent.add_argument("-v", "--verbose", action="store_true", default=default,
                            help="log unickpt's lines (one per save and load, at DEBUG)")
        parent.add_argument("--debug", action="store_true", default=default, help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    p = add("inspect", help="show a checkpoint's step, layout and tensors")
    p.add_argument("path")
    p.add_argument("--chunks", action="store_true", help="also list every stored chunk")
    p.add_argument("--json", action="store_true", help="print metadata.json")
    p.set_defaults(fn=cmd_inspect)
    p = add("verify", help="read every stored byte and check it against its checksum")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_verify)
    p = add("diff", help="which keys, dtypes, shapes and values differ between two checkpoints "
                         "(either may be of another format, as for import)")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="tolerate |a-b| up to this (default: bitwise)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="a or b is a checkpoint of another format whose reading unpickles (see import)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_diff)
    p = add("ls", help="list the checkpoints under a root, committed or not, and the tiers holding each step")
    p.add_argument("root")
    p.add_argument("--memory-dir", default=None,
                   help="base directory of the memory tiers on this node [UNICKPT_MEMORY_DIR or /dev/shm/unickpt]")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_ls)
    p = add("export", help="write a full, unsharded model in Hugging Face's layout")
    p.add_argument("path", help="a committed unickpt checkpoint")
    p.add_argument("out", help="output directory (created; must not hold model files yet)")
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    p.add_argument("--max-shard-size", default="5GB", help="bytes per file, e.g. 5GB (10^9), 2GiB (2^30) [5GB]")
    p.add_argument("--dtype", default=None, help="cast floating-point tensors: bf16, fp16 or fp32 [stored dtype]")
    p.add_argument("--keys", default=None, metavar="PREFIX",
                   help="only tensors under this fqn prefix (e.g. model), named without it")
    p.add_argument("--keep-prefix", action="store_true", help="with --keys: keep the prefix in the names")
    p.add_argument("--to", default=None, metavar="NAME",
                   help="convert to another framework's model (hf-llama: a megatron-core GPT as a Hugging Face "
                        "Llama folder with config.json); see docs/cross-framework.md")
    p.add_argument("--model-config", default=None, metavar="JSON",
                   help="with --to: what the stored shapes do not tell (JSON object or file), e.g. "
                        '\'{"num_attention_heads": 32}\'')
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_export)
    p = add("import", help="convert a torch / safetensors / HF / DCP / DeepSpeed / Megatron checkpoint")
    p.add_argument("src")
    p.add_argument("out", help="the new unickpt checkpoint directory")
    p.add_argument("--source", choices=("safetensors", "hf", "torch", "dcp", "megatron", "deepspeed"),
                   help="the kind of src [detected]")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow unpickling (DCP, DeepSpeed, Megatron, torch files with objects): only for trusted files")
    p.add_argument("--prefix", default=None, help="nest everything under this key (e.g. model)")
    p.add_argument("--step", type=int, default=None, help="step recorded in metadata.json")
    p.add_argument("--tag", default=None, help="DeepSpeed: the tag to import [the one `latest` names]")
    p.add_argument("--to", default=None, metavar="NAME",
                   help="write another framework's checkpoint layout (megatron: a Hugging Face Llama folder as a "
                        "megatron-core dist_checkpointing directory); see docs/cross-framework.md")
    p.add_argument("--model-config", default=None, metavar="JSON",
                   help="with --to: settings overriding the source's config.json (JSON object or file)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_import)
    p = add("rm", help="remove checkpoints (uncommit first; never one being written)")
    p.add_argument("paths", nargs="+")
    p.add_argument("--force", action="store_true", help="also the newest committed checkpoint of its root")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_rm)
    p = add("prune", help="retention: keep the newest N committed checkpoints, drop crashed saves")
    p.add_argument("root")
    p.add_argument("--keep-last", type=int, required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_prune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    args = _parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
        logging.getLogger("unickpt").setLevel(logging.DEBUG)
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, not at exit: a reader that left is seen below
        return code
    except BrokenPipeError as e:
        if not _stdout_closed():  # another pipe (a storage connection): an error like any other
            print(f"unickpt {args.command}: {_one_line(e)}", file=sys.stderr)
            return EXIT_ERROR
        return EXIT_PIPE  # the reader of stdout left (`| head`): stop quietly, as a command killed by SIGPIPE
    except BaseException as e:  # any failure is exit 2, never 1 (which means damage / differences found);
        # BaseException: torch's DCP CheckpointException derives from it
        if args.debug or isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        print(f"unickpt {args.command}: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone (its pipe is broken); if so, stdout is pointed at ``/dev/null``
    so that nothing more (the flush at exit) fails on it."""
    try:
        poller = select.poll()  # the write end of a pipe whose reader left reports POLLERR
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            return False
    except (AttributeError, OSError, ValueError):  # no poll() here, or no stdout file: assume it was stdout
        pass
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return True


def _one_line(e: BaseException) -> str:
    """The error as one line: its message (prefixed by its type unless it is a unickpt error or a
    usual OSError/ValueError), or, for a failed save/load, the headline plus each rank's exception
    line without the traceback (``--debug`` shows everything)."""
    if isinstance(e, RankFailuresError):
        text = str(e).splitlines()[0]
        for rank, failure in sorted(e.failures.items()):
            lines = failure.rstrip().splitlines()
            frames = [i for i, line in enumerate(lines) if line.startswith(" ")]
            text += f"; rank {rank}: " + " ".join(lines[frames[-1] + 1 if frames else 0 :])
    else:
        text = str(e)
        if not isinstance(e, (UnickptError, OSError, ValueError)) or not text.strip():
            text = f"{type(e).__name__}: {text}" if text.strip() else type(e).__name__
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
