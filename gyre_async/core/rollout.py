"""Running episodes: many environments, one batched policy, bounded contexts.

Shared by the sampler (training episodes, published step by step) and the evaluator
(validation episodes, summarised). Nothing here touches the bus.

- :class:`ActionBatcher` gathers the action requests of many concurrent episodes into one
  ``policy.act_batch`` call, run on a worker thread so the event loop (and every slow
  environment) keeps moving while the policy computes.
- :func:`run_episode` drives one episode: bounded context (milestone summary + recent turns
  + current observation), guarded env calls (a hung or failing env ends only its own
  episode, as truncated, reported in the summary's ``failure``), one callback per step.
- :func:`rebuild_episode` brings a fresh environment to where a logged episode stood (its
  actions replayed, every observation checked against the log's hash), and
  :func:`play_episode` goes on from there: how a restarted sampler continues the episodes
  its predecessor left open.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from gyre_async import timing
from gyre_async.envs.base import (
    Env,
    EnvFailure,
    StepResult,
    guarded_reset,
    guarded_step,
    observation_hash,
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

    def close(self) -> None:
        self.policy.close()

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
    reset_hash: str = ""  # step 0 only: the hash of the observation reset returned


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


@dataclass
class EpisodeState:
    """What an episode carries from one step to the next: the current observation, the
    recent turns and the milestones reached. Playing and rebuilding advance it with the same
    :meth:`advance`, so a rebuilt episode's context is the one the original would have had."""

    observation: str
    history: deque[tuple[str, str]]
    reached: list[str]
    next_step: int = 0
    reset_hash: str = ""

    @classmethod
    def first(cls, observation: str, builder: ContextBuilder) -> EpisodeState:
        return cls(observation, deque(maxlen=max(builder.history_turns, 1)), [],
                   reset_hash=observation_hash(observation))

    def context(self, builder: ContextBuilder) -> list[int]:
        turns = list(self.history)[-builder.history_turns:] if builder.history_turns else []
        return builder.build(self.observation, turns, milestone_summary(self.reached))

    def advance(self, action_text: str, result: StepResult) -> None:
        self.history.append((self.observation, action_text))
        self.reached.extend(m.name for m in result.milestones)
        self.observation = result.observation
        self.next_step += 1


@dataclass(frozen=True)
class LoggedStep:
    """What the log says of one step an episode took: enough to replay and check it."""

    action_text: str
    observation_hash: str


async def rebuild_episode(env: Env, task_id: str, seed: int, reset_hash: str,
                          logged: Sequence[LoggedStep], builder: ContextBuilder, *,
                          step_timeout_s: float) -> EpisodeState | EnvFailure:
    """Reset a fresh ``env`` as the episode began and replay its logged actions (at the
    level they were logged: a macro's name goes to the macro wrapper, which expands it
    again), checking every observation against the log's hash.

    The result is where the episode stood after its last logged step, ready for
    :func:`play_episode`; a reset or step that fails, an observation that differs, or an
    episode that ends before the log does come back as an :class:`EnvFailure` whose
    message names the step (``reason``: ``rebuild-mismatch`` or ``rebuild-failed``).
    """
    first = await guarded_reset(env, task_id, seed, step_timeout_s)
    if isinstance(first, EnvFailure):
        return EnvFailure(first.kind, f"rebuild-failed at reset: {first.message}",
                          reason="rebuild-failed")
    state = EpisodeState.first(first, builder)
    if state.reset_hash != reset_hash:
        return _mismatch("at reset", reset_hash, state.reset_hash)
    for index, step in enumerate(logged):
        result = await guarded_step(env, step.action_text, step_timeout_s)
        if isinstance(result, EnvFailure):
            return EnvFailure(result.kind, f"rebuild-failed at step {index}: {result.message}",
                              reason="rebuild-failed")
        rebuilt = observation_hash(result.observation)
        if rebuilt != step.observation_hash:
            return _mismatch(f"at step {index}", step.observation_hash, rebuilt)
        if result.over and index < len(logged) - 1:
            return EnvFailure("exception", f"rebuild-mismatch at step {index}: the replayed "
                              f"episode ended there, the log goes on to step {len(logged) - 1}",
                              reason="rebuild-mismatch")
        state.advance(step.action_text, result)
    return state


def _mismatch(where: str, logged: str, rebuilt: str) -> EnvFailure:
    return EnvFailure("exception", f"rebuild-mismatch {where}: replaying the logged actions "
                      f"gave an observation hashed {rebuilt}, the log has {logged}",
                      reason="rebuild-mismatch")


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
    """One episode from its reset to its end (see :func:`play_episode`)."""
    first = await guarded_reset(env, task_id, seed, step_timeout_s)
    if isinstance(first, EnvFailure):
        return EpisodeSummary(failure=first)
    return await play_episode(env, EpisodeState.first(first, builder), act, builder,
                              step_timeout_s=step_timeout_s, on_step=on_step,
                              before_step=before_step)


async def play_episode(
    env: Env,
    state: EpisodeState,
    act: Callable[[list[int]], Awaitable[Acted]],
    builder: ContextBuilder,
    *,
    step_timeout_s: float,
    on_step: Callable[[StepRecord], Awaitable[None]] | None = None,
    before_step: Callable[[], Awaitable[None]] | None = None,
) -> EpisodeSummary:
    """Play an episode on from ``state`` (fresh from reset, or rebuilt) to its end.

    Step indices go on from ``state.next_step``; ``summary.steps`` counts every step of
    the episode, those before ``state`` too.
    """
    loop = asyncio.get_running_loop()
    summary = EpisodeSummary(steps=state.next_step)
    context = state.context(builder)
    for step_index in range(state.next_step, env.max_steps + 1):
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
        state.advance(acted.action.text, result)
        next_context = None if result.done else state.context(builder)
        if on_step is not None:
            await on_step(StepRecord(step_index, context, acted, result, next_context, latency,
                                     reset_hash=state.reset_hash if step_index == 0 else ""))
        summary.steps = step_index + 1
        summary.score = result.score
        if result.over or next_context is None:  # done is over: no context follows it
            summary.success = result.success
            break
        context = next_context
    summary.milestones = tuple(state.reached)
    return summary
