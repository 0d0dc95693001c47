"""Options of the Trainer plugin, from keyword arguments or ``UNICKPT_TRANSFORMERS_*`` variables."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["Options", "options_from_env"]

_ENV = {"async_save": "UNICKPT_TRANSFORMERS_ASYNC", "snapshot": "UNICKPT_TRANSFORMERS_SNAPSHOT"}


@dataclass(frozen=True)
class Options:
    """How Trainer's checkpoints use unickpt.

    Attributes:
        async_save: return from Trainer's checkpoint save once the state is staged (or, with
            ``snapshot="overlap"``, at once: ``optimizer.step()`` waits for the copy); the write and
            the commit go on in the background. False: the save returns once committed.
        snapshot: ``"overlap"`` (default) or ``"sync"`` (:class:`unickpt.SaveOptions` ``snapshot``).
    """

    async_save: bool = True
    snapshot: str = "overlap"

    def validated(self) -> "Options":
        """Return self; raise ValueError naming the option, the expected and the actual value."""
        if not isinstance(self.async_save, bool):
            raise ValueError(f"unickpt.transformers option async_save must be a bool, got {self.async_save!r}")
        if self.snapshot not in ("overlap", "sync"):
            raise ValueError(f"unickpt.transformers option snapshot must be 'overlap' or 'sync', got {self.snapshot!r}")
        return self

    def updated(self, **changes: Any) -> "Options":
        """A validated copy with ``changes``; ValueError for an unknown option."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown unickpt.transformers option(s) {unknown}; known: {sorted(known)}")
        return replace(self, **changes).validated()


def options_from_env() -> Options:
    """:class:`Options` from ``UNICKPT_TRANSFORMERS_ASYNC`` (``0``/``1``) and ``UNICKPT_TRANSFORMERS_SNAPSHOT``."""
    from unickpt.ext import flag

    changes: dict[str, Any] = {}
    if os.environ.get(_ENV["async_save"]) is not None:
        changes["async_save"] = flag(_ENV["async_save"], True)
    if os.environ.get(_ENV["snapshot"]):
        changes["snapshot"] = os.environ[_ENV["snapshot"]]
    return Options().updated(**changes)
