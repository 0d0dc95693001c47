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
from unickpt.testing import Fault, install as install_faults

W = 1 << 20  # 4 MiB of float32


def value(step: int) -> torch.Tensor:
    return torch.arange(W, dtype=torch.float32) + step


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm_later(stage: str) -> Fault | None:
    """The fault that kills this process at ``stage`` of a save (through unickpt.testing.faults),
    disarmed: main() arms it for the save of the kill step."""
    fault = {"mid-write": Fault("write", match="*.bin", action="kill", keep=0.5, enabled=False),
             "before-commit": Fault("rename", match="*metadata.json", action="kill", enabled=False),
             "after-commit": Fault("rename", match="*metadata.json", action="kill", after=True, enabled=False),
             "retention": Fault("rm", action="kill", enabled=False)}.get(stage)
    if fault is not None:
        install_faults(fault)  # for the life of the process: every storage it opens
    return fault


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
    fault = arm_later(stage)  # before the Checkpointer: its retention's storage is opened with it
    ckpt = unickpt.Checkpointer(root, keep_last=2, async_save=stage == "loop")
    state = {"w": torch.zeros(W), "step": -1, "probe": KillOnSnapshot(armed)}
    resumed = ckpt.load(state)
    if resumed is not None:
        assert torch.equal(state["w"], value(resumed)) and state["step"] == resumed, "resumed state is wrong"
    start = 0 if resumed is None else resumed + 1
    if stage == "loop":  # the parent kills at a random time after this line, whatever the start-up took
        print(f"ready resumed={resumed}", flush=True)
    for step in range(start, start + num_steps):
        state["w"].copy_(value(step))
        state["step"] = step
        armed["on"] = step == kill_step
        if fault is not None:
            fault.enabled = armed["on"]
        ckpt.save(step, state)
        armed["on"] = False
        if fault is not None:
            fault.enabled = False
    ckpt.close()
    print(f"resumed={resumed} last={start + num_steps - 1}", flush=True)


if __name__ == "__main__":
    main()
