"""DeepSpeed's own checkpoint tools on unickpt checkpoints: ``zero_to_fp32`` and ``ds_to_universal``.

DeepSpeed users take the weights out of a run with ``deepspeed.utils.zero_to_fp32``
(``get_fp32_state_dict_from_zero_checkpoint``, ``convert_zero_checkpoint_to_fp32_state_dict``,
``load_state_dict_from_zero_checkpoint``, and the copy of that file that DeepSpeed leaves in every
``save_dir``: ``python save_dir/zero_to_fp32.py save_dir out``), and change the parallel layout with
``deepspeed.checkpoint.ds_to_universal``. :func:`install` (called by
:func:`unickpt.deepspeed._activate.install`) makes them read unickpt checkpoints too; a folder without
``metadata.json`` goes to DeepSpeed's original functions unchanged:

- ``zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint(ds_checkpoint_dir, exclude_frozen_parameters)``,
  the function every public function of that module goes through, returns :func:`fp32_state_dict` for a
  unickpt checkpoint; DeepSpeed's own code then writes the files (``pytorch_model.bin`` or
  ``model.safetensors``, sharded with an index beyond ``max_shard_size``), so the outputs are DeepSpeed's.
- ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, ...)`` first waits for this
  process's asynchronous saves into ``checkpoint_dir`` (``save_checkpoint`` returns before its commit
  and before ``latest`` is written), so a tool called right after a save sees it.
- ``ds_to_universal.main(args)``: a unickpt checkpoint is universal already (every partition is stored
  in the coordinates of the original parameters); :func:`to_universal` makes ``args.output_folder`` a
  committed copy of it (hard links where possible) and writes ``latest_universal`` as DeepSpeed does.

The DeepSpeed modules are imported by ``import deepspeed`` already (deepspeed 0.19.8), so patching them
at install costs nothing. :func:`copy_recovery_script` (called at each commit of ``save_checkpoint``)
writes ``save_dir/zero_to_fp32.py``, a few lines calling :func:`zero_to_fp32_main` with DeepSpeed's
command-line arguments, and DeepSpeed's ``zero_to_torch.py`` beside it (which imports it).
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unickpt import ext

__all__ = ["install", "fp32_state_dict", "to_universal", "model_record", "copy_recovery_script",
           "zero_to_fp32_module", "zero_to_fp32_main", "is_unickpt_checkpoint", "RECOVERY_SCRIPT"]

_MARK = "__unickpt_wrapped__"
LATEST_UNIVERSAL = "latest_universal"  # DeepSpeed's name (ds_to_universal.py, main)
RECOVERY_SCRIPT = '''#!/usr/bin/env python
# Written by unickpt.deepspeed in place of DeepSpeed's zero_to_fp32.py, with its arguments and outputs:
# the consolidated fp32 weights of a checkpoint in this folder (unickpt's or DeepSpeed's own), e.g.
#   python zero_to_fp32.py . output_dir/ [--safe_serialization] [--max_shard_size 5GB] [-t TAG]
#                                        [--exclude_frozen_parameters]
import sys

from unickpt.deepspeed.tools import zero_to_fp32_main, zero_to_fp32_module

if __name__ == "__main__":
    zero_to_fp32_main()
else:  # imported as ``zero_to_fp32`` by DeepSpeed's zero_to_torch.py beside it: DeepSpeed's module, patched
    sys.modules[__name__] = zero_to_fp32_module()
'''


def install() -> None:
    """Patch ``deepspeed.utils.zero_to_fp32`` and ``deepspeed.checkpoint.ds_to_universal`` (idempotent)."""
    import deepspeed.checkpoint.ds_to_universal as universal
    import deepspeed.utils.zero_to_fp32 as z2f

    if getattr(z2f._get_fp32_state_dict_from_zero_checkpoint, _MARK, False):
        return
    z2f.get_fp32_state_dict_from_zero_checkpoint = _wrap(z2f.get_fp32_state_dict_from_zero_checkpoint,
                                                         _get_fp32_state_dict_from_zero_checkpoint)
    universal.main = _wrap(universal.main, _ds_to_universal_main)
    z2f._get_fp32_state_dict_from_zero_checkpoint = _wrap(z2f._get_fp32_state_dict_from_zero_checkpoint,
                                                          _read_fp32)  # last: marks the install as complete


def _wrap(original: Any, replacement: Any) -> Any:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return replacement(original, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    setattr(wrapper, "__unickpt_original__", original)
    return wrapper


def is_unickpt_checkpoint(path: Any) -> bool:
    """Whether the local folder ``path`` holds a unickpt checkpoint: committed (its ``metadata.json``), or
    a save not committed (yet), which the readers then refuse with CheckpointNotFoundError (a
    FileNotFoundError, as DeepSpeed's for missing files) instead of DeepSpeed's search for its own files."""
    from unickpt import ext

    path = os.fspath(path)
    if not (os.path.isdir(path) and os.listdir(path)):
        return False
    ckpt = ext.CheckpointDir(ext.open_storage(path), path)
    return ckpt.is_committed() or ckpt.is_incomplete()


def _wait_for_saves(save_dir: Any) -> None:
    """Wait for this process's asynchronous ``save_checkpoint`` calls into ``save_dir`` (their commit and
    ``latest``). A failed save is not raised here: it stays pending for the engine's next step boundary,
    as in :func:`unickpt.deepspeed.checkpoint_engine.wait_for_tag`, and the tool reads what is committed."""
    import sys

    if "unickpt.deepspeed.checkpoint_engine" not in sys.modules:  # no unickpt engine in this process
        return
    from .checkpoint_engine import _LIVE, wait_for_tag

    want = os.path.abspath(os.fspath(save_dir))
    for engine in list(_LIVE):
        for _, info in list(engine._pending):
            if os.path.abspath(os.fspath(info.save_dir)) == want:
                wait_for_tag(info.save_dir, info.tag)


def _get_fp32_state_dict_from_zero_checkpoint(original: Any, *args: Any, **kwargs: Any) -> Any:
    _wait_for_saves(args[0] if args else kwargs["checkpoint_dir"])
    return original(*args, **kwargs)


def _read_fp32(original: Any, ds_checkpoint_dir: Any, exclude_frozen_parameters: bool) -> Any:
    if not is_unickpt_checkpoint(ds_checkpoint_dir):
        return original(ds_checkpoint_dir, exclude_frozen_parameters)
    print(f"Processing unickpt checkpoint '{ds_checkpoint_dir}'")  # as DeepSpeed's function does
    return fp32_state_dict(os.fspath(ds_checkpoint_dir), exclude_frozen_parameters=exclude_frozen_parameters)


def fp32_state_dict(path: str, *, exclude_frozen_parameters: bool = False, verify: bool = True) -> dict:
    """The consolidated fp32 state dict of the unickpt DeepSpeed checkpoint ``path`` (one tag folder),
    read in this process alone (no process group), as DeepSpeed's ``zero_to_fp32`` builds it from its
    own files (``utils/zero_to_fp32.py``, ``_get_fp32_state_dict_from_zero2_checkpoint``): the
    persistent buffers first (floating ones as float32), then the frozen parameters in their stored
    dtype (unless ``exclude_frozen_parameters``), then every trainable parameter's fp32 master weights
    (``optimizer.fp32.<name>``), full tensors of the original shapes whatever the ZeRO stage and world
    size of the save; then each tied parameter's other names, mapped to the *same* tensor object
    (DeepSpeed's ``shared_params``). Returns an ordered ``{name: CPU tensor}``.

    Checkpoints written before the plugin recorded ``buffer_names`` / ``shared_params`` (in the
    ``deepspeed`` record) give their buffers as frozen parameters, uncast, and no tied names.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        StateMismatchError: the checkpoint was not written by ``unickpt.deepspeed``.
        IntegrityError: a stored byte fails its checksum (``verify``).
    """
    from collections import OrderedDict

    import torch

    from unickpt import StateMismatchError, ext

    meta = ext.CheckpointDir.open(path).read_metadata()
    if meta.framework != "deepspeed":
        raise StateMismatchError(f"{path!r} was written by {meta.framework or 'unickpt.save'}, not by "
                                 "unickpt.deepspeed: DeepSpeed's zero_to_fp32 reads DeepSpeed checkpoints only "
                                 "(use `unickpt export` for other checkpoints)")
    _, _, objects = ext.StateTools.saved_leaves(meta.state_tree)
    info = (ext.Codec.decode(objects["deepspeed"], key="deepspeed") if "deepspeed" in objects else None) or {}
    if not isinstance(info, dict):
        raise TypeError(f"{path!r}: 'deepspeed' is a {type(info).__name__}, not a dict")
    stored = list(meta.tensors) + [f for f in meta.aliases if f not in meta.tensors]

    def names(prefix: str) -> list[str]:
        return [f[len(prefix):] for f in stored if f.startswith(prefix)]

    def empty(fqn: str) -> torch.Tensor:
        t = meta.tensors[meta.aliases.get(fqn, fqn)]
        return torch.empty(tuple(t.shape), dtype=ext.Codec.str_to_dtype(t.dtype))

    trainable = names("optimizer.fp32.")
    module_names = names("module.")
    present = set(module_names)
    buffers = [n for n in info.get("buffer_names", []) if n in present]
    not_frozen = set(trainable) | set(buffers)
    frozen = [n for n in module_names if n not in not_frozen]
    wanted = buffers + ([] if exclude_frozen_parameters else frozen)
    state: dict[str, dict] = {"module": {n: empty(f"module.{n}") for n in wanted},
                              "optimizer": {"fp32": {n: empty(f"optimizer.fp32.{n}") for n in trainable}}}
    ext.load_solo(path, state, strict=False, verify=verify)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for n in buffers:
        t = state["module"][n]
        out[n] = t.float() if t.is_floating_point() else t
    for n in wanted[len(buffers):]:
        out[n] = state["module"][n]
    out.update(state["optimizer"]["fp32"])
    for alias, source in info.get("shared_params", []):
        if source in out:
            out[alias] = out[source]
    return out


def model_record(module: Any) -> dict:
    """What DeepSpeed's model-states file records for ``zero_to_fp32`` and unickpt's ``deepspeed`` record
    keeps too: ``buffer_names``, the persistent buffers in module order (``runtime/engine.py``,
    ``_get_buffer_names``), and ``shared_params``, ``[[name, name it is tied to], ...]`` for every
    parameter reachable under a second name (``_get_shared_params``; the first name is the one
    ``named_parameters()`` gives, under which the parameter is saved)."""
    buffers = [f"{m}.{b}" if m else b for m, mod in module.named_modules() for b, t in mod.named_buffers(recurse=False)
               if t is not None and b not in mod._non_persistent_buffers_set]
    first: dict[int, str] = {}
    shared = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared.append([name, first[id(p)]])
        else:
            first[id(p)] = name
    return {"buffer_names": buffers, "shared_params": shared}


# -- ds_to_universal ------------------------------------------------------------------------------
def _ds_to_universal_main(original: Any, args: Any) -> Any:
    src = os.fspath(args.input_folder)
    _wait_for_saves(os.path.dirname(os.path.abspath(src)))
    if not is_unickpt_checkpoint(src):
        return original(args)
    print(f"unickpt checkpoint {src} is universal already: committing a copy as {args.output_folder}")
    to_universal(src, os.fspath(args.output_folder))
    return None


def to_universal(src: str, dst: str) -> None:
    """``ds_to_universal`` for the unickpt checkpoint ``src``: ``dst`` becomes a committed copy of it
    (files hard-linked where the file system allows, else copied; ``metadata.json``, the commit, last),
    and ``<dst's parent>/latest_universal`` names it, as DeepSpeed's converter writes it
    (``checkpoint/ds_to_universal.py``, end of ``main``). A unickpt checkpoint needs no conversion: its
    partitions are stored in the coordinates of the original parameters, so ``load_checkpoint(save_dir,
    tag=<dst's name>)`` loads it at any data-parallel size or ZeRO stage, ``load_universal`` or not.
    A committed or incomplete unickpt checkpoint at ``dst`` is replaced.

    Raises:
        CheckpointNotFoundError: ``src`` holds no committed checkpoint.
        StateMismatchError: ``src`` was not written by ``unickpt.deepspeed``.
        CheckpointExistsError: ``dst`` is ``src``, or holds something other than a unickpt checkpoint.
    """
    import shutil

    from unickpt import CheckpointExistsError, StateMismatchError, ext

    meta = ext.CheckpointDir.open(src).read_metadata()
    if meta.framework != "deepspeed":
        raise StateMismatchError(f"{src!r} was written by {meta.framework or 'unickpt.save'}, not by "
                                 "unickpt.deepspeed")
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    storage = ext.open_storage(dst)
    if dst == src:
        raise CheckpointExistsError(f"ds_to_universal: the output folder {dst!r} is the input folder")
    source, target = ext.CheckpointDir(storage, src), ext.CheckpointDir(storage, dst)
    if os.path.lexists(dst):
        if not (target.is_committed() or target.is_incomplete()):
            raise CheckpointExistsError(f"ds_to_universal: {dst!r} exists and is not a unickpt checkpoint; "
                                        "remove it or choose another output folder")
        target.remove()
    os.makedirs(dst)
    for rel in source.files(with_marker=False):
        a, b = os.path.join(src, rel), os.path.join(dst, rel)
        os.makedirs(os.path.dirname(b), exist_ok=True)
        try:
            os.link(a, b)
        except OSError:  # another file system, or links not allowed
            shutil.copyfile(a, b)
            with open(b, "rb+") as f:
                os.fsync(f.fileno())
    target.commit(source.metadata_bytes())  # the commit, last
    root, name = os.path.split(dst)
    storage.write_atomic(os.path.join(root, LATEST_UNIVERSAL), name.encode())


# -- the recovery script ------------------------------------------------------------------------------
def copy_recovery_script(storage: ext.StorageBackend, save_dir: str) -> None:
    """Group rank 0, at the commit of ``save_checkpoint``: ``save_dir/zero_to_fp32.py``
    (:data:`RECOVERY_SCRIPT`) and DeepSpeed's ``zero_to_torch.py`` (which imports it), executable, as
    DeepSpeed's ``_copy_recovery_script`` leaves them (``runtime/engine.py``)."""
    import deepspeed.utils

    with open(os.path.join(os.path.dirname(deepspeed.utils.__file__), "zero_to_torch.py"), "rb") as f:
        to_torch = f.read()
    for name, data in (("zero_to_fp32.py", RECOVERY_SCRIPT.encode()), ("zero_to_torch.py", to_torch)):
        path = storage.join(save_dir, name)
        storage.write_atomic(path, data)
        if storage.is_local:
            local = storage.strip(path)
            os.chmod(local, os.stat(local).st_mode | 0o111)


def zero_to_fp32_module() -> Any:
    """``deepspeed.utils.zero_to_fp32``, patched (:func:`install`)."""
    import deepspeed.utils.zero_to_fp32 as z2f

    install()
    return z2f


def zero_to_fp32_main(argv: list[str] | None = None) -> None:
    """``python save_dir/zero_to_fp32.py``: DeepSpeed's command line (``utils/zero_to_fp32.py``,
    ``__main__``: ``checkpoint_dir output_dir [--max_shard_size 5GB] [--safe_serialization] [-t TAG]
    [--exclude_frozen_parameters] [-d]``) running DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict``,
    which reads unickpt checkpoints through :func:`install` and DeepSpeed's own unchanged."""
    import argparse

    z2f = zero_to_fp32_module()
    parser = argparse.ArgumentParser(description="the consolidated fp32 weights of a DeepSpeed checkpoint "
                                                 "(unickpt's or DeepSpeed's own)")
    parser.add_argument("checkpoint_dir", type=str, help="the save_dir, e.g., path/checkpoint-12")
    parser.add_argument("output_dir", type=str, help="directory to the pytorch fp32 state_dict output files")
    parser.add_argument("--max_shard_size", type=str, default="5GB",
                        help="the maximum size of a shard (digits followed by a unit, like 5MB)")
    parser.add_argument("--safe_serialization", default=False, action="store_true",
                        help="save with safetensors instead of torch.save (pickle)")
    parser.add_argument("-t", "--tag", type=str, default=None, help="checkpoint tag, e.g., global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="enable debug")
    args = parser.parse_args(argv)
    z2f.debug = args.debug
    z2f.convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                                   max_shard_size=args.max_shard_size,
                                                   safe_serialization=args.safe_serialization, tag=args.tag,
                                                   exclude_frozen_parameters=args.exclude_frozen_parameters)
