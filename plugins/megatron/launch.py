"""Launch an unmodified Megatron training script with ``--ckpt-format unickpt``.

::

    python -m unickpt.megatron.launch SCRIPT [ARGS...]
    torchrun --nproc_per_node 8 -m unickpt.megatron.launch pretrain_gpt.py --ckpt-format unickpt ...

Megatron-LM builds ``--ckpt-format`` from ``CheckpointConfig.ckpt_format: Literal[...]`` (argparse
``choices``, megatron/training/training_config.py in core_v0.16.1), so it rejects ``unickpt``, and its
save path is gated on ``ckpt_format == "torch_dist"`` (megatron/training/checkpointing.py). The launcher
therefore:

1. imports :mod:`unickpt.megatron` (registers the ``unickpt`` backend: loading any checkpoint whose
   ``metadata.json`` names it then works, with or without the flag);
2. when ``--ckpt-format unickpt`` (or ``--ckpt-format=unickpt``, or ``UNICKPT_MEGATRON=1`` in the
   environment) is given: rewrites the flag to ``--ckpt-format torch_dist`` (megatron's
   ``dist_checkpointing`` path: async save, fully parallel save/load wrappers all stay available) and
   calls :func:`install`, so that the default ``torch_dist`` save strategy is unickpt's;
3. runs ``SCRIPT`` as ``__main__`` with the rewritten ``sys.argv`` (``runpy.run_path``).
"""
from __future__ import annotations

import os
import runpy
import sys

__all__ = ["install", "uninstall", "rewrite_argv", "main", "FLAG", "FORMAT"]

FLAG, FORMAT = "--ckpt-format", "unickpt"
_ORIGINAL: dict = {}


def rewrite_argv(argv: list[str]) -> tuple[list[str], bool]:
    """``(argv with every --ckpt-format unickpt replaced by --ckpt-format torch_dist, whether unickpt is
    the format in effect)``. Follows argparse: the last ``--ckpt-format`` (``--ckpt-format X`` or
    ``--ckpt-format=X``) wins, so ``--ckpt-format unickpt ... --ckpt-format torch_dist`` means
    torch_dist, and nothing after a ``--`` separator is an option."""
    out, fmt, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out += argv[i:]
            break
        if a == FLAG and i + 1 < len(argv):
            fmt = argv[i + 1]
            out += [FLAG, "torch_dist" if fmt == FORMAT else fmt]
            i += 2
            continue
        if a.startswith(FLAG + "="):
            fmt = a[len(FLAG) + 1:]
            a = f"{FLAG}=torch_dist" if fmt == FORMAT else a
        out.append(a)
        i += 1
    return out, fmt == FORMAT


def install() -> None:
    """Make megatron-core's default ``torch_dist`` save strategy unickpt's (idempotent).

    Replaces ``get_default_save_sharded_strategy`` in ``megatron.core.dist_checkpointing.serialization``
    (used by ``dist_checkpointing.save`` when no strategy is passed), in the package
    ``megatron.core.dist_checkpointing``, and in every already imported module that holds the original
    (Megatron-LM's ``megatron.training.checkpointing`` imports it by name; imported after this call it
    gets the replacement anyway). Other backends are passed through unchanged.
    """
    import megatron.core.dist_checkpointing as mdc
    import megatron.core.dist_checkpointing.serialization as ser

    from .strategy import BACKEND, VERSION, UnickptSaveShardedStrategy, register

    register()
    if _ORIGINAL:
        return
    original = ser.get_default_save_sharded_strategy

    def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1):
        """unickpt's save strategy for ``torch_dist`` and ``unickpt``; other backends as before."""
        if backend in ("torch_dist", BACKEND):
            return UnickptSaveShardedStrategy(BACKEND, VERSION)
        return original(backend, version)

    _ORIGINAL["fn"] = original
    _ORIGINAL["modules"] = [m for m in list(sys.modules.values())
                            if getattr(m, "get_default_save_sharded_strategy", None) is original]
    for m in set(_ORIGINAL["modules"]) | {ser, mdc}:
        m.get_default_save_sharded_strategy = get_default_save_sharded_strategy


def uninstall() -> None:
    """Undo :func:`install` (the ``unickpt`` backend stays registered, so its checkpoints still load)."""
    if not _ORIGINAL:
        return
    import megatron.core.dist_checkpointing as mdc
    import megatron.core.dist_checkpointing.serialization as ser

    patched = ser.get_default_save_sharded_strategy
    for m in list(sys.modules.values()):
        if getattr(m, "get_default_save_sharded_strategy", None) is patched:
            setattr(m, "get_default_save_sharded_strategy", _ORIGINAL["fn"])
    for m in (ser, mdc):
        m.get_default_save_sharded_strategy = _ORIGINAL["fn"]
    _ORIGINAL.clear()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m unickpt.megatron.launch SCRIPT [ARGS...]`` (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit("usage: python -m unickpt.megatron.launch SCRIPT [ARGS...]  "
                         "(pass --ckpt-format unickpt to save Megatron checkpoints with unickpt)")
    script, rest = argv[0], argv[1:]
    rest, found = rewrite_argv(rest)
    import unickpt.megatron  # noqa: F401  (registers the backend: unickpt checkpoints load from their metadata)

    if found or os.environ.get("UNICKPT_MEGATRON") == "1":
        install()
    sys.argv = [script] + rest
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
