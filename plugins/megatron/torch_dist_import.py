"""Reading a native megatron-core ``torch_dist`` checkpoint for ``unickpt import`` (``--source megatron``).

A ``torch_dist`` checkpoint is a torch DCP directory (``.metadata``, ``__<rank>_<i>.distcp``) plus
megatron-core's ``common.pt`` (the non-sharded objects, a ``torch.save`` pickle) and a ``metadata.json``
naming the backend (``{"sharded_backend": "torch_dist", ...}``). The sharded tensors and objects are read
whole (keys as megatron-core stored them, whatever the saved sharding) with torch's own DCP reader, and
``common.pt`` goes under the key ``common``. Both are pickles, so the caller must have allowed unpickling
(``unickpt import --allow-pickle``). ``zarr`` checkpoints need megatron-core < 0.16 to convert first.
Registered under the entry-point group ``unickpt.sources``; runs on the caller's thread, no collective.
"""
from __future__ import annotations

import json
import os

from megatron.core.dist_checkpointing.core import CONFIG_FNAME as _MARKER  # megatron-core's own marker file

from unickpt import UnickptError
from unickpt.interop import Source, read_dcp, torch_load

__all__ = ["read_torch_dist", "SOURCE"]


def _marker(src: str) -> dict | None:
    try:
        with open(os.path.join(src, _MARKER)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _detect(src: str) -> bool:
    """A directory whose ``metadata.json`` is megatron-core's (it names a ``sharded_backend``)."""
    doc = _marker(src)
    return doc is not None and "sharded_backend" in doc


def read_torch_dist(src: str, tag: str | None = None) -> dict:
    """Sharded tensors and objects of the ``torch_dist`` checkpoint ``src`` (keys as megatron-core stored
    them) plus ``common.pt`` under ``common``. ``tag`` is not used (a Megatron iteration directory is
    one checkpoint). Raises UnickptError for another backend, a key named ``common``, or unreadable files."""
    backend = (_marker(src) or {}).get("sharded_backend")
    if backend != "torch_dist":
        raise UnickptError(f"{src}: Megatron sharded_backend {backend!r} is not supported (only 'torch_dist'; "
                           "zarr checkpoints need megatron-core < 0.16 to convert first)")
    state = read_dcp(src)
    common = os.path.join(src, "common.pt")
    if os.path.exists(common):
        if "common" in state:
            raise UnickptError(f"{src}: a sharded key is named 'common', which would clash with common.pt")
        state["common"] = torch_load(common, allow_pickle=True)
    return state


SOURCE = Source("megatron", _detect, read_torch_dist, needs_pickle="its .metadata and common.pt are pickles")
"""``unickpt import --source megatron`` (entry-point group ``unickpt.sources``)."""
