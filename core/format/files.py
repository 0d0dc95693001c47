"""What a checkpoint directory holds, by name (format versions 1 and 2)::

    <checkpoint>/
      metadata.json          the index, written last: its presence is the commit
      data/<rank>_<n>.bin    tensor bytes: rank <rank>'s n-th data file (chunks packed back to back)
      index/<rank>.idx       format v2: where rank <rank>'s parts of split tensors are, their checksums
                             (:mod:`unickpt.format.index`)
      objects/rank_<r>.json  rank r's per-rank state (tagged JSON)
      .unickpt-writer        who is saving into it (host, pid, time): written first, left after the
                             commit (:mod:`unickpt.lifecycle.directory`)
      model*.safetensors     with ``SaveOptions.safetensors``: the group's tensors, one Hugging Face
      model.safetensors.index.json   safetensors file per writer, and their index
                             (:mod:`unickpt.format.hf_shards`)

A directory holding anything else is not a checkpoint directory that unickpt may replace or remove.
"""
from __future__ import annotations

import re

from .hf_shards import ENTRY_PATTERN

__all__ = ["is_safetensors_entry", "METADATA_FILE", "DATA_DIR", "OBJECTS_DIR", "INDEX_DIR", "WRITER_FILE", "data_file", "objects_file", "index_file",
           "is_own_entry", "is_partial_entry", "is_own_file", "SUBDIRS"]

METADATA_FILE = "metadata.json"
DATA_DIR = "data"
OBJECTS_DIR = "objects"
INDEX_DIR = "index"
WRITER_FILE = ".unickpt-writer"

_FILES = {DATA_DIR: re.compile(r"^\d+_\d+\.bin$"), OBJECTS_DIR: re.compile(r"^rank_\d+\.json$"),
          INDEX_DIR: re.compile(r"^\d+\.idx$")}
_TMP = r"(metadata|model\.safetensors\.index)\.json\.tmp-[0-9a-f]+"
_SHARDS = ENTRY_PATTERN
_PARTIAL = re.compile(rf"^({DATA_DIR}|{OBJECTS_DIR}|{INDEX_DIR}|{_TMP}|{_SHARDS}|{re.escape(WRITER_FILE)})$")
_OWN = re.compile(rf"^({DATA_DIR}|{OBJECTS_DIR}|{INDEX_DIR}|metadata\.json|{_TMP}|{_SHARDS}|{re.escape(WRITER_FILE)})$")


def data_file(rank: int, n: int) -> str:
    """The relative path of rank ``rank``'s ``n``-th data file."""
    return f"{DATA_DIR}/{rank}_{n}.bin"


def objects_file(rank: int) -> str:
    """The relative path of rank ``rank``'s per-rank state."""
    return f"{OBJECTS_DIR}/rank_{rank}.json"


def index_file(rank: int) -> str:
    """The relative path of rank ``rank``'s index file (format v2)."""
    return f"{INDEX_DIR}/{rank}.idx"


def is_own_entry(name: str) -> bool:
    """Whether a save writes an entry of this name directly in a checkpoint directory."""
    return bool(_OWN.match(name))


_SHARD_ENTRY = re.compile(rf"^({_SHARDS})$")


def is_safetensors_entry(name: str) -> bool:
    """True for the name of a Hugging Face safetensors file of ``SaveOptions.safetensors``
    (``model.safetensors``, ``model-0000k-of-0000n.safetensors``, ``model.safetensors.index.json``)."""
    return _SHARD_ENTRY.match(name) is not None


def is_partial_entry(name: str) -> bool:
    """Whether an unfinished save writes an entry of this name (everything but ``metadata.json``)."""
    return bool(_PARTIAL.match(name))


def is_own_file(subdir: str, name: str) -> bool:
    """Whether a save writes a file ``name`` inside ``subdir`` (``data``, ``objects`` or ``index``)."""
    pattern = _FILES.get(subdir)
    return bool(pattern and pattern.match(name))


SUBDIRS = tuple(_FILES)
