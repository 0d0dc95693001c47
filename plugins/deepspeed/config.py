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
``memory_every``      null     checkpoint tiers (docs/tiers.md): a memory save of the engine's state
                               every this many optimizer steps (tier 0, this node's shared memory;
                               tier 1, a copy on another node), made by ``engine.step()``;
                               ``load_checkpoint`` restores from memory when it holds a step at
                               least as new as ``latest``. Needs ``save_dir``.
``persist_every``     null     ``engine.step()`` saves ``save_checkpoint(save_dir)`` every this many
                               optimizer steps. Needs ``save_dir``.
``save_dir``          null     the run's checkpoint directory: names its memory directory; where
                               ``persist_every`` saves and the save on a preemption notice go
``memory_dir``        null     base of the memory tiers on each node (default ``UNICKPT_MEMORY_DIR``
                               or ``/dev/shm/unickpt``)
``memory_keep``       1        memory copies kept per tier and rank (1 or 2)
``memory_limit_bytes`` null    bound of the shared memory a rank's tiers hold
``peer``              true     copy each memory save to a rank on another node (tier 1)
``signals``           ["SIGTERM", "SIGUSR1"]  preemption notices: with tiers on, one to any rank makes
                               every rank ``save_checkpoint(save_dir)`` at its next optimizer step
                               (``engine.unickpt_preempted`` is then True: stop training)
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
    memory_every: int | None = None
    persist_every: int | None = None
    save_dir: str | None = None
    memory_dir: str | None = None
    memory_keep: int = 1
    memory_limit_bytes: int | None = None
    peer: bool = True
    signals: tuple = ("SIGTERM", "SIGUSR1")

    @property
    def tiers_enabled(self) -> bool:
        """Whether ``engine.step()`` follows a tier schedule (``memory_every`` or ``persist_every``)."""
        return self.memory_every is not None or self.persist_every is not None

    def tier_options(self) -> Any:
        """The :class:`~unickpt.TierOptions` of this block."""
        from unickpt import TierOptions

        return TierOptions(memory_every=self.memory_every, persist_every=self.persist_every, peer=self.peer,
                           memory_dir=self.memory_dir, memory_keep=self.memory_keep,
                           memory_limit_bytes=self.memory_limit_bytes, signals=tuple(self.signals))

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
            kind = _KINDS.get(key, "a JSON boolean")
            if not _is(kind, value):
                raise ValueError(f'DeepSpeed config "unickpt.{key}": expected {kind}, got '
                                 f"{type(value).__name__} {value!r}")
        values = dict(block)
        if "signals" in values:
            values["signals"] = tuple(values["signals"])
        cfg = cls(**values)
        if cfg.tiers_enabled and not cfg.save_dir:
            raise ValueError('DeepSpeed config "unickpt": "memory_every" / "persist_every" need "save_dir" (the run\'s '
                             "checkpoint directory)")
        if cfg.tiers_enabled:
            try:
                cfg.tier_options().validated()
            except ValueError as e:
                raise ValueError(f'DeepSpeed config "unickpt": {e}') from None
        return cfg


_KINDS = {"storage_options": "a JSON object", "memory_every": "a positive integer or null",
          "persist_every": "a positive integer or null", "memory_limit_bytes": "a positive integer or null",
          "memory_keep": "1 or 2", "save_dir": "a string or null", "memory_dir": "a string or null",
          "signals": "a list of signal names"}


def _is(kind: str, value: Any) -> bool:
    if kind == "a JSON object":
        return isinstance(value, dict)
    if kind.startswith("a positive integer"):
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    if kind == "1 or 2":
        return value in (1, 2) and not isinstance(value, bool)
    if kind == "a string or null":
        return value is None or isinstance(value, str)
    if kind == "a list of signal names":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, bool)
