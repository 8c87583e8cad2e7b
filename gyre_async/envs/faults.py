"""A fault-injecting wrapper: a share of training episodes crash mid-episode (drills, benches).

``task.fail_episode_rate = 0.1`` makes the sampler wrap each environment it builds
(:func:`with_faults`): at each ``reset`` the wrapper decides whether this episode will fail
(probability ``fail_episode_rate``) and at which step: uniformly among steps
``0 .. fail_within_steps - 1`` (``task.fail_within_steps``, 0: the environment's step cap).
That step raises :class:`InjectedFault` instead of acting, which the sampler's guard turns
into an ``env-error`` (kind ``exception``) like any real crash: the episode ends without an
outcome. A run with ``fail_episode_rate = 0`` is the same run without faults.

Why in the sampler only, by config, and not as a registered environment: validation and the
keeper's probe set build the task's environment too, and must stay fault-free (the probe set
must be the same at every restart); and any environment can be drilled, on the same task
ids and seeds as a fault-free run.

Deterministic per seed: every wrapper draws from its own stream, seeded by the run's seed
(and sampler replica) and the wrapper's ordinal among the wrappers this process built (the
sampler builds one per slot, in slot order), so a process replays the same schedule of
faults for the same sequence of resets. The draws never depend on the task, so the members
of a GRPO group (same task, different slots) fail independently.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from typing import Any

from gyre_async.envs.base import Env, StepResult

_ordinals = itertools.count()  # wrappers built in this process, in order


class InjectedFault(RuntimeError):
    """The fault this wrapper injected (never raised by a real environment)."""


@dataclass(frozen=True)
class FaultPlan:
    """One episode's fate: ``fail_at`` is the step index that raises (None: no fault)."""

    fail_at: int | None


class FaultSchedule:
    """The stream of per-episode fault decisions of one wrapper (pure, seeded)."""

    def __init__(self, rate: float, within_steps: int, seed: object, stream: int):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fail_episode_rate must be in [0, 1], got {rate}")
        if within_steps < 1:
            raise ValueError(f"fail_within_steps must be >= 1, got {within_steps}")
        self.rate = rate
        self.within_steps = within_steps
        digest = hashlib.blake2b(f"faults|{seed}|{stream}".encode(), digest_size=8).digest()
        self._rng = random.Random(int.from_bytes(digest, "big"))

    def next_episode(self) -> FaultPlan:
        """Two draws per episode whatever the outcome, so one decision never shifts the next."""
        fails = self._rng.random() < self.rate
        step = self._rng.randrange(self.within_steps)
        return FaultPlan(step if fails else None)


class FaultyEnv(Env):
    """``inner`` with injected mid-episode crashes (module docstring)."""

    def __init__(self, inner: Env, fail_episode_rate: float, fault_seed: object = 0,
                 fail_within_steps: int = 0, stream: int | None = None):
        self.inner = inner
        self.max_steps = inner.max_steps
        within = int(fail_within_steps) or int(inner.max_steps)
        self.schedule = FaultSchedule(float(fail_episode_rate), within, fault_seed,
                                      next(_ordinals) if stream is None else stream)
        self.plan = FaultPlan(None)
        self.step_index = 0
        self.injected = 0  # faults raised by this wrapper

    async def reset(self, task_id: str, seed: int) -> str:
        self.plan = self.schedule.next_episode()
        self.step_index = 0
        return await self.inner.reset(task_id, seed)

    async def step(self, action: str) -> StepResult:
        index, self.step_index = self.step_index, self.step_index + 1
        if self.plan.fail_at == index:
            self.injected += 1
            raise InjectedFault(f"injected fault at step {index}")
        return await self.inner.step(action)

    def admissible_actions(self) -> list[str]:
        return self.inner.admissible_actions()

    def task(self) -> str:
        return self.inner.task()

    async def close(self) -> None:
        await self.inner.close()


def with_faults(env: Env, task: Any, seed: object = 0) -> Env:
    """``env`` wrapped in a :class:`FaultyEnv` when ``task.fail_episode_rate > 0``, else
    ``env`` (the sampler's training episodes only: validation and the keeper's probe set
    stay fault-free). ``seed``: the run's (and replica's), so reruns draw the same faults."""
    if task.fail_episode_rate <= 0:
        return env
    return FaultyEnv(env, task.fail_episode_rate, seed, task.fail_within_steps)
