"""A training process for the fault-injection tests: resumes from the latest committed checkpoint,
then saves steps with a Checkpointer, and SIGKILLs itself at a chosen point of one save.

Usage: python fault_child.py ROOT STAGE KILL_STEP NUM_STEPS
STAGE: none | snapshot | mid-write | before-commit | after-commit | retention | loop (no self-kill:
saves async in a loop until killed from outside). The state of step s is w = s + arange(W) (float32),
so a loaded checkpoint can be checked bitwise.
"""
from __future__ import annotations

import os
import signal
import sys

import torch

import unickpt
from unickpt.storage import Storage

W = 1 << 20  # 4 MiB of float32


def value(step: int) -> torch.Tensor:
    return torch.arange(W, dtype=torch.float32) + step


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(stage: str, armed: dict) -> None:
    write_file, write_atomic, rm = Storage.write_file, Storage.write_atomic, Storage.rm

    def mid_write(self, path, buffers, **kw):
        if armed["on"] and path.endswith(".bin"):
            bufs = list(buffers)
            fd = os.open(self.strip(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, memoryview(bufs[0]).cast("B")[: max(1, memoryview(bufs[0]).nbytes // 2)])
            die()
        return write_file(self, path, buffers, **kw)

    def commit(self, path, data):
        if armed["on"] and path.endswith("metadata.json") and stage == "before-commit":
            die()
        write_atomic(self, path, data)
        if armed["on"] and path.endswith("metadata.json") and stage == "after-commit":
            die()

    def retention(self, path):
        if armed["on"]:
            die()
        rm(self, path)

    if stage == "mid-write":
        Storage.write_file = mid_write
    elif stage in ("before-commit", "after-commit"):
        Storage.write_atomic = commit
    elif stage == "retention":
        Storage.rm = retention


class KillOnSnapshot:
    def __init__(self, armed: dict):
        self.armed = armed

    def state_dict(self):
        if self.armed["on"] and self.armed["stage"] == "snapshot":
            die()
        return {"ok": True}

    def load_state_dict(self, state):
        pass


def main() -> None:
    root, stage, kill_step, num_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    armed = {"on": False, "stage": stage}
    install(stage, armed)
    ckpt = unickpt.Checkpointer(root, keep_last=2, async_save=stage == "loop")
    state = {"w": torch.zeros(W), "step": -1, "probe": KillOnSnapshot(armed)}
    resumed = ckpt.load(state)
    if resumed is not None:
        assert torch.equal(state["w"], value(resumed)) and state["step"] == resumed, "resumed state is wrong"
    start = 0 if resumed is None else resumed + 1
    for step in range(start, start + num_steps):
        state["w"].copy_(value(step))
        state["step"] = step
        armed["on"] = step == kill_step
        ckpt.save(step, state)
        armed["on"] = False
    ckpt.close()
    print(f"resumed={resumed} last={start + num_steps - 1}", flush=True)


if __name__ == "__main__":
    main()
