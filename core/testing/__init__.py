"""Test helpers shipped with unickpt so plugins can use them: multi-process CPU/gloo worker pools."""
from .dist import DistPool, RemoteError

__all__ = ["DistPool", "RemoteError"]
