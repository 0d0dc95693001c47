"""Test helpers shipped with unickpt, so that plugins and users can test with them too:
multi-process CPU/gloo worker pools (:mod:`.dist`) and storage faults on purpose (:mod:`.faults`)."""
from .dist import DistPool, RemoteError
from .faults import Fault, FaultyStorage, inject, install

__all__ = ["DistPool", "RemoteError", "Fault", "FaultyStorage", "inject", "install", "writer_pid"]


def writer_pid(process_group=None) -> int | None:
    """The pid of the writer process of the group's engine (``SaveOptions(writer="process")``), or
    None when it has none: for tests that kill it."""
    from ..engine import get_engine

    return get_engine(process_group).saver.pipeline.writer_pid
