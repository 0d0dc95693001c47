"""The ``"unickpt"`` block of a DeepSpeed JSON config.

Example::

    "unickpt": {"enabled": true, "async_save": true}

Keys (all optional but ``enabled``):

====================  =======  ===================================================================
key                   default  meaning
====================  =======  ===================================================================
``enabled``           false    use unickpt for ``engine.save_checkpoint`` / ``load_checkpoint``
``async_save``        true     ``save_checkpoint`` returns once the state is copied to host memory;
                               writing and the commit (``metadata.json``, then ``latest``) continue
                               in the background. Errors surface at the next ``engine.step()``,
                               save, load or ``engine.destroy()``.
``storage_options``   {}       passed to fsspec for remote ``save_dir`` URLs (``s3://...``)
``allow_pickle``      false    store / load ``client_state`` values that only pickle can express
``verify``            true     check every byte read against its checksum on load
====================  =======  ===================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["UnickptConfig"]


@dataclass(frozen=True)
class UnickptConfig:
    """Parsed ``"unickpt"`` block (see the module docstring for the keys)."""

    enabled: bool = False
    async_save: bool = True
    storage_options: dict = field(default_factory=dict)
    allow_pickle: bool = False
    verify: bool = True

    @classmethod
    def from_block(cls, block: Any) -> "UnickptConfig":
        """Validate and parse the raw block. Raises ValueError naming the bad key, the expected and the
        actual value (an unknown key, a wrong type, a block that is not a JSON object)."""
        if isinstance(block, bool):  # "unickpt": true
            return cls(enabled=block)
        if not isinstance(block, dict):
            raise ValueError(f'DeepSpeed config "unickpt": expected a JSON object such as {{"enabled": true}}, '
                             f"got {type(block).__name__} {block!r}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(block) - set(known))
        if unknown:
            import difflib

            hints = [f"{k!r} -> {m[0]!r}" for k in unknown if (m := difflib.get_close_matches(k, known, n=1))]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            raise ValueError(f'DeepSpeed config "unickpt": unknown key(s) {unknown}{hint}; known keys: {sorted(known)}')
        for key, value in block.items():
            want = dict if key == "storage_options" else bool
            if not isinstance(value, want):
                raise ValueError(f'DeepSpeed config "unickpt.{key}": expected a JSON '
                                 f'{"object" if want is dict else "boolean"}, got {type(value).__name__} {value!r}')
        return cls(**block)
