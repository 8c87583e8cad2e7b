"""Environments that misbehave, for the subprocess-limit tests (imported by the child)."""

from __future__ import annotations

import asyncio
import time

from gyre_async.envs.base import Env, StepResult


class Misbehaving(Env):
    """Resets fine; ``step`` does what ``mode`` says: hog memory, spin the CPU, or hang."""

    max_steps = 50

    def __init__(self, mode: str = "memory", **_):
        self.mode = mode

    async def reset(self, task_id: str, seed: int) -> str:
        return f"task {task_id} seed {seed}"

    async def step(self, action: str) -> StepResult:
        if self.mode == "memory":
            hog = [bytearray(64 << 20) for _ in range(64)]  # 4 GiB, 64 MiB at a time
            return StepResult(str(len(hog)), 0.0, False, False, False, 0.0)
        if self.mode == "cpu":
            deadline = time.monotonic() + 3600
            while time.monotonic() < deadline:
                pass
        if self.mode == "hang":
            time.sleep(3600)  # noqa: ASYNC251 - a hung tool that blocks its whole process
        await asyncio.sleep(0)
        return StepResult(f"ok {action}", 1.0, False, False, False, 0.0)


class Stating(Env):
    """States its task at reset and adds every action to it (``Env.task`` through a wrapper)."""

    max_steps = 50

    def __init__(self, **_):
        self.stated = ""

    async def reset(self, task_id: str, seed: int) -> str:
        self.stated = f"task {task_id}"
        return "start"

    async def step(self, action: str) -> StepResult:
        self.stated += f", then {action}"
        return StepResult(f"did {action}", 0.0, False, False, False, 0.0)

    def task(self) -> str:
        return self.stated
