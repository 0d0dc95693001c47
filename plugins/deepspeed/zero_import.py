"""Reading a native DeepSpeed ZeRO checkpoint (any stage) for ``unickpt import``.

The model weights are consolidated to fp32 full tensors with DeepSpeed's own
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (the script DeepSpeed
copies next to every checkpoint), which merges the ZeRO partitions of every DP rank; optimizer
state (moments) is not imported. DeepSpeed's files are pickles, so the caller must have allowed
unpickling (``unickpt import --allow-pickle``).
"""
from __future__ import annotations

import contextlib
import os
import sys

from unickpt.interop import Source

__all__ = ["read_zero_checkpoint", "SOURCE"]


def read_zero_checkpoint(src: str, tag: str | None = None) -> dict:
    """``{param fqn: fp32 tensor}`` of the ZeRO checkpoint ``src``.

    Args:
        src: DeepSpeed's ``save_dir`` (holding ``latest`` and one directory per tag), or one tag
            directory (holding ``*model_states.pt``, ``*optim_states.pt``).
        tag: the tag to read when ``src`` is a ``save_dir`` (default: the one ``latest`` names).

    Raises FileNotFoundError / ValueError from DeepSpeed for a missing tag or incomplete files.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src = os.path.abspath(src)
    if tag is None and not os.path.isfile(os.path.join(src, "latest")) and \
            any(n.endswith("model_states.pt") for n in os.listdir(src)):
        src, tag = os.path.dirname(src), os.path.basename(src)
    with contextlib.redirect_stdout(sys.stderr):  # zero_to_fp32 prints its progress
        state = get_fp32_state_dict_from_zero_checkpoint(src, tag=tag)
    return dict(state)


def _detect(src: str) -> bool:
    """A directory holding ``*model_states.pt``, or DeepSpeed's ``save_dir`` whose ``latest`` tag does."""
    names = os.listdir(src)
    if any(n.endswith("model_states.pt") for n in names):
        return True
    if "latest" in names:
        with open(os.path.join(src, "latest")) as f:
            tag = f.read().strip()
        tag_dir = os.path.join(src, tag)
        return os.path.isdir(tag_dir) and any(n.endswith("model_states.pt") for n in os.listdir(tag_dir))
    return False


def _read(src: str, tag: str | None) -> dict:
    try:
        import deepspeed.utils.zero_to_fp32  # noqa: F401
    except ImportError as e:
        from unickpt import UnickptError

        raise UnickptError(f"importing a DeepSpeed checkpoint needs DeepSpeed (pip install 'unickpt[deepspeed]'): {e}") from None
    return read_zero_checkpoint(src, tag=tag)


SOURCE = Source("deepspeed", _detect, _read, needs_pickle="its *_states.pt files are pickles")
"""``unickpt import --source deepspeed`` (entry-point group ``unickpt.sources``)."""
