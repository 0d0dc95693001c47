"""unickpt's load errors as megatron-core ``CheckpointingException`` s.

Megatron's callers catch ``megatron.core.dist_checkpointing.core.CheckpointingException`` around
``dist_checkpointing.load``; unickpt raises its own typed errors (``StateMismatchError`` is a
``ValueError``, ``IntegrityError`` an ``OSError``, ...). Inside the megatron strategies each unickpt
error leaves as an instance of a class deriving from both its unickpt class and
``CheckpointingException`` (:func:`checkpointing_error`), with the same message and attributes, so
``except CheckpointingException``, ``except unickpt.StateMismatchError`` and ``except ValueError``
all catch it::

    try:
        dist_checkpointing.load(sharded_state_dict, ckpt_dir)
    except CheckpointingException as e:   # also a unickpt.StateMismatchError for a shape mismatch
        ...
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

from megatron.core.dist_checkpointing.core import CheckpointingException

from unickpt import (CheckpointNotFoundError, FormatVersionError, IntegrityError, LoadFailedError,
                     StateMismatchError, UnickptError, UnsafeObjectError)

__all__ = ["checkpointing_error", "as_checkpointing_errors", "MegatronStateMismatchError", "MegatronIntegrityError",
           "MegatronCheckpointNotFoundError", "MegatronFormatVersionError", "MegatronUnsafeObjectError",
           "MegatronLoadFailedError"]


@functools.lru_cache(maxsize=None)
def checkpointing_error(cls: type) -> type:
    """The class ``Megatron<cls name>`` deriving from ``cls`` (a :class:`unickpt.UnickptError` subclass)
    and megatron-core's ``CheckpointingException``; one class per ``cls``."""
    name = f"Megatron{cls.__name__}"
    return type(name, (cls, CheckpointingException),
                {"__module__": __name__, "__qualname__": name,
                 "__doc__": f"unickpt's {cls.__name__} that is also megatron-core's CheckpointingException."})


# the errors a load can raise, importable by name (and picklable)
MegatronStateMismatchError = checkpointing_error(StateMismatchError)
MegatronIntegrityError = checkpointing_error(IntegrityError)
MegatronCheckpointNotFoundError = checkpointing_error(CheckpointNotFoundError)
MegatronFormatVersionError = checkpointing_error(FormatVersionError)
MegatronUnsafeObjectError = checkpointing_error(UnsafeObjectError)
MegatronLoadFailedError = checkpointing_error(LoadFailedError)


@contextlib.contextmanager
def as_checkpointing_errors() -> Iterator[None]:
    """Re-raise a :class:`unickpt.UnickptError` escaping the block as :func:`checkpointing_error` of its
    class: the same exception object (message, attributes, traceback), its class switched to the
    subclass. Other exceptions pass unchanged."""
    try:
        yield
    except UnickptError as e:
        if not isinstance(e, CheckpointingException):
            cls: type = type(e)  # as `type`: mypy checks a type[X] argument as Hashable against X's __hash__
            e.__class__ = checkpointing_error(cls)
        raise
