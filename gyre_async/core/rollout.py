"""Running episodes: many environments, one batched policy, bounded contexts.

Shared by the sampler (training episodes, published step by step) and the evaluator
(validation episodes, summarised). Nothing here touches the bus.

- :class:`ActionBatcher` gathers the action requests of many concurrent episodes into one
  ``policy.act_batch`` call, run on a worker thread so the event loop (and every slow
  environment) keeps moving while the policy computes.
- :func:`run_episode` drives one episode: bounded context (milestone summary + recent turns
  + current observation; or, with segment contexts, one append-only sequence per segment,
  closed where the segmenter closes the segment), guarded env calls (a hung or failing env
  ends only its own episode, as truncated, reported in the summary's ``failure``), one
  callback per step.
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
from dataclasses import dataclass, field

from gyre_async import timing
from gyre_async.core.pacing import SegmentCursor
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
from schemas.config import SegmenterConfig
from schemas.events import BoundaryReason


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

    def act(self, contexts: list[list[int]], params: SamplingParams, seed: int | None,
            sessions: list[str | None] | None = None):
        with self.lock, timing.timed("policy"):
            return (self.policy.act_batch(contexts, params, seed=seed, sessions=sessions),
                    self.version)

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
        self._pending: list[tuple[list[int], str | None, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._calls = 0
        self._seed = seed
        self.active = 0  # episodes that may ask for an action soon (a hint for batch size)
        self.policy_seconds = 0.0

    async def act(self, context: list[int], session: str | None = None) -> Acted:
        """One action for ``context``. ``session`` names the episode it belongs to: a
        policy that keeps keys/values between steps (segment contexts) reuses that
        episode's cached prefix (:meth:`Policy.act_batch`)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="action-batcher")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((context, session, fut))
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
                sessions = [s for _, s, _ in batch]
                actions, version = await asyncio.to_thread(
                    self.holder.act, [c for c, _, _ in batch], self.params,
                    self._seed * 1_000_003 + self._calls,
                    sessions if any(s is not None for s in sessions) else None,
                )
            except Exception as exc:  # noqa: BLE001 - handed to every waiter, not swallowed
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.policy_seconds += loop.time() - started
            for (_, _, fut), action in zip(batch, actions):
                if not fut.done():
                    fut.set_result(Acted(action, version))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


@dataclass(frozen=True)
class StepRecord:
    """One step as the episode runner saw it (the sampler turns it into an event).

    ``context`` and ``next_context`` are whole; with segment contexts the first
    ``context_prefix`` tokens of ``context`` are the previous step's context and action (and
    the first ``next_context_prefix`` of ``next_context`` this step's), which the event
    leaves out (:func:`gyre_async.core.sampler.step_event`)."""

    step_index: int
    context: list[int]
    acted: Acted
    result: StepResult
    next_context: list[int] | None
    latency_s: float
    reset_hash: str = ""  # step 0 only: the hash of the observation reset returned
    context_prefix: int = 0
    next_context_prefix: int = 0
    boundary: BoundaryReason | None = None  # the segment closes at this step (the rule's)
    context_full: bool = False  # ... because the next segment context would not fit


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


def opening_summary(names: list[str], proved_by: list[str], last: int = 4) -> str:
    """The summary a segment opening holds: :func:`milestone_summary` and the actions that
    reached the newest ``last`` milestones (a segment that opens mid-episode has no earlier
    turn to show what was done): ``"done 2 last points: take parsley. take chicken wing"``."""
    if not proved_by:
        return milestone_summary(names)
    return f"{milestone_summary(names)}: {'. '.join(proved_by[-last:])}"


@dataclass
class Turn:
    """What :meth:`EpisodeState.advance` decided about one step."""

    boundary: BoundaryReason | None
    context_full: bool
    next_context_prefix: int


@dataclass
class EpisodeState:
    """What an episode carries from one step to the next: the current observation, the
    recent turns, the milestones reached, where its segment stands (the segmenter's rule,
    asked step by step) and, with segment contexts, the open segment's token sequence.
    Playing and rebuilding advance it with the same :meth:`advance`, so a rebuilt
    episode's context is the one the original would have had."""

    observation: str
    history: deque[tuple[str, str]]
    reached: list[str]
    next_step: int = 0
    #: the task as the environment states it now (``Env.task``; segment openings hold it)
    task: str = ""
    #: the actions at which milestones were reached, one per step that reached any
    proved_by: list[str] = field(default_factory=list)
    reset_hash: str = ""
    segment: SegmentCursor = field(default_factory=lambda: SegmentCursor(SegmenterConfig()))
    #: segment contexts: the current context (None: the next one opens a segment)
    sequence: list[int] | None = None
    #: tokens of the current context that continue the previous step's context + action
    context_prefix: int = 0

    @classmethod
    def first(cls, observation: str, builder: ContextBuilder,
              segments: SegmenterConfig | None = None, task: str = "") -> EpisodeState:
        """A fresh episode. ``segments``: the run's segmenter config, whose rule says where
        segments close (the default config when None); ``task``: the environment's
        statement of the task after its reset (``Env.task``)."""
        return cls(observation, deque(maxlen=max(builder.history_turns, 1)), [],
                   reset_hash=observation_hash(observation),
                   segment=SegmentCursor(segments or SegmenterConfig()), task=task)

    def context(self, builder: ContextBuilder) -> list[int]:
        """The context for the next action (a fresh list: the caller may keep it)."""
        if builder.segments:
            if self.sequence is None:
                self.sequence = builder.opening(
                    self.observation, opening_summary(self.reached, self.proved_by), self.task)
                self.context_prefix = 0
            return list(self.sequence)
        turns = list(self.history)[-builder.history_turns:] if builder.history_turns else []
        return builder.build(self.observation, turns, milestone_summary(self.reached))

    def advance(self, builder: ContextBuilder, action_text: str, action_tokens: Sequence[int],
                result: StepResult, task: str | None = None) -> Turn:
        """Take one step: the action (its text and the tokens the policy wrote), what
        the environment answered and its statement of the task after it (``Env.task``;
        None: unchanged). The segment closes where the segmenter's rule says; a
        segment context that could not take the next observation within the builder's
        budget closes it too (``context_full``, a flag the step's event carries, so the
        segmenter reads the same cut)."""
        full = False
        continued: list[int] | None = None
        if builder.segments and self.sequence is not None and not result.over \
                and self.segment.closes(result) is None:
            continued = [*self.sequence, *action_tokens,
                         *builder.continuation(action_tokens, result.observation,
                                               self.observation)]
            full = len(continued) > builder.max_tokens
        boundary = self.segment.after(result, context_full=full)
        prefix = 0
        if builder.segments:
            if boundary is None and continued is not None:
                prefix = len(self.sequence or ()) + len(action_tokens)
                self.sequence = continued
            else:
                self.sequence = None  # the next context opens the next segment
            self.context_prefix = prefix
        self.history.append((self.observation, action_text))
        self.reached.extend(m.name for m in result.milestones)
        if result.milestones:
            self.proved_by.append(action_text)
        if task is not None:
            self.task = task
        self.observation = result.observation
        self.next_step += 1
        return Turn(boundary, full, prefix)


@dataclass(frozen=True)
class LoggedStep:
    """What the log says of one step an episode took: enough to replay and check it (and,
    for segment contexts, to rebuild them token for token: the action's own tokens)."""

    action_text: str
    observation_hash: str
    action_tokens: tuple[int, ...] = ()
    policy_version: int = -1  # the version that acted (pacing: when a rebuilt segment opened)


async def rebuild_episode(env: Env, task_id: str, seed: int, reset_hash: str,
                          logged: Sequence[LoggedStep], builder: ContextBuilder, *,
                          step_timeout_s: float, segments: SegmenterConfig | None = None
                          ) -> EpisodeState | EnvFailure:
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
    state = EpisodeState.first(first, builder, segments, env.task())
    if state.reset_hash != reset_hash:
        return _mismatch("at reset", reset_hash, state.reset_hash)
    for index, step in enumerate(logged):
        if builder.segments and not step.action_tokens:
            return EnvFailure("exception", f"rebuild-failed at step {index}: the log has no "
                              "action tokens to rebuild its segment context with",
                              reason="rebuild-failed")
        if builder.segments:
            state.context(builder)  # a segment context opens where the original one did
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
        state.advance(builder, step.action_text, step.action_tokens, result, env.task())
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
    segments: SegmenterConfig | None = None,
) -> EpisodeSummary:
    """One episode from its reset to its end (see :func:`play_episode`); ``segments``:
    the segmenter config whose rule closes segments (and segment contexts)."""
    first = await guarded_reset(env, task_id, seed, step_timeout_s)
    if isinstance(first, EnvFailure):
        return EpisodeSummary(failure=first)
    return await play_episode(env, EpisodeState.first(first, builder, segments, env.task()),
                              act, builder,
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
        prefix = state.context_prefix
        acted = await act(context)
        started = loop.time()
        result = await guarded_step(env, acted.action.text, step_timeout_s)
        latency = loop.time() - started
        timing.add("env", latency)
        if isinstance(result, EnvFailure):
            summary.failure = result
            summary.steps = step_index
            return summary
        turn = state.advance(builder, acted.action.text, acted.action.tokens, result,
                             env.task())
        next_context = None if result.done else state.context(builder)
        if on_step is not None:
            await on_step(StepRecord(step_index, context, acted, result, next_context, latency,
                                     reset_hash=state.reset_hash if step_index == 0 else "",
                                     context_prefix=prefix,
                                     next_context_prefix=turn.next_context_prefix,
                                     boundary=turn.boundary, context_full=turn.context_full))
        summary.steps = step_index + 1
        summary.score = result.score
        if result.over or next_context is None:  # done is over: no context follows it
            summary.success = result.success
            break
        context = next_context
    summary.milestones = tuple(state.reached)
    return summary
