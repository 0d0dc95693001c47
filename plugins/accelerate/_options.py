"""Options of the Accelerate plugin, from keyword arguments or ``UNICKPT_ACCELERATE_*`` variables."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["Options", "RNG_RESHARD", "options_from_env"]

RNG_RESHARD = ("error", "by_rank", "keep")
"""What ``load_state`` does with per-process RNG state saved by another number of processes:
``"error"`` raises :class:`unickpt.PerRankReshardError` (the core's default for per-rank state);
``"by_rank"``: process ``r`` takes saved process ``r``'s state when it exists and keeps its current
generators otherwise (what Accelerate itself does, made explicit); ``"keep"``: no process restores RNG
state, every one keeps its current generators."""

_ENV = {
    "async_save": "UNICKPT_ACCELERATE_ASYNC",
    "rng_reshard": "UNICKPT_ACCELERATE_RNG_RESHARD",
    "allow_pickle": "UNICKPT_ACCELERATE_ALLOW_PICKLE",
    "on_error": "UNICKPT_ACCELERATE_ON_ERROR",
}
ON_ERROR = ("raise", "warn")


@dataclass(frozen=True)
class Options:
    """How ``Accelerator.save_state`` / ``load_state`` use unickpt.

    Attributes:
        async_save: return from ``save_state`` once the state is copied into host memory; writing and
            the commit go on in the background and are waited for by the next ``save_state`` /
            ``load_state``, by ``end_training()`` and at interpreter exit. False: ``save_state``
            returns once the checkpoint is committed.
        rng_reshard: one of :data:`RNG_RESHARD`.
        allow_pickle: let saves store, and loads restore, values that only pickle can express (in
            scheduler or ``register_for_checkpointing`` state). Off: such a value raises
            :class:`unickpt.UnsafeObjectError` naming its key. ``save_state(safe_serialization=False)``
            allows pickling for that save only.
        on_error: an asynchronous save that failed in the background is reported by the next
            ``save_state`` / ``load_state`` / ``end_training()`` / :func:`unickpt.accelerate.wait`, on every
            process: ``"raise"`` (default) raises :class:`unickpt.EarlierSaveFailedError` naming the
            failed save's folder (``save_state`` then saves nothing); ``"warn"`` warns
            (``RuntimeWarning``) and goes on (see :class:`unickpt.Checkpointer`'s ``on_error``).
    """

    async_save: bool = True
    rng_reshard: str = "error"
    allow_pickle: bool = False
    on_error: str = "raise"

    def validated(self) -> "Options":
        """Return self; raise ValueError naming the option, the expected and the actual value."""
        if not isinstance(self.async_save, bool):
            raise ValueError(f"unickpt.accelerate option async_save must be a bool, got {self.async_save!r}")
        if self.rng_reshard not in RNG_RESHARD:
            raise ValueError(f"unickpt.accelerate option rng_reshard must be one of {list(RNG_RESHARD)}, "
                             f"got {self.rng_reshard!r}")
        if not isinstance(self.allow_pickle, bool):
            raise ValueError(f"unickpt.accelerate option allow_pickle must be a bool, got {self.allow_pickle!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"unickpt.accelerate option on_error must be one of {list(ON_ERROR)}, "
                             f"got {self.on_error!r}")
        return self

    def updated(self, **changes: Any) -> "Options":
        """A copy with ``changes``; ValueError for an unknown option name or a bad value."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ValueError(f"unknown unickpt.accelerate option(s) {unknown}; expected some of "
                             f"{[f.name for f in fields(self)]}")
        return replace(self, **changes).validated()


def _parse_bool(var: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{var} must be one of 1/0/true/false/yes/no/on/off, got {text!r}")


def options_from_env(environ: Any = None) -> Options:
    """Options from ``UNICKPT_ACCELERATE_ASYNC`` (1/0), ``UNICKPT_ACCELERATE_RNG_RESHARD``
    (error/by_rank/keep), ``UNICKPT_ACCELERATE_ALLOW_PICKLE`` (1/0) and ``UNICKPT_ACCELERATE_ON_ERROR``
    (raise/warn); unset or empty variables
    keep the defaults. Raises ValueError naming the variable for a bad value."""
    env = os.environ if environ is None else environ
    changes: dict[str, Any] = {}
    for name, var in _ENV.items():
        text = env.get(var)
        if text is None or text.strip() == "":
            continue
        changes[name] = text.strip() if name in ("rng_reshard", "on_error") else _parse_bool(var, text)
    try:
        return Options().updated(**changes)
    except ValueError as e:
        name = next(n for n in ("rng_reshard", "on_error") if f"option {n} " in str(e))
        raise ValueError(f"{e} (from {_ENV[name]})") from None
