"""Plan agreement: every rank of a save ends up with the same :class:`~unickpt.plan.save_plan.SavePlan`.

Runs on the save thread, on the private *plan* gloo group (:mod:`unickpt.dist.comm`). Collectives:

1. always: a fixed-size ``all_gather`` of :data:`SIG_BYTES` bytes per rank: an error flag, the
   16-byte signature of the rank's local plan, 8-byte digests of its plain-value keys, of the
   plan-shaping options, of its tensor table and of the save's target (path and step), and the
   default replica check's sample (:class:`~.replicas.RotatingSample`: 8 bytes naming the plan the
   rank expects and :data:`~.replicas.SLOTS` 8-byte digests, computed before the exchange from the
   plan this rank last agreed with the same signature; zeros when there is none). A failed rank
   sets the flag; then the failures are gathered (2 more) and raised on every rank with one type
   (:class:`~unickpt.errors.SaveFailedError`, or the failure's own type when every failing rank agrees
   on CheckpointExistsError, UnsafeObjectError, or a ValueError / TypeError of the call's options). Ranks that name different
   targets (paths or steps) are told so on every rank (2 more, to name them) before anything is
   written: saving under rank 0's name would commit a checkpoint missing the other ranks' files.
2. on a plan-cache miss only: the local plans are gathered as compact JSON (2 collectives, no pickle;
   a rank whose signature repeats an earlier rank's sends nothing, one whose tensor table repeats an
   earlier rank's sends its shards only: what travels grows with the distinct layouts, not with ranks
   x keys), and :func:`~unickpt.plan.save_plan.make_save_plan` derives the same plan on every rank.

The exchange cannot be skipped safely: one rank's layout may change while the others' do not, and
only an exchange lets all ranks hit or miss the cache together. A check (the replica check,
:mod:`.replicas`) runs on a miss before the plan is cached, so a layout whose check failed is checked
again at its next save; on a hit, ``check_replicas="sample"`` (the default) compares the sample that
came with the signatures (more collectives only when it differs or could not travel, see
:mod:`.replicas`; a failed sample is drawn again at the next save) and ``"always"`` runs the full check.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, Hashable

import torch

from ..dist.comm import Comm
from ..errors import CheckpointExistsError, ReplicaMismatchError, SaveFailedError, UnsafeObjectError
from ..options import SaveOptions
from ..plan.cache import PlanCache
from ..plan.save_plan import LocalPlan, SavePlan, decode_plans, make_save_plan
from .replicas import SLOTS, RotatingSample, check_replicas
from .request import SaveStats

__all__ = ["PlanAgreement", "SIG_BYTES", "PLAN_CACHE_SIZE"]

log = logging.getLogger("unickpt")

PLAN_CACHE_SIZE = 8  # distinct layouts remembered per engine (e.g. model-only vs full saves)
_SAMPLE_AT = 56  # error flag, 16-byte plan signature, 8-byte digests: objects, options, table, target (path, step)
SIG_BYTES = _SAMPLE_AT + 8 + 8 * SLOTS  # then the replica sample: the plan it was drawn from, the digests


def _digest8(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


class PlanAgreement:
    """The save plans of one group, agreed and cached (see the module docstring).

    Args:
        comm: the group's collectives (:class:`~unickpt.dist.comm.Comm`).
    """

    def __init__(self, comm: Comm):
        self.comm = comm
        self.cache: PlanCache[SavePlan] = PlanCache(PLAN_CACHE_SIZE)
        self._samples: dict[Hashable, RotatingSample] = {}  # cache key -> its replica sample ("sample" mode)
        self._last: dict[tuple, Hashable] = {}  # (options, this rank's signature) -> the key it last agreed

    def agree(self, path: str, local: LocalPlan, signature: str | None, local_error: BaseException | None,
              stats: SaveStats, opts: SaveOptions,
              check: Callable[[SavePlan, bool], None] = lambda plan, full: None, step: int | None = None,
              leaf: Callable[[str], torch.Tensor] | None = None) -> SavePlan:
        """The plan of this save on every rank. ``check(plan, full)`` (the replica check) runs on a miss
        before the plan is cached, and on a hit with ``check_replicas="always"``; on a hit with
        ``"sample"`` the rotating sample of ``leaf(fqn)`` (this rank's tensor of fqn) is compared.

        Raises CheckpointExistsError / UnsafeObjectError / ValueError / TypeError / SaveFailedError (a
        rank failed before planning), ValueError (ranks configured different plan options, or named
        different paths or steps), StateMismatchError (ranks disagree on a tensor's dtype or global shape),
        ReplicaMismatchError (the holders of a replicated chunk hold different bytes).
        """
        comm, world = self.comm, self.comm.world_size
        opt_digest = _digest8(repr(opts.plan_key()))
        mine = bytearray(SIG_BYTES)
        if local.error is None and signature is not None:
            mine[1:17] = bytes.fromhex(signature)
            mine[17:25] = bytes.fromhex(local.objects_digest or "00" * 8)
            mine[25:33] = opt_digest
            mine[33:41] = bytes.fromhex(local.table_digest())
            mine[41:49] = _digest8(repr((path, step)))
            expected = self._samples.get(self._last.get((opts.plan_key(), signature)))
            if opts.check_replicas == "sample" and expected is not None and expected.fits and leaf is not None:
                t0 = time.perf_counter()
                mine[_SAMPLE_AT:] = expected.id() + expected.folds(leaf)
                stats.replica_check_s += time.perf_counter() - t0
        else:
            mine[0] = 1
        if world > 1:
            import torch.distributed as dist

            t = torch.frombuffer(mine, dtype=torch.uint8)
            out = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(out, t, group=comm.plan_group)
            stats.collectives_plan += 1
            rows = [bytes(o.tolist()) for o in out]
        else:
            rows = [bytes(mine)]
        if any(r[0] for r in rows):
            self._raise_failures(path, local, local_error, stats)
        if any(r[41:49] != rows[0][41:49] for r in rows):
            targets = comm.all_gather((path, step), comm.plan_group) if world > 1 else [(path, step)]
            stats.collectives_plan += 2
            named = ", ".join(f"rank {r}: {p!r} step {s}" for r, (p, s) in enumerate(targets))
            raise ValueError(f"ranks saved to different targets ({named}); every rank of a save must name the same "
                             "path and step (nothing was written)")
        if any(r[25:33] != rows[0][25:33] for r in rows):
            raise ValueError(f"{path!r}: ranks configured different save options (flat_ranges, segment_bytes, "
                             f"upload_to, snapshot, check_replicas must agree); this rank has {opts.plan_key()}")
        differ = [r for r, row in enumerate(rows) if row[17:25] != rows[0][17:25]]
        if differ and comm.rank == 0:
            log.warning("unickpt: %s: rank(s) %s have other plain (non-tensor) keys than rank 0; only rank 0's "
                        "plain values are saved (declare per-rank values with unickpt.PerRank)", path, differ)
        key = (opts.plan_key(), tuple(r[1:17] for r in rows))
        cached = self.cache.get(key)
        if cached is not None:
            stats.plan_cache_hit = True
            if opts.check_replicas == "always":
                self._timed(stats, check, cached, True)
            elif opts.check_replicas == "sample":
                self._check_sample(key, cached, rows, stats, leaf)
            self._last[(opts.plan_key(), signature)] = key
            return cached
        plans = [local]
        if world > 1:
            first_of: dict[bytes, int] = {}
            firsts = [first_of.setdefault(row[1:17], r) for r, row in enumerate(rows)]
            table_of: dict[bytes, int] = {}
            table_firsts = [table_of.setdefault(row[33:41], r) for r, row in enumerate(rows)]
            me = comm.rank
            mine_bytes = b"" if firsts[me] != me else local.to_bytes(with_table=table_firsts[me] == me)
            blobs = comm.all_gather_bytes(mine_bytes, comm.plan_group)
            stats.collectives_plan += 2
            plans = decode_plans(blobs, firsts, table_firsts)
        plan = make_save_plan(plans, flat_ranges=opts.flat_ranges, segment_bytes=opts.segment_bytes,
                              partial=opts.partial, safetensors=opts.safetensors)
        if opts.check_replicas != "off":
            self._timed(stats, check, plan, opts.check_replicas == "always")
        self.cache.put(key, plan)
        if opts.check_replicas == "sample" and plan.replicas and world > 1:
            self._samples[key] = RotatingSample(plan.replicas, comm.rank, repr(key).encode())
        self._last[(opts.plan_key(), signature)] = key
        for k in [k for k in self._samples if k not in self.cache]:  # evicted plans
            del self._samples[k]
        for k in [k for k, v in self._last.items() if v not in self.cache]:
            del self._last[k]
        return plan

    @staticmethod
    def _timed(stats: SaveStats, check: Callable[[SavePlan, bool], None], plan: SavePlan, full: bool) -> None:
        t0 = time.perf_counter()
        try:
            check(plan, full)
        finally:
            stats.replica_check_s += time.perf_counter() - t0

    def _check_sample(self, key: Hashable, plan: SavePlan, rows: list[bytes], stats: SaveStats,
                      leaf: Callable[[str], torch.Tensor] | None) -> None:
        """``"sample"`` mode on a hit: compare the holders' digests of the rotating sample that came
        with the signatures; where they differ (to name the chunks) or could not come (a rank expected
        another plan, or is in more than SLOTS holder sets), compare chunk by chunk (2 collectives, 4
        when chunks differ). Raises ReplicaMismatchError on every rank; the count advances on a pass."""
        sample = self._samples.get(key)
        if sample is None or leaf is None:  # no replicated chunks
            return
        t0 = time.perf_counter()
        try:
            expected = sample.id()
            sent = sample.fits and all(r[_SAMPLE_AT:_SAMPLE_AT + 8] == expected for r in rows)
            differ = sample.differ([r[_SAMPLE_AT + 8:] for r in rows]) if sent else []
            if differ or not sent:
                leaves = {fqn: leaf(fqn) for fqn, _, ranks in plan.replicas if self.comm.rank in ranks}
                stats.collectives_plan += check_replicas(self.comm, plan.replicas, leaves, count=sample.count)
            if differ:  # the copies changed between the two digests
                raise ReplicaMismatchError(f"the ranks {differ[0]} held different bytes in chunks saved as "
                                           "replicated (written once) and then changed them during the save")
            sample.count += 1
        finally:
            stats.replica_check_s += time.perf_counter() - t0

    def _raise_failures(self, path: str, local: LocalPlan, local_error: BaseException | None,
                        stats: SaveStats) -> None:
        errors = [(local.error, local.error_type, local.error_message)]
        if self.comm.world_size > 1:
            errors = self.comm.all_gather(errors[0], self.comm.plan_group)
            stats.collectives_plan += 2
        failures = {r: e[0] for r, e in enumerate(errors) if e[0]}
        kinds = {e[1] for e in errors if e[0]}
        if kinds == {"UnsafeObjectError"}:  # every failing rank needs pickle: say so with its own type
            raise UnsafeObjectError(next(e[2] for e in errors if e[0])) from local_error
        if kinds == {"CheckpointExistsError"}:  # the target is taken: say so with its own type
            raise CheckpointExistsError(next(e[2] for e in errors if e[0])) from local_error
        if kinds in ({"options:ValueError"}, {"options:TypeError"}):  # bad options on some ranks
            if local_error is not None:
                raise local_error
            first = min(failures)
            raise (ValueError if kinds == {"options:ValueError"} else TypeError)(f"rank {first}: {errors[first][2]}")
        raise SaveFailedError(path, failures) from local_error
