"""Rank-side helpers for tests/plugins/megatron/test_megatron.py: a small megatron-core GPT on CPU + gloo.

Runs inside a :class:`unickpt.testing.DistPool` of 4 ranks; each function is called on every rank.
The pool's one process group is reused for every layout: ``setup(tp, pp)`` re-initializes megatron's
``parallel_state`` (DP = 4 / (TP x PP)) and builds the model again.

Parameter values are a function of the global element index and the key (:func:`fill`), so they are
independent of the layout and every replica (TP-replicated layernorms, the output layer tied to the
embedding) holds the same values, as megatron keeps them in training.
"""
from __future__ import annotations

import hashlib
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

_M: dict = {}


def _shim() -> None:
    """Apply the test-only torch.cuda shim in this (worker) process only, never in pytest's own."""
    import megatron_cuda_shim  # noqa: F401  (megatron-core's checkpoint path calls torch.cuda)


def setup(tp: int, pp: int = 1, seed: int = 0) -> dict:
    """Build the GPT for TP x PP (x DP) and fill it with :func:`fill` ``(seed)``; returns the layout."""
    _shim()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(0)
    # gated_linear_unit: linear_fc1 is saved through megatron's SwiGLU ShardedTensorFactory (two shards
    # of one key per rank); bias on, so every layer has weights, biases and layernorms
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu,
                            pipeline_dtype=torch.float32, params_dtype=torch.float32)
    _M["model"] = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                           max_sequence_length=16, pre_process=ps.is_pipeline_first_stage(),
                           post_process=ps.is_pipeline_last_stage())
    fill(seed)
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _tensors(sd: dict) -> list:
    """Every ShardedTensor of ``sd`` after megatron's factories are applied (the SwiGLU fc1 halves are
    views of the parameter, so writing them writes the model)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sd)
    return [sh for sh in nested_values(sd) if isinstance(sh, ShardedTensor)]


def _global_values(key: str, global_shape: tuple, offsets: tuple, lengths: tuple, seed: int) -> torch.Tensor:
    salt = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") % 1000
    idx = torch.zeros(lengths, dtype=torch.float64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        shape = [1] * len(global_shape)
        shape[d] = lengths[d]
        idx = idx + (torch.arange(offsets[d], offsets[d] + lengths[d], dtype=torch.float64) * stride).view(shape)
        stride *= global_shape[d]
    return torch.sin(idx * (0.37 + seed) + salt + seed)


def fill(seed: int) -> None:
    """Set every parameter to a function of (key, global index, seed): identical on every layout."""
    _shim()
    with torch.no_grad():
        for sh in _tensors(_M["model"].sharded_state_dict()):
            lengths = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            vals = _global_values(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), lengths, seed)
            sh.data.copy_(vals.reshape(sh.data.shape).to(sh.data.dtype))


def full_tensors() -> dict | None:
    """Rank 0: every ShardedTensor key of the model -> its full global tensor, assembled from every
    rank's local shards over the world (independent of the checkpoint code). Other ranks: None."""
    _shim()
    parts = [(sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
              (1,) * sh.prepend_axis_num + tuple(sh.local_shape), sh.data.detach().clone())
             for sh in _tensors(_M["model"].sharded_state_dict())]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, parts)
    if dist.get_rank() != 0:
        return None
    full: dict = {}
    for rank_parts in gathered:
        for key, gshape, offs, lens, data in rank_parts:
            t = full.setdefault(key, torch.full(gshape, float("nan"), dtype=data.dtype))
            box = t[tuple(slice(o, o + n) for o, n in zip(offs, lens))]
            box.copy_(data.reshape(lens))
    return full


def _state(rank_object: bool = True) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = _M["model"].sharded_state_dict()
    sd["iteration"] = 42  # a common value: megatron's common.pt
    if rank_object:
        # like Megatron-LM's rng_state: one object per (PP, TP) rank, replicated over DP
        pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
        value = {"tp": tp, "pp": pp, "torch": torch.arange(4, dtype=torch.int64) + 10 * tp + 100 * pp,
                 "tuple": (1, "two", 3.0)}
        sd["rng_state"] = ShardedObject("rng_state", value,
                                        (ps.get_pipeline_model_parallel_world_size(),
                                         ps.get_tensor_model_parallel_world_size()),
                                        (pp, tp), replica_id=ps.get_data_parallel_rank())
    return sd


def save(path: str, async_save: bool = False, fully_parallel: bool = False, balance_replicas: bool = False) -> dict:
    """dist_checkpointing.save with backend unickpt; async through megatron's AsyncCallsQueue.

    Async: after async_save returns, the parameters are overwritten (fill(99)) before the request
    is finalized; the checkpoint must still hold the values at save time."""
    _shim()
    import unickpt.megatron as um
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = um.UnickptSaveShardedStrategy(balance_replicas=balance_replicas)
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True))
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    req = dist_checkpointing.save(_state(), path, strategy, async_sharded_save=async_save)
    if async_save:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        import multiprocessing

        # DistPool workers are daemonic, and megatron's TemporalAsyncCaller forks a child for
        # async_fn: let this worker have one (a launcher-started rank is not daemonic)
        cfg = multiprocessing.current_process()._config
        daemon = cfg.get("daemon")
        cfg["daemon"] = False
        try:
            import pickle

            # megatron's persistent checkpoint worker (--use-persistent-ckpt-worker) receives the
            # request through a spawn-context queue, without its finalize functions
            sent = pickle.loads(pickle.dumps(req.freeze()._replace(finalize_fns=[])))
            assert sent.async_fn is req.async_fn and sent.async_fn_args == req.async_fn_args
            q = AsyncCallsQueue()
            q.schedule_async_request(req)
            fill(99)  # training goes on while the checkpoint is written
            assert q.get_num_unfinalized_calls() == 1
            q.maybe_finalize_async_calls(blocking=True, no_dist=False)
            q.close()
        finally:
            cfg["daemon"] = daemon
    files = sorted(os.listdir(path))
    return {"files": files, "data": sorted(os.listdir(os.path.join(path, "unickpt", "data")))}


def load(path: str, object_policy: str | None = None, fully_parallel: bool = False, rank_object: bool = True):
    """dist_checkpointing.load into the current layout (after fill(7) so the model differs first).
    Returns this rank's loaded common value and rng_state (or "absent")."""
    _shim()
    import unickpt.megatron as um
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    fill(7)
    strategy = None if object_policy is None else um.UnickptLoadShardedStrategy(object_policy=object_policy)
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(strategy or um.UnickptLoadShardedStrategy(),
                                                    ps.get_data_parallel_group(with_context_parallel=True))
    sd = dist_checkpointing.load(_state(rank_object), path, strategy)
    iteration, rng = sd.pop("iteration"), sd.pop("rng_state", "absent")
    _M["model"].load_state_dict(sd)
    return {"iteration": iteration, "rng_state": rng}


def load_expect_error(path: str) -> tuple[str, str]:
    try:
        load(path)
    except Exception as e:
        return type(e).__name__, str(e)
    return ("no error", "")


# ---- flattened_range (the distributed optimizer's shards in megatron-core < 0.16) ------------------ #
# megatron-core 0.16.1 cannot build its DistributedOptimizer on a CPU-only torch (optimizer.py creates
# tensors on device='cuda'), and its ShardedTensor rejects flattened_range in __post_init__; older
# releases built them with ShardedTensor.from_rank_offsets_flat. These helpers build such shards the
# way those releases did (a regular ShardedTensor, then flattened_range set) and go through the
# strategies directly.
GLOBAL = (8, 6)


def _flat_shard(key: str, axis: int, parts: int, part: int, dp: int, dp_rank: int, data=None):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    local = list(GLOBAL)
    local[axis] //= parts
    offs = [0, 0]
    offs[axis] = part * local[axis]
    n = local[0] * local[1]
    start, stop = dp_rank * n // dp, (dp_rank + 1) * n // dp
    box_vals = _global_values(key, GLOBAL, tuple(offs), tuple(local), 3).to(torch.float32).reshape(-1)
    data = box_vals[start:stop].clone() if data is None else data
    sh = ShardedTensor(key, torch.empty(local), torch.float32, tuple(local), GLOBAL, tuple(offs),
                       (parts if axis == 0 else 1, parts if axis == 1 else 1), replica_id=(0, 0, 0))
    sh.data, sh.flattened_range = data, slice(start, stop)  # what from_rank_offsets_flat produced before 0.16
    return sh, box_vals[start:stop]


def flat_save(path: str) -> str:
    """4 ranks: 2 row boxes (dim 0, contiguous globally) x 2 DP flat ranges of each box."""
    _shim()
    import unickpt.megatron as um

    r = dist.get_rank()
    sh, _ = _flat_shard("optimizer.state.exp_avg.w", 0, 2, r // 2, 2, r % 2)
    um.UnickptSaveShardedStrategy().save({"w": sh}, path)
    return "ok"


def flat_load(path: str, axis: int, parts: int, dp: int) -> bool:
    """Load into boxes along ``axis`` (``parts`` of them) split into ``dp`` flat ranges; bitwise check."""
    _shim()
    import unickpt.megatron as um

    r = dist.get_rank()
    sh, want = _flat_shard("optimizer.state.exp_avg.w", axis, parts, (r // dp) % parts, dp, r % dp)
    sh.data = torch.full_like(sh.data, float("nan"))
    got = um.UnickptLoadShardedStrategy().load({"w": sh}, path)["w"]
    return got is sh.data and torch.equal(got, want)


def flat_save_noncontiguous(path: str) -> tuple[str, str]:
    """Column boxes (dim 1) split into flat ranges that span rows: not storable, every rank fails."""
    _shim()
    import unickpt.megatron as um

    r = dist.get_rank()
    sh, _ = _flat_shard("w", 1, 2, r // 2, 2, r % 2)
    try:
        um.UnickptSaveShardedStrategy().save({"w": sh}, path)
    except Exception as e:
        return type(e).__name__, str(e)
    return ("no error", "")


def load_missing_key(path: str) -> tuple[str, str]:
    """Request a ShardedTensor key the checkpoint lacks: every rank must raise the same error."""
    _shim()
    import unickpt.megatron as um

    sh, _ = _flat_shard("no.such.key", 0, 2, dist.get_rank() // 2, 2, dist.get_rank() % 2)
    try:
        um.UnickptLoadShardedStrategy().load({"x": sh}, path)
    except Exception as e:
        return type(e).__name__, str(e)
    return ("no error", "")


def overwrite_and_plain(path: str) -> dict:
    """Megatron's overwrite semantics and load_plain_tensors on a unickpt checkpoint.

    ``path`` holds a committed checkpoint of the current model. Saves again into it (fill(8): must
    replace it, as dist_checkpointing.save does for torch_dist), starts an async save into it and
    saves there again before finalizing (must fail on every rank naming the in-flight save), then
    reads it back with megatron's load_plain_tensors (whole stacked tensors, prepend_axis_num 0).
    Returns on rank 0: the in-flight error, and whether the loaded / plain tensors equal fill(8)'s."""
    _shim()
    import unickpt.megatron as um
    from megatron.core import dist_checkpointing

    fill(8)
    want = full_tensors()
    dist_checkpointing.save(_state(), path, ("unickpt", 1))
    req = dist_checkpointing.save(_state(), path, ("unickpt", 1), async_sharded_save=True)
    try:
        dist_checkpointing.save(_state(), path, um.UnickptSaveShardedStrategy())
        err = ("no error", "")
    except Exception as e:
        err = (type(e).__name__, str(e))
    req.execute_sync()
    load(path)
    got = full_tensors()
    plain = dist_checkpointing.load_plain_tensors(path)
    if dist.get_rank() != 0:
        return {}
    plain.pop("iteration")
    return {"error": err, "loaded": sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want),
            "plain": sorted(want) == sorted(plain) and all(torch.equal(want[k], plain[k]) for k in want)}


def padded_load(path: str) -> list:
    """Load the (8, 6) ``flat_save`` tensor as a (12, 6) one (a padded vocabulary), 3 rows per rank:
    without ``allow_shape_mismatch`` an error, with it megatron's rule (zeros, then the stored overlap:
    rank 2 gets 2 stored rows, rank 3 none). Returns [(error type, message), bitwise equal]."""
    _shim()
    import unickpt.megatron as um
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    key, r = "optimizer.state.exp_avg.w", dist.get_rank()
    want = torch.zeros(12, 6)
    want[:8] = _global_values(key, GLOBAL, (0, 0), GLOBAL, 3).to(torch.float32)
    out: list = []
    for allow in (False, True):
        sh = ShardedTensor.from_rank_offsets(key, torch.full((3, 6), float("nan")), (0, r, 4), allow_shape_mismatch=allow)
        try:
            got = um.UnickptLoadShardedStrategy().load({"w": sh}, path)["w"]
        except Exception as e:
            out.append((type(e).__name__, str(e)))
            continue
        out.append(got is sh.data and torch.equal(got, want[3 * r:3 * r + 3]))
    return out


# ---- several shards of one key per rank, of unequal sizes (megatron-core's test_uneven_1d_sharding_multiple_shards) -- #
def _uneven_shards(split: list, fill: bool) -> dict:
    """This rank's ShardedTensors of a 1-D key ``"a"`` cut by ``split`` (one list of shard lengths per
    rank, in global order): values are the global element indices (``fill``) or NaN."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    r = dist.get_rank()
    total, at = sum(map(sum, split)), sum(map(sum, split[:r]))
    out = {}
    for i, n in enumerate(split[r]):
        data = torch.arange(at, at + n, dtype=torch.float32) if fill else torch.full((n,), float("nan"))
        out[i] = ShardedTensor("a", data, data.dtype, tuple(data.shape), (total,), (at,), None)
        at += n
    return out


def uneven_save_load(path: str, src: list, dest: list) -> list:
    """dist_checkpointing.save with the unickpt strategy of the shards of ``src``, then load into the
    shards of ``dest``. Returns, per shard of ``dest`` on this rank, whether it holds its global indices
    (bitwise), or ``(error type, message)`` of a failed save."""
    _shim()
    import unickpt.megatron as um
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    try:
        dist_checkpointing.save(_uneven_shards(src, True), path, um.UnickptSaveShardedStrategy())
    except Exception as e:
        return [(type(e).__name__, str(e))]
    want = _uneven_shards(dest, True)
    got = dist_checkpointing.load(_uneven_shards(dest, False), path, um.UnickptLoadShardedStrategy())
    return [sorted(got) == sorted(want) and torch.equal(got[i], want[i].data) for i in sorted(want)]


def more_prepended_load(path: str) -> list:
    """Save a plain (4, 6) key (row r on rank r, no prepended axis), then load it with one prepended axis
    more than saved, as megatron-core's test_partition_change_save_load does (``prepend_axis_num=1``:
    the global shape is the same, the stored tensor is read as a stack of rows): rank r reads row r
    whole, then half of row 3 - r (not a cover of the tensor: megatron's access validation, which raises
    on rank 0 only, is off for it). Returns [bitwise equal per load] or [(error type, message)]."""
    _shim()
    import unickpt.megatron as um
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    r = dist.get_rank()
    full = torch.arange(24, dtype=torch.float32).view(4, 6)
    if r == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"b": ShardedTensor.from_rank_offsets("keyB", full[r:r + 1].clone(), (0, r, 4))}, path,
                            um.UnickptSaveShardedStrategy())
    requests = [(ShardedTensor.from_rank_offsets("keyB", torch.full((6,), float("nan")), (0, r, 4), prepend_axis_num=1,
                                                 replica_id=0), full[r]),
                (ShardedTensor.from_rank_offsets("keyB", torch.full((3,), float("nan")), (0, 3 - r, 4), (1, r % 2, 2),
                                                 prepend_axis_num=1, replica_id=0), full[3 - r, 3 * (r % 2):3 * (r % 2) + 3])]
    out = []
    for (sh, want), validate in zip(requests, (True, False)):
        try:
            got = dist_checkpointing.load({"b": sh}, path, validate_access_integrity=validate)["b"]
        except Exception as e:
            return [(type(e).__name__, str(e))]
        out.append(tuple(got.shape) == tuple(want.shape) and torch.equal(got, want))
    return out


def load_errors(path: str) -> list:
    """Save a (2, 16) key (columns split over the 4 ranks), then load it as (2, 12) and under a key the
    checkpoint lacks, through dist_checkpointing.load (megatron-core's test_tensor_shape_mismatch and
    test_load_error_msg). Returns per load: (is a CheckpointingException, is a unickpt.StateMismatchError,
    is a ValueError, type name, message)."""
    _shim()
    import unickpt
    import unickpt.megatron as um
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    r = dist.get_rank()
    if r == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("keyA", torch.ones(2, 4), (1, r, 4))}, path,
                            um.UnickptSaveShardedStrategy())
    out = []
    for key, cols in (("keyA", 3), ("different_key", 4)):
        try:
            dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets(key, torch.zeros(2, cols), (1, r, 4))}, path)
            out.append("no error")
        except Exception as e:
            out.append((isinstance(e, CheckpointingException), isinstance(e, unickpt.StateMismatchError),
                        isinstance(e, ValueError), type(e).__name__, str(e)))
    return out


def logs_at_info(path: str) -> list[str]:
    """With the root logger at INFO (megatron-core's test conftest sets it so), a dist_checkpointing
    save and load with the unickpt strategies; returns every record at INFO or above that reached the
    root logger on this rank, as "logger LEVEL message"."""
    _shim()
    import logging

    import unickpt.megatron as um
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.name} {record.levelname} {record.getMessage()}")

    r = dist.get_rank()
    if r == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    root, handler = logging.getLogger(), Keep(logging.INFO)
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0) + 8 * r, (0, r, 4))}
        dist_checkpointing.save(sd, path, um.UnickptSaveShardedStrategy())
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8), (0, r, 4))}
        loaded = dist_checkpointing.load(sd, path, um.UnickptLoadShardedStrategy())
        assert torch.equal(loaded["w"], torch.arange(8.0) + 8 * r)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return records
