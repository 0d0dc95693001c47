"""``UnickptCheckpointEngine``: the DeepSpeed ``CheckpointEngine`` selected by the ``"unickpt"`` block.

DeepSpeed's own ``save_checkpoint`` hands a checkpoint engine one ``(state_dict, path)`` pair per file,
which cannot be resharded. With this engine selected, :mod:`unickpt.deepspeed._activate` routes
``engine.save_checkpoint`` / ``load_checkpoint`` to :mod:`unickpt.deepspeed.checkpoint` instead, which
saves the whole training state as one unickpt checkpoint. This class keeps what belongs to a
checkpoint engine:

- the pending asynchronous saves and the decoupled-engine contract (deepspeed 0.19.8,
  ``runtime/checkpoint_engine/checkpoint_engine.py``): ``is_decoupled()`` is True for async saves, so
  DeepSpeed calls :meth:`get_commit_info` at every optimizer-step boundary (``engine.py:3612``); there a
  finished save's error is raised. The commit itself (``metadata.json``, then ``latest``) happens in
  unickpt's background thread as soon as every rank's bytes are durable, so it never waits for a step.
- the per-file ``save`` / ``load`` DeepSpeed still uses outside ``save_checkpoint`` (for example
  ``save_16bit_model``): plain ``torch.save`` / ``torch.load``, as DeepSpeed's TorchCheckpointEngine.

What a save or load does with the engine's state is :mod:`unickpt.deepspeed.checkpoint`'s (which imports
this module, not the other way round): the tier schedule gets the memory state as a callable.
"""
from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import Any, Callable

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from .config import UnickptConfig

__all__ = ["UnickptCheckpointEngine", "finish_all_pending", "wait_for_tag"]

log = logging.getLogger("unickpt.deepspeed")

_LIVE: "weakref.WeakSet[UnickptCheckpointEngine]" = weakref.WeakSet()


class UnickptCheckpointEngine(CheckpointEngine):
    """Checkpoint engine of DeepSpeed engines whose config has ``"unickpt": {"enabled": true}``.

    Args:
        config_params: the engine's ``DeepSpeedConfig``.
        config: the parsed ``"unickpt"`` block.
        has_moe_layers: from DeepSpeed's factory; MoE models are not supported.

    Raises:
        NotImplementedError: MoE layers: remove the ``"unickpt"`` block to use DeepSpeed's own checkpoints.
    """

    is_unickpt = True

    def __init__(self, config_params: Any = None, config: UnickptConfig | None = None, *, has_moe_layers: bool = False):
        super().__init__(config_params)
        self.name = "UnickptCheckpointEngine"
        self.config = config or UnickptConfig(enabled=True)
        if has_moe_layers:
            raise NotImplementedError('DeepSpeed config "unickpt": models with MoE layers are not supported; '
                                      'remove the "unickpt" block to use DeepSpeed\'s checkpoints')
        self._pending: list[tuple[Any, CheckpointCommitInfo]] = []  # (SaveHandle, info), oldest first
        self.last_save: Any = None  # the SaveHandle of the latest save_checkpoint (``.stats.stall_s``, ...)
        self.last_load_stats: Any = None  # this rank's LoadStats of the latest load_checkpoint
        self.tiers: Any = None  # the checkpoint tiers (``memory_every`` / ``persist_every``), once created
        self.client_state: dict = {}  # the client_state of the latest save_checkpoint (memory saves keep it)
        _LIVE.add(self)

    # -- the checkpoint tiers (docs/tiers.md) ----------------------------------------------------------
    def tiers_for(self) -> Any:
        """The :class:`unickpt.ext.TiersHandle` of this engine (created on first use; collective: every
        rank gets here at the same optimizer step, or in ``load_checkpoint``). Raises ValueError when the
        config has no ``save_dir``."""
        if self.tiers is None:
            from unickpt import ext

            if self.config.save_dir is None:
                raise ValueError('DeepSpeed config "unickpt": the checkpoint tiers need "save_dir" (the run\'s '
                                 'checkpoint directory)')
            self.tiers = ext.memory_tiers(self.config.save_dir, self.config.tier_options())
        return self.tiers

    def on_step(self, engine: Any, memory_state: Callable[[], dict]) -> None:
        """After an optimizer step of ``engine`` (every rank): the tier schedule. A memory save of
        ``memory_state()`` (:func:`unickpt.deepspeed.checkpoint.memory_state`) when the step is due;
        ``save_checkpoint(save_dir)`` every ``persist_every`` steps; on a preemption notice (agreed
        across ranks in the step's one all-reduce) a synchronous ``save_checkpoint(save_dir)``, then
        ``engine.unickpt_preempted = True``."""
        tiers = self.tiers_for()
        step = int(engine.global_steps)
        preempt = tiers.step(step, memory_state, allow_pickle=self.config.allow_pickle)
        if preempt and not getattr(engine, "unickpt_preempted", False):
            if tiers.rank == 0:
                log.warning("unickpt.deepspeed: preemption notice (%s): saving global step %d to %s",
                            tiers.notice.received or "on another rank", step, self.config.save_dir)
            engine.save_checkpoint(self.config.save_dir, client_state=self.client_state)
            self.finish_pending()
            engine.unickpt_preempted = True
        elif self.config.persist_every is not None and step % self.config.persist_every == 0:
            engine.save_checkpoint(self.config.save_dir, client_state=self.client_state)

    # -- unickpt saves --------------------------------------------------------------------------
    def add_pending(self, handle: Any, info: CheckpointCommitInfo) -> None:
        """Track an asynchronous save until it is known to have committed or failed."""
        self._pending.append((handle, info))

    def finish_pending(self) -> None:
        """Block until every pending save has committed; raise the first failure (SaveFailedError)."""
        pending, self._pending = self._pending, []
        first_error = None
        for handle, _ in pending:
            try:
                handle.wait()
            except BaseException as e:  # noqa: BLE001 - every handle is waited for, the first error raised
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def _reap_done(self) -> None:
        """Drop saves that have finished; raise the first one that failed."""
        keep = []
        error = None
        for handle, info in self._pending:
            if not handle.done():
                keep.append((handle, info))
                continue
            try:
                handle.wait()
            except BaseException as e:  # noqa: BLE001
                error = error or e
        self._pending = keep
        if error is not None:
            raise error

    # -- DeepSpeed's CheckpointEngine interface -----------------------------------------------------
    def is_decoupled(self) -> bool:
        """True for async saves: DeepSpeed then calls :meth:`get_commit_info` at each step boundary."""
        return self.config.async_save

    def get_commit_info(self) -> None:
        """Called by DeepSpeed at each optimizer-step boundary: raise the error of a finished failed save.

        Returns None always: unickpt commits in its background thread (``metadata.json`` by group rank
        0 once every rank's bytes are durable, then ``latest``), so DeepSpeed has nothing left to commit
        and no barrier is needed.
        """
        self._reap_done()
        return None

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:
        pass

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def save(self, state_dict: Any, path: str) -> None:
        """Per-file save for DeepSpeed paths other than ``save_checkpoint`` (``torch.save``)."""
        torch.save(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        """Per-file load for DeepSpeed paths other than ``load_checkpoint`` (``torch.load``, as DeepSpeed)."""
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Per-file saves are complete when ``save`` returns; unickpt saves commit themselves."""
        return True

    def cleanup(self) -> None:
        """Called by ``engine.destroy()``: wait for pending saves to commit (raises their error), then
        close the checkpoint tiers (their memory copies stay for a restart)."""
        try:
            self.finish_pending()
        finally:
            if self.tiers is not None:
                self.tiers.close()
                self.tiers = None

    def preserves_storage_sharing(self) -> bool:
        return True


def wait_for_tag(save_dir: str, tag: str) -> None:
    """Block until every pending save to ``save_dir``/``tag`` (of any engine in this process) has finished.

    Errors are not raised here: a failed save stays pending, so its error surfaces at the next step
    boundary (:meth:`UnickptCheckpointEngine.get_commit_info`) as for any other tag.
    """
    for engine in list(_LIVE):
        for handle, info in list(engine._pending):
            if info.tag == tag and os.fspath(info.save_dir).rstrip("/") == os.fspath(save_dir).rstrip("/"):
                try:
                    handle.wait()
                except BaseException:  # noqa: BLE001 - raised later by _reap_done / finish_pending
                    pass


def finish_all_pending() -> None:
    """Wait for the pending saves of every unickpt DeepSpeed engine in this process; raise the first error."""
    first = None
    for engine in list(_LIVE):
        try:
            engine.finish_pending()
        except BaseException as e:  # noqa: BLE001 - wait for all, raise the first
            first = first or e
    if first is not None:
        raise first


@atexit.register
def _finish_at_exit() -> None:
    # A script that ends right after an async save_checkpoint would otherwise lose that save.
    # This needs the default process group alive (call engine.destroy() before destroying it).
    for engine in list(_LIVE):
        if engine._pending:
            try:
                engine.finish_pending()
            except BaseException as e:  # noqa: BLE001 - at exit, report and go on
                log.error("unickpt: an asynchronous DeepSpeed checkpoint did not commit: %s", e)
