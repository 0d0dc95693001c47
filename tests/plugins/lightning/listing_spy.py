"""Every state of a folder's listing that a process produces: the folder is listed right after each
call of the ``os`` functions that create, rename or remove names (``os.link``, ``os.replace``, ...),
in whichever thread makes it. Used by the listing tests (tests/plugins/lightning/test_lightning_dropin.py,
``lightning_train.py --watch-listings``): a name that exists only for a moment (a temporary file
linked, then renamed) is seen as surely as one that stays."""
from __future__ import annotations

import os
import threading

CALLS = ("open", "link", "symlink", "replace", "rename", "mkdir", "makedirs", "remove", "unlink", "rmdir")


def watch(folder: str, patch=None) -> list[list[str]]:
    """Start recording the listings of ``folder`` (absent folder: nothing recorded); returns the list
    they are appended to (each sorted). ``patch(obj, name, value)`` installs a wrapper
    (``monkeypatch.setattr`` in a test; plain ``setattr`` by default, for a whole process)."""
    seen: list[list[str]] = []
    lock = threading.Lock()
    listdir = os.listdir
    set_attr = patch or setattr

    def record() -> None:
        try:
            names = sorted(listdir(folder))
        except OSError:
            return
        with lock:
            if not seen or seen[-1] != names:
                seen.append(names)

    for name in CALLS:
        real = getattr(os, name)

        def spy(*args, _real=real, **kwargs):
            try:
                return _real(*args, **kwargs)
            finally:
                record()

        set_attr(os, name, spy)
    return seen
