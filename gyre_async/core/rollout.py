"""Running episodes: many environments, one batched policy, bounded contexts.

Shared by the sampler (training episodes, published step by step) and the evaluator
(validation episodes, summarised). Nothing here touches the bus.

- :class:`ActionBatcher` gathers the action requests of many concurrent episodes into one
  ``policy.act_batch`` call, run on a worker thread so the event loop (and every slow
  environment) keeps moving while the policy computes.
- :func:`run_episode` drives one episode: bounded context (milestone summary + recent turns
  + current observation), guarded env calls (a hung or failing env ends only its own
  episode, as truncated, reported in the summary's ``failure``), one callback per step.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gyre_async import timing
from gyre_async.envs.base import (
    Env,
    EnvFailure,
    StepResult,
    guarded_reset,
    guarded_step,
)
from gyre_async.policy.base import Action, Policy, SamplingParams
from gyre_async.policy.context import ContextBuilder
from gyre_async.policy.factory import load_weights


@dataclass(frozen=True)
class Acted:
    action: Action
    policy_version: int


class PolicyHolder:
    """The policy a process acts with, swapped in place when a new version arrives.

    A lock keeps a weight load from interleaving with a batched forward pass.
    """

    def __init__(self, policy: Policy, version: int = -1):
        self.policy = policy
        self.version = version
        self.lock = threading.Lock()

    def act(self, contexts: list[list[int]], params: SamplingParams, seed: int | None):
        with self.lock, timing.timed("policy"):
            return self.policy.act_batch(contexts, params, seed=seed), self.version

    def load(self, path: str, sha256: str, version: int) -> None:
        with self.lock:
            load_weights(self.policy, path, sha256)
            self.version = version


class ActionBatcher:
    """Turns many concurrent ``await act(context)`` calls into few batched policy calls."""

    def __init__(self, holder: PolicyHolder, params: SamplingParams, *, wait_s: float = 0.004,
                 max_batch: int = 256, seed: int = 0):
        self.holder = holder
        self.params = params
        self.wait_s = wait_s
        self.max_batch = max_batch
        self._pending: list[tuple[list[int], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._calls = 0
        self._seed = seed
        self.active = 0  # episodes that may ask for an action soon (a hint for batch size)
        self.policy_seconds = 0.0

    async def act(self, context: list[int]) -> Acted:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="action-batcher")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((context, fut))
        self._wake.set()
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            deadline = loop.time() + self.wait_s
            while len(self._pending) < min(self.max_batch, max(self.active, 1)):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                    self._wake.clear()
                except TimeoutError:
                    break
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            if self._pending:
                self._wake.set()
            if not batch:
                continue
            self._calls += 1
            started = loop.time()
            try:
                actions, version = await asyncio.to_thread(
                    self.holder.act, [c for c, _ in batch], self.params,
                    self._seed * 1_000_003 + self._calls,
                )
            except Exception as exc:  # noqa: BLE001 - handed to every waiter, not swallowed
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.policy_seconds += loop.time() - started
            for (_, fut), action in zip(batch, actions):
                if not fut.done():
                    fut.set_result(Acted(action, version))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


@dataclass(frozen=True)
class StepRecord:
    """One step as the episode runner saw it (the sampler turns it into an event)."""

    step_index: int
    context: list[int]
    acted: Acted
    result: StepResult
    next_context: list[int] | None
    latency_s: float


@dataclass
class EpisodeSummary:
    steps: int = 0
    success: bool = False
    score: float = 0.0
    milestones: tuple[str, ...] = ()
    failure: EnvFailure | None = None


def milestone_summary(names: list[str]) -> str:
    """A short, bounded text of progress so far (what long contexts would otherwise hold)."""
    if not names:
        return "done none"
    return f"done {len(names)} last {names[-1].split(':')[0]}"


async def run_episode(
    env: Env,
    task_id: str,
    seed: int,
    act: Callable[[list[int]], Awaitable[Acted]],
    builder: ContextBuilder,
    *,
    step_timeout_s: float,
    on_step: Callable[[StepRecord], Awaitable[None]] | None = None,
    before_step: Callable[[], Awaitable[None]] | None = None,
) -> EpisodeSummary:
    loop = asyncio.get_running_loop()
    summary = EpisodeSummary()
    first = await guarded_reset(env, task_id, seed, step_timeout_s)
    if isinstance(first, EnvFailure):
        summary.failure = first
        return summary
    observation = first
    history: deque[tuple[str, str]] = deque(maxlen=max(builder.history_turns, 1))
    reached: list[str] = []

    def recent_turns() -> list[tuple[str, str]]:
        return list(history)[-builder.history_turns:] if builder.history_turns else []

    context = builder.build(observation, recent_turns(), milestone_summary(reached))
    for step_index in range(env.max_steps + 1):
        if before_step is not None:
            await before_step()
        acted = await act(context)
        started = loop.time()
        result = await guarded_step(env, acted.action.text, step_timeout_s)
        latency = loop.time() - started
        timing.add("env", latency)
        if isinstance(result, EnvFailure):
            summary.failure = result
            summary.steps = step_index
            return summary
        history.append((observation, acted.action.text))
        reached.extend(m.name for m in result.milestones)
        observation = result.observation
        next_context = None
        if not result.done:
            next_context = builder.build(observation, recent_turns(), milestone_summary(reached))
        if on_step is not None:
            await on_step(StepRecord(step_index, context, acted, result, next_context, latency))
        summary.steps = step_index + 1
        summary.score = result.score
        if result.over or next_context is None:  # done is over: no context follows it
            summary.success = result.success
            break
        context = next_context
    summary.milestones = tuple(reached)
    return summary
