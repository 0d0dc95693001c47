"""What ``Accelerator.save_state`` saves, as one unickpt state (and the same tree as a load target).

::

    {"accelerate":  {"step", "iteration", "num_processes", "distributed_type"}   plain values (rank 0's)
     "scaler":      GradScaler                                    (before the optimizers: FSDP2 needs it first)
     "models":      {"<i>": nn.Module | FSDP1 flat-parameter state}      sharded or replicated tensors
     "optimizers":  {"<i>": torch.optim.Optimizer | adapter}     fqn-keyed state (get_optimizer_state_dict)
     "schedulers":  {"<i>": scheduler}                            state dict (plain values)
     "dataloaders": {"<i>": DataLoaderState}                      epoch, sampler seed/epoch, generator (rank 0's)
     "dataloader_states": {"<i>": PerRank(stateful dataloader)}   torchdata position, per process
     "custom":      {"<i>": registered object}                   its state dict
     "rng":         unickpt.RNGState                               per process}

``<i>`` is the object's index in the accelerator (``_models[i]``, ...). Model and optimizer state use
the fqns of ``model.state_dict()`` without wrapper prefixes (DDP ``module.``, FSDP), so they load into
any number of processes and across DDP / FSDP / a single process.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

import unickpt
from unickpt import ext

from ._options import Options

__all__ = ["DataLoaderState", "Process0State", "build_state", "rng_state", "process0_buffers"]


class DataLoaderState:
    """State of one prepared dataloader that every process shares (saved from process 0).

    ``state_dict()`` -> ``{"iteration": int, "sampler_epoch": int | None, "sampler_seed": int | None,
    "generator": bytes | None}``: the epoch counter of Accelerate's ``DataLoaderShard`` /
    ``DataLoaderDispatcher`` (``set_epoch`` is called with it at the start of each epoch), the epoch
    and seed of a ``SeedableRandomSampler``, and the ``torch.Generator`` state of the sampler
    (Accelerate synchronizes it from process 0 at the start of each epoch, ``rng_types=["generator"]``).
    These fix the order of the next epochs on any number of processes. The position inside an epoch
    is not part of it (as in Accelerate: use ``accelerator.skip_first_batches``), except for
    torchdata stateful dataloaders, saved per process under ``dataloader_states``.
    """

    def __init__(self, dataloader: Any, key: str = "dataloaders"):
        self.dataloader = dataloader
        self.key = key

    def _sampler(self) -> Any:
        """The index sampler under Accelerate's wrappers (``BatchSamplerShard.batch_sampler.sampler``,
        the path ``DataLoaderShard.set_epoch`` takes), or None."""
        from torch.utils.data import BatchSampler

        batch_sampler = getattr(self.dataloader, "batch_sampler", None)
        holders = (batch_sampler, getattr(batch_sampler, "batch_sampler", None),
                   getattr(self.dataloader, "sampler", None))
        for holder in holders:
            sampler = getattr(holder, "sampler", None)
            if sampler is not None and not isinstance(sampler, BatchSampler):
                return sampler
        sampler = getattr(self.dataloader, "sampler", None)
        return None if isinstance(sampler, BatchSampler) else sampler

    def state_dict(self) -> dict:
        sampler = self._sampler()
        gen = getattr(sampler, "generator", None)
        return {
            "iteration": int(getattr(self.dataloader, "iteration", 0)),
            "sampler_epoch": int(sampler.epoch) if hasattr(sampler, "epoch") else None,
            "sampler_seed": int(sampler.initial_seed) if hasattr(sampler, "initial_seed") else None,
            "generator": bytes(gen.get_state().numpy().tobytes()) if isinstance(gen, torch.Generator) else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the fields; raises :class:`unickpt.StateMismatchError` naming the key when the
        checkpoint holds a sampler field (epoch, seed, generator) that this dataloader's sampler
        cannot take (say a ``SeedableRandomSampler`` saved, a sequential sampler now): it is not skipped."""
        if hasattr(self.dataloader, "iteration"):
            self.dataloader.iteration = int(state["iteration"])
        sampler = self._sampler()
        for field, attr in (("sampler_epoch", "epoch"), ("sampler_seed", "initial_seed"), ("generator", "generator")):
            if state.get(field) is not None and not hasattr(sampler, attr):
                raise unickpt.StateMismatchError(
                    f"'{self.key}.{field}': the checkpoint holds a sampler {attr}, but this dataloader's sampler "
                    f"({type(sampler).__name__}) has no {attr!r} (prepare the dataloader as in the saving run)")
        if state.get("sampler_epoch") is not None and hasattr(sampler, "epoch"):
            sampler.epoch = int(state["sampler_epoch"])
        if state.get("sampler_seed") is not None and hasattr(sampler, "initial_seed"):
            sampler.initial_seed = int(state["sampler_seed"])
        if state.get("generator") is not None and sampler is not None and hasattr(sampler, "generator"):
            if not isinstance(sampler.generator, torch.Generator):
                sampler.generator = torch.Generator()
            sampler.generator.set_state(torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8))


class Process0State:
    """A registered object's (or scheduler's) state as saved: process 0's state dict on every process.

    Accelerate saves a ``register_for_checkpointing`` object from process 0 only. unickpt stores its
    plain values from process 0 too, but a tensor is stored once as a replica that every process
    is assumed to hold identically, written by whichever process balances the load; an object
    whose tensors differ between processes (statistics of each process's own batches) would be
    saved as a mix. So, for a save on several processes, process 0's state dict is broadcast
    (``torch.distributed.broadcast_object_list``: any shapes, collective, same order on every
    process) and saved in place of each process's own. Loading uses the object itself.
    """

    def __init__(self, obj: Any, key: str):
        import io

        import torch.distributed as dist

        error: BaseException | None = None
        payload: list[Any] = [None]
        own: dict = {}  # process 0: its state dict (a failure is raised below)
        if dist.get_rank() == 0:
            try:  # any failure is sent too: the other processes must not wait for a broadcast that never comes
                own = obj.state_dict()
                buffer = io.BytesIO()
                torch.save(own, buffer)
                payload = [("ok", buffer.getvalue())]
            except Exception as e:
                error, payload = e, [("error", f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(payload, src=0)
        status, data = payload[0]
        if error is not None:
            raise error
        if status != "ok":
            raise RuntimeError(f"{key!r}: state_dict() failed on process 0: {data}")
        # process 0 keeps its own state dict; the others get a copy with tensors in host memory (not on
        # process 0's GPU). Only process 0's bytes are read here, sent over the process group.
        self._state = own if dist.get_rank() == 0 else torch.load(io.BytesIO(data), map_location="cpu",
                                                                  weights_only=False)

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover - only saved, never a load target
        raise RuntimeError("Process0State is a save-time snapshot, not a load target")


def rng_state(options: Options) -> unickpt.RNGState:
    """This process's RNG state leaf, with the resharding rule of ``options.rng_reshard``."""
    holder: list[unickpt.RNGState] = []

    def current(states: list, rank: int, world_size: int) -> Any:
        return holder[0].value.state_dict()  # leaves the generators as they are

    def by_rank(states: list, rank: int, world_size: int) -> Any:
        return states[rank] if rank < len(states) else current(states, rank, world_size)

    rule = {"error": None, "by_rank": by_rank, "keep": current}[options.rng_reshard]
    holder.append(unickpt.RNGState(reshard=rule))
    return holder[0]


def _is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _owner(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> nn.Module | None:
    """The prepared model that holds every parameter of ``optimizer``; when they are spread over
    several models, an ``nn.ModuleDict`` of those (keyed by model index, so their fqns stay apart);
    None when some parameter is in no prepared model (the optimizer's own index-keyed state dict is
    used then)."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    holders = [i for i, m in enumerate(models) if any(id(p) in ids for p in m.parameters())]
    covered = {id(p) for i in holders for p in models[i].parameters()}
    if not holders or not ids <= covered:
        return None
    if len(holders) == 1:
        return models[holders[0]]
    return nn.ModuleDict({str(i): models[i] for i in holders})


@contextlib.contextmanager
def process0_buffers(accelerator: Any, model_indices: list[int]) -> Iterator[None]:
    """While a save snapshots, give every process process 0's model buffers.

    The core stores a plain tensor once, as a replica that every process holds identically (written
    by whichever holder balances the load). Parameters of a DDP model are identical on every
    process, but buffers need not be: BatchNorm running statistics are updated from each process's
    own batch after DDP broadcast process 0's at the start of ``forward``. Without this, a checkpoint
    could hold process 0's ``running_mean`` next to process 1's ``running_var``. Accelerate saves
    process 0's model; so do we: the buffers are broadcast from process 0 (collective, in the same
    order on every process) before the snapshot and put back afterwards. FSDP (1 and 2) shards
    parameters only and leaves buffers as plain, per-process tensors, so the same holds there.
    Single-process runs are left alone.
    """
    import torch.distributed as dist

    if accelerator.num_processes <= 1 or not dist.is_available() or not dist.is_initialized():
        yield
        return
    models = list(accelerator._models)
    own: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for i in model_indices:
                for buf in models[i].buffers():
                    if buf.device.type == "meta" or buf.numel() == 0:
                        continue
                    own.append((buf, buf.clone()))
                    data = buf.detach().contiguous()  # buf itself when it is contiguous
                    dist.broadcast(data.view(-1).view(torch.uint8), src=0)  # as bytes: any dtype (float8 too)
                    if data.data_ptr() != buf.data_ptr():
                        buf.copy_(data)
        yield
    finally:
        with torch.no_grad():
            for buf, mine in own:
                buf.copy_(mine)


def build_state(accelerator: Any, model_indices: list[int], options: Options, saving: bool = False) -> dict:
    """The unickpt state of ``accelerator`` (see the module docstring), for a save or as a load target.

    Args:
        accelerator: an ``accelerate.Accelerator`` (not DeepSpeed / Megatron-LM / XLA: those keep
            Accelerate's own path).
        model_indices: indices into ``accelerator._models`` of the models to include (a save or load
            pre-hook may have taken some out).
        options: the plugin options (RNG resharding rule).
        saving: build the state of a save (collective on several processes: registered objects
            are taken from process 0, see :class:`Process0State`), not a load target.
    """
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    fsdp = accelerator.distributed_type == DistributedType.FSDP
    all_models = list(accelerator._models)
    models: dict[str, Any] = {}
    for i in model_indices:
        model = all_models[i]
        if fsdp and _is_fsdp1(model):
            from unickpt import fsdp as unickpt_fsdp  # not `import unickpt.fsdp`: that makes `unickpt` local here

            models[str(i)] = unickpt_fsdp.model_state(model)
        else:
            models[str(i)] = model
    saved_models = [all_models[i] for i in model_indices]

    optimizers: dict[str, Any] = {}
    for i, opt in enumerate(accelerator._optimizers):
        inner = getattr(opt, "optimizer", opt)
        owner = _owner(inner, all_models)
        if owner is not None and fsdp and _is_fsdp1(owner):
            from unickpt import fsdp as unickpt_fsdp

            optimizers[str(i)] = unickpt_fsdp.optimizer_state(owner, inner)
        elif owner is not None and any(owner is m for m in saved_models):
            optimizers[str(i)] = inner  # the core pairs it with its model (and guards it in overlap snapshots)
        else:
            optimizers[str(i)] = ext.StateTools.optimizer_state(owner, inner)

    state: dict[str, Any] = {
        "accelerate": {"step": int(accelerator.step), "iteration": int(accelerator.save_iteration),
                       "num_processes": int(accelerator.num_processes),
                       "distributed_type": str(accelerator.distributed_type)},
    }
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["models"] = models
    state["optimizers"] = optimizers
    from_process0 = saving and accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized()
    # schedulers can hold tensors too (ReduceLROnPlateau's best metric), so both are process 0's
    state["schedulers"] = {str(i): Process0State(s, f"schedulers.{i}") if from_process0 else s
                           for i, s in enumerate(accelerator._schedulers)}
    state["dataloaders"] = {str(i): DataLoaderState(dl, f"dataloaders.{i}")
                            for i, dl in enumerate(accelerator._dataloaders)}
    stateful = {str(i): unickpt.PerRank(dl) for i, dl in enumerate(accelerator._dataloaders)
                if getattr(dl, "use_stateful_dataloader", False)}
    if stateful:
        state["dataloader_states"] = stateful
    state["custom"] = {str(i): Process0State(obj, f"custom.{i}") if from_process0 else obj
                       for i, obj in enumerate(accelerator._custom_objects)}
    state["rng"] = rng_state(options)
    return state
