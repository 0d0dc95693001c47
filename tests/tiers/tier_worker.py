"""A training script for the tier tests, run by ``torchrun`` (two launches = two simulated nodes).

Modes:

* ``train``: steps ``--start`` .. ``--start + --steps - 1``; each step sets the state to the values of
  that step (:func:`expected`) and calls ``Checkpointer.save(step, state)`` (memory every
  ``--memory-every`` steps, storage every ``--persist-every``). With ``--hold`` the ranks then wait
  for their memory saves and peer copies, write ``ready_<rank>`` and sleep until killed (a crash).
  With ``--until-preempted`` the loop runs on (``--step-sleep`` seconds per step) until a
  preemption notice made the checkpointer save; ``result_<rank>.json`` then says which step.
* ``recover``: a zeroed state, ``Checkpointer.load``, then a bitwise check against
  :func:`expected` of the step loaded; ``result_<rank>.json`` holds the step, the tier, bytes per
  tier, bytes read under the persistent root (counted by a storage wrapper), and timings.

Every rank's state: a row-sharded DTensor (its own rows), a replicated tensor, a module and its SGD
optimizer (momentum buffers), a plain value and a per-rank value.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROWS, COLS = 64, 33


def expected(step: int, rank: int, ws: int) -> dict:
    """The values of every leaf at ``step`` on ``rank`` (deterministic, distinct per step and rank)."""
    base = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return {
        "w": base + 1000.0 * step + 100000.0 * rank,
        "rep": torch.linspace(0, 1, 257, dtype=torch.float64) * step,
        "weight": torch.full((8, 16), 0.5 * step),
        "bias": torch.full((8,), -0.25 * step),
        "mom_weight": torch.full((8, 16), 0.125 * step),
        "mom_bias": torch.full((8,), 2.0 * step),
        "step": step,
        "mine": {"rank": rank, "step": step},
    }


class Mine:
    def __init__(self):
        self.value = {"rank": -1, "step": -1}

    def state_dict(self):
        return dict(self.value)

    def load_state_dict(self, sd):
        self.value = dict(sd)


def make_state(rank: int, ws: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import unickpt

    mesh = init_device_mesh("cpu", (ws,))
    w = DTensor.from_local(torch.zeros(ROWS, COLS), mesh, [Shard(0)], run_check=False)
    model = torch.nn.Linear(16, 8)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 16)).sum().backward()
    optim.step()  # the momentum buffers exist
    optim.zero_grad(set_to_none=True)
    mine = Mine()  # per-rank state, as an RNG or a data loader position would be
    return {"w": w, "rep": torch.zeros(257, dtype=torch.float64), "model": model, "optim": optim, "step": -1,
            "mine": unickpt.PerRank(mine)}


def fill(state: dict, step: int, rank: int, ws: int) -> None:
    e = expected(step, rank, ws)
    with torch.no_grad():
        state["w"].to_local().copy_(e["w"])
        state["rep"].copy_(e["rep"])
        state["model"].weight.copy_(e["weight"])
        state["model"].bias.copy_(e["bias"])
        st = state["optim"].state
        st[state["model"].weight]["momentum_buffer"].copy_(e["mom_weight"])
        st[state["model"].bias]["momentum_buffer"].copy_(e["mom_bias"])
    state["step"] = step
    state["mine"].value.value = dict(e["mine"])


def check(state: dict, step: int, rank: int, ws: int) -> list[str]:
    """Leaves that differ bitwise from :func:`expected` (empty: all equal)."""
    e = expected(step, rank, ws)
    st = state["optim"].state
    got = {"w": state["w"].to_local(), "rep": state["rep"], "weight": state["model"].weight.detach(),
           "bias": state["model"].bias.detach(), "mom_weight": st[state["model"].weight]["momentum_buffer"],
           "mom_bias": st[state["model"].bias]["momentum_buffer"]}
    bad = [k for k, v in got.items() if not (v.dtype == e[k].dtype and torch.equal(v, e[k]))]
    if state["step"] != step:
        bad.append("step")
    if state["mine"].value.value != e["mine"]:
        bad.append("mine")
    return bad


def count_reads_under(root: str) -> dict:
    """Count the bytes every storage backend of this process reads under ``root``."""
    from unickpt.storage import add_wrapper

    counter = {"bytes": 0, "reads": 0}
    prefix = os.path.abspath(root)

    class Counting:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def _hit(self, path, n):
            if os.path.abspath(str(path)).startswith(prefix):
                counter["bytes"] += n
                counter["reads"] += 1

        def read_bytes(self, path):
            data = self._inner.read_bytes(path)
            self._hit(path, len(data))
            return data

        def read_into(self, path, ranges, dest, base):
            self._inner.read_into(path, ranges, dest, base)
            self._hit(path, sum(n for _, n in ranges))

    add_wrapper(Counting)
    return counter


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "recover"])
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--memory-every", type=int, default=1)
    p.add_argument("--persist-every", type=int, default=None)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--until-preempted", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--keep", type=int, default=1)
    a = p.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s rank" + os.environ.get("RANK", "?") + " %(message)s")
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    import unickpt
    from unickpt.options import TierOptions

    counter = count_reads_under(a.root)
    state = make_state(rank, ws)
    ckpt = unickpt.Checkpointer(a.root, memory_every=a.memory_every, persist_every=a.persist_every,
                                tiers=TierOptions(memory_keep=a.keep))
    os.makedirs(a.out, exist_ok=True)
    result: dict = {"rank": rank, "pid": os.getpid(), "node": ckpt.tiers.node, "t_start": T_START}
    with open(os.path.join(a.out, f"pid_{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if a.mode == "train":
        step = a.start
        while True:
            fill(state, step, rank, ws)
            ckpt.save(step, state)
            last = step
            if ckpt.preempted:
                result.update(preempted_step=ckpt.preempted_step, preempt_save_s=ckpt.preempt_save_s,
                              notice=ckpt.tiers.notice.received, saved_at=time.time())
                break
            step += 1
            if not a.until_preempted and step >= a.start + a.steps:
                break
            if a.step_sleep:
                if rank == 0 and a.until_preempted:
                    with open(os.path.join(a.out, "progress"), "w") as f:
                        f.write(str(step))
                time.sleep(a.step_sleep)
        ckpt.wait()
        result["last_step"] = last
        result["memory_bytes"] = ckpt.tiers.memory_bytes()
        result["agree_s"] = sorted(ckpt.tiers.agree_s)
        last = ckpt.tiers.last_agreement  # the watermarks of the last retention
        result["agreed"] = {"finished": last.finished, "watermark": last.watermark}
        if a.hold:
            with open(os.path.join(a.out, f"result_{rank}.json"), "w") as f:
                json.dump(result, f)
            with open(os.path.join(a.out, f"ready_{rank}"), "w") as f:
                f.write("1")
            while True:  # the test kills the job
                time.sleep(1)
    else:
        for k in ("w", "rep"):
            (state[k].to_local() if k == "w" else state[k]).zero_()
        t0 = time.time()
        step = ckpt.load(state)
        t1 = time.time()
        stats = ckpt.last_load_stats
        result.update(step=step, load_s=t1 - t0, restart_s=t1 - T_START, tier=stats.tier if stats else None,
                      bytes_by_tier=stats.bytes_by_tier if stats else {}, storage_root_bytes=counter["bytes"],
                      peer_bytes_received=stats.peer_bytes_received if stats else 0,
                      bad=check(state, step, rank, ws) if step is not None else None)
    ckpt.close()
    with open(os.path.join(a.out, f"result_{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
