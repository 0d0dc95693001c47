"""Zero-code activation: the startup hook calls :func:`startup` after ``import accelerate``.

``unickpt._startup`` (run from the ``unickpt-startup.pth`` file installed with the package) watches
for the import of ``accelerate`` (this package's ``unickpt.startup`` entry point) and calls
:func:`startup`, which, when ``UNICKPT_ACCELERATE=1``, calls :func:`install`, so an unmodified
training script that calls ``accelerator.save_state`` / ``load_state`` saves and loads through unickpt. Options come from ``UNICKPT_ACCELERATE_ASYNC``, ``UNICKPT_ACCELERATE_RNG_RESHARD``
and ``UNICKPT_ACCELERATE_ALLOW_PICKLE`` (see :func:`unickpt.accelerate._options.options_from_env`).
"""
from __future__ import annotations

__all__ = ["install", "startup"]


def startup() -> None:
    """The startup hook's call (right after ``import accelerate``): :func:`install` when
    ``UNICKPT_ACCELERATE`` is set to a true value (default off)."""
    from unickpt.ext import flag

    if flag("UNICKPT_ACCELERATE", False):
        install()


def install() -> None:
    """Enable unickpt for every ``Accelerator`` of this process, with options from the environment.

    Idempotent: a second call patches nothing again (it re-reads the options). Raises ValueError for
    a bad ``UNICKPT_ACCELERATE_*`` value (the startup hook reports it as a warning and leaves
    Accelerate unpatched)."""
    from ._options import options_from_env
    from ._patch import enable

    enable(None, options_from_env())
