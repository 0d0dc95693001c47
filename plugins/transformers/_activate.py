"""Zero-code activation: the startup hook calls :func:`startup` after ``import transformers``.

``unickpt._startup`` (run from the ``unickpt-startup.pth`` file installed with the package) watches for
the import of ``transformers`` (this package's ``unickpt.startup`` entry point); when
``UNICKPT_TRANSFORMERS=1``, :func:`install` patches ``Trainer`` so that an unmodified training script's
checkpoints go through unickpt.
"""
from __future__ import annotations

__all__ = ["install", "startup"]


def startup() -> None:
    """The startup hook's call: :func:`install` when ``UNICKPT_TRANSFORMERS`` is true (default off)."""
    from unickpt.ext import flag

    if flag("UNICKPT_TRANSFORMERS", False):
        install()


def install() -> None:
    """Enable unickpt for every ``Trainer`` of this process, options from the environment (idempotent).
    Raises ValueError for a bad ``UNICKPT_TRANSFORMERS_*`` value."""
    from ._options import options_from_env
    from ._patch import enable

    enable(None, options_from_env())
