"""The trust model of this plugin's checkpoints: which values need pickle, and the errors that name them.

Lightning's own checkpoints are ``torch.save`` pickles, read with ``torch.load(weights_only=...)``.
Here the tensor-free part of a checkpoint dict is tagged JSON (``unickpt.ext.Codec.encode``), where only
values of arbitrary classes are pickles (``{"__pickle__": {...}}``); :func:`pickled` finds them by
their key path inside the checkpoint, so an error says ``'hyper_parameters.args'``, not just the
top-level key. :func:`load_allowed` is ``UnickptCheckpointIO(allow_pickle=...)``'s rule.
"""
from __future__ import annotations

from typing import Any

from unickpt import UnsafeObjectError, ext

from ._tree import _ODICT_TAG

__all__ = ["load_allowed", "pickled", "unsafe_error", "refuse_pickles"]


def load_allowed(allow_pickle: bool | None, weights_only: bool | None) -> bool:
    """Whether a load may unpickle: ``allow_pickle`` when set, else what ``torch.load`` does
    (Lightning's trust model): only with ``weights_only=False``."""
    if allow_pickle is not None:
        return allow_pickle
    return weights_only is False


def pickled(encoded: Any, path: tuple = ()) -> list[tuple[str, str]]:
    """``(key path, class)`` of every pickled value in a codec-encoded checkpoint tree (for errors:
    ``hyper_parameters.args``, not just the top-level key)."""

    out: list[tuple[str, str]] = []
    if isinstance(encoded, list):
        for i, v in enumerate(encoded):
            out += pickled(v, path + (i,))
    elif isinstance(encoded, dict):
        if len(encoded) == 1:
            (tag, body), = encoded.items()
            if tag == "__pickle__":
                return [(".".join(map(str, path)) or "<root>", str(body.get("type")))]
            if tag in ("__tuple__", "__set__", "__frozenset__"):
                return pickled(body, path)
            if tag in ("__odict__", "__dict__"):
                for k, v in body:
                    try:
                        name = ext.Codec.decode(k)
                    except Exception:  # noqa: BLE001 - a pickled key: name it by position
                        name = "<key>"
                    out += pickled(v, path + (name,))
                return out
            if tag == _ODICT_TAG:
                return pickled(body.get("items"), path)
        for k, v in encoded.items():
            out += pickled(v, path + (k,))
    return out


def unsafe_error(path: str, found: list[tuple[str, str]], saving: bool) -> UnsafeObjectError:
    """The one-line error for pickled values in checkpoint ``path`` (``found`` from :func:`pickled`)."""
    key, cls = found[0]
    more = f" (and {len(found) - 1} more such value(s))" if len(found) > 1 else ""
    what = f"{path!r}: checkpoint key {key!r} holds an object of class {cls}{more}"
    if saving:
        return UnsafeObjectError(f"{what}, which only pickle can store, and UnickptCheckpointIO(allow_pickle=False) "
                                 "forbids pickle; use allow_pickle=None/True or keep only plain values there")
    return UnsafeObjectError(f"{what}, which only unpickling restores (it can execute code); if you trust this "
                             "checkpoint pass weights_only=False (trainer.fit/validate/test(ckpt_path=..., "
                             "weights_only=False), load_from_checkpoint(..., weights_only=False)) or use "
                             "UnickptCheckpointIO(allow_pickle=True)")


def refuse_pickles(path: str, tree: Any) -> None:
    """Raise :func:`unsafe_error` if the tensor-free ``tree`` holds a value only pickle can store."""
    found = pickled(ext.Codec.encode(tree, allow_pickle=True))
    if found:
        raise unsafe_error(path, found, saving=True)
