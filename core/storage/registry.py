"""How a path or URL selects a storage backend: :func:`open_storage`, with backends registered by
protocol (:func:`register_backend`) and wrappers around every backend opened (:func:`add_wrapper`)."""
from __future__ import annotations

import os
from typing import Callable

from .base import StorageBackend

__all__ = ["open_storage", "register_backend", "add_wrapper"]


Factory = Callable[[str, "dict | None"], StorageBackend]
_BACKENDS: dict[str, Factory] = {}
_WRAPPERS: list[Callable[[StorageBackend], StorageBackend]] = []


def register_backend(protocol: str, factory: Factory) -> None:
    """Open URLs ``<protocol>://...`` with ``factory(url, storage_options)`` instead of fsspec."""
    _BACKENDS[protocol] = factory


def add_wrapper(wrap: Callable[[StorageBackend], StorageBackend]) -> Callable[[], None]:
    """Pass every backend :func:`open_storage` opens in this process through ``wrap`` (last added is
    outermost). Returns a function that removes the wrapper. Backends opened before are not affected."""
    _WRAPPERS.append(wrap)
    return lambda: _WRAPPERS.remove(wrap) if wrap in _WRAPPERS else None


def _protocol(url: str) -> str | None:
    head, sep, _ = url.partition("://")
    return head.split("::")[0].lower() if sep and "/" not in head else None


def open_storage(url: str | os.PathLike, storage_options: dict | None = None) -> StorageBackend:
    """The backend for ``url``: :class:`~unickpt.storage.local.LocalStorage` for a local path or a
    ``file://`` URL, a registered backend for its protocol, else
    :class:`~unickpt.storage.remote.FsspecStorage` (``storage_options`` are fsspec's: credentials,
    endpoint). Raises ValueError (fsspec's) for an unknown protocol."""
    url = os.fspath(url)
    protocol = _protocol(url)
    backend: StorageBackend
    if protocol in (None, "file", "local"):
        from .local import LocalStorage

        backend = LocalStorage()
    elif protocol in _BACKENDS:
        backend = _BACKENDS[protocol](url, storage_options)
    else:
        from .remote import FsspecStorage

        backend = FsspecStorage(url, storage_options)
    for wrap in list(_WRAPPERS):
        backend = wrap(backend)
    return backend
