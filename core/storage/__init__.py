"""Storage: where checkpoint bytes go. One small interface, :class:`StorageBackend`, with two
implementations: :class:`~unickpt.storage.local.LocalStorage` (``os`` calls: ``pwrite``/``pread``,
``fsync``, ``O_DIRECT``, atomic ``os.replace``) and :class:`~unickpt.storage.remote.FsspecStorage`
(any fsspec URL: ``s3://``, ``gs://``, ``memory://``..., with retries of transient errors).

:func:`open_storage` picks the backend for a path or URL. :func:`register_backend` adds one for a
protocol; :func:`add_wrapper` wraps every backend opened in this process (tracing, fault injection:
:mod:`unickpt.testing.faults`).

Importing this package imports neither torch nor fsspec (the writer process imports it).
"""
from __future__ import annotations

from .base import StorageBackend
from .registry import add_wrapper, open_storage, register_backend
from .local import DIRECT_ALIGN, DirectFile, LocalStorage
from .retry import is_transient

__all__ = ["StorageBackend", "LocalStorage", "DirectFile", "DIRECT_ALIGN", "open_storage", "register_backend",
           "add_wrapper", "is_transient"]
