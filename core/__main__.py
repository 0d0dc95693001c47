"""``python -m unickpt ...``: the ``unickpt`` command (:mod:`unickpt.tools.cli`)."""
import sys

from .tools.cli import main

sys.exit(main())
