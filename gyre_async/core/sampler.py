"""The sampler's core: many environments acting with one batched policy, under the gate.

Each environment slot runs episodes back to back; all slots share one batched policy
(:class:`~gyre_async.core.rollout.ActionBatcher`). Every step becomes a ``TrajectoryStep``
stamped with the policy version that chose the action. Bounded staleness (see
``gyre_async.rl.staleness``):

- the learner's consumption paces sampling (``StalenessGate.may_step``): a step is
  admitted only while every open segment of this sampler can still reach the learner
  within the bound, older segments first, and a step that *opens* a segment only while the
  new one can too (each episode's :class:`~gyre_async.core.pacing.SegmentCursor` tells
  where segments open and close, by the segmenter's own rule); every step stays under the
  hard cap (``StalenessGate.may_sample``), each replica within its share when several
  samplers run. The learner's consumed count
  comes with every ``policy-version`` and every ``segment-dropped`` (:meth:`SamplerCore.
  follow_drop`), so dropped work reopens the gate at once;
- the sampler pauses while its loaded policy is more than max_staleness versions behind.

In ``sync`` mode each version samples exactly one episode per slot, then waits for the next
version: the strict sample-then-train baseline.

Many samplers in one run (``sampler.replicas = N``, this one ``sampler.replica = i``): each
admits its share of the run's staleness budget (``StalenessGate.share``), and nothing two
replicas make can collide. Trajectory ids are ``<actor name>-<incarnation>-<episode>``
(distinct names, and a fresh random incarnation per process start); seeds of replica ``i``
are ``train_seed_start + N * k + i`` with ``k`` in ``[0, 10**7 // N)``: each replica owns
one residue class modulo ``N``, so two replicas never play the same task. Within one
incarnation ``k`` counts up from a random start (per GRPO group), so its seeds repeat only
after ``10**7 // N`` groups. A slow or hung environment step ends only
its own trajectory (an ``EnvError``; the segmenter closes the trajectory as truncated).

A restarted sampler first takes up the episodes its predecessor left open
(:mod:`gyre_async.core.resumption`): each slot rebuilds one (fresh environment, logged
actions replayed, every observation checked against the log's hash) and plays it on under
the current policy and the gate, as the same trajectory; an environment that is not
``rebuildable`` gets the visible ``abandoned`` ending instead.

No bus here: events go to the ``publish`` callback given to :meth:`SamplerCore.run`, and
the learner's progress comes in through :meth:`SamplerCore.follow`. asyncio stays, because
running environments concurrently is what this core does.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from gyre_async.compose import build_acting_policy, build_context_builder, build_tokenizer
from gyre_async.core.exploration import (
    exploration_stats,
    make_holder,
    sampling_params_at,
)
from gyre_async.core.resumption import (
    OpenEpisode,
    UnfinishedTrajectories,
    task_id_of,
)
from gyre_async.core.rollout import (
    Acted,
    ActionBatcher,
    EpisodeState,
    EpisodeSummary,
    LoggedStep,
    PolicyHolder,
    StepRecord,
    play_episode,
    rebuild_episode,
    run_episode,
)
from gyre_async.envs import make_env
from gyre_async.envs.base import Env, EnvFailure, observation_hash
from gyre_async.envs.faults import with_faults
from gyre_async.envs.macros import step_fields, with_macros
from gyre_async.errors import ConfigError
from gyre_async.policy.context import ContextBuilder
from gyre_async.rl.staleness import OpenSegment, StalenessGate
from gyre_async.storage.roots import StorageRoots
from schemas import Event, event_id
from schemas.config import Config
from schemas.events import EnvError, Milestone, PolicyVersion, SegmentDropped, TrajectoryStep

__all__ = ["SEED_SPAN", "SamplerCore", "UnfinishedTrajectories", "step_event"]

#: ``play(on_step, before_step)``: one episode played to its end (fresh, or rebuilt).
Play = Callable[[Callable[[StepRecord], Awaitable[None]], Callable[[], Awaitable[None]]],
                Awaitable[EpisodeSummary]]

#: Training seeds lie in ``[train_seed_start, train_seed_start + SEED_SPAN)``.
SEED_SPAN = 10**7


class _Stopped(Exception):
    """The sampler is stopping and a slot was waiting at the gate: it leaves at once (its
    episode stays open, as a cancelled one does, for a restarted sampler to resume)."""


@dataclass(frozen=True)
class _Run:
    """What every slot of one :meth:`SamplerCore.run` shares."""

    producer: str
    publish: Callable[[Event], None]
    stopping: asyncio.Event
    batcher: ActionBatcher


class SamplerCore:
    _stopping: asyncio.Event | None = None  # the running ``run``'s: it opens the gate

    def __init__(self, cfg: Config, holder: PolicyHolder, builder: ContextBuilder):
        self.cfg = cfg
        self.holder = holder
        self.builder = builder
        self.replicas = cfg.sampler.replicas
        self.replica = cfg.sampler.replica
        if not 0 <= self.replica < self.replicas:
            raise ConfigError(f"sampler.replica {self.replica} of sampler.replicas "
                              f"{self.replicas}: give --replica I/N with 0 <= I < N")
        self.gate = StalenessGate(0 if cfg.run.mode == "sync" else cfg.loop.max_staleness,
                                  cfg.learner.batch_steps,
                                  cfg.sampler.num_envs * cfg.segmenter.max_segment_steps,
                                  replicas=self.replicas)
        self.learner_version = -1
        self.learner_consumed = 0  # steps the learner trained on or dropped (the gate's base)
        self.steps_emitted = 0
        self.episodes = 0
        self.env_errors = 0
        self.paused_s = 0.0
        self.rebuilt_episodes = 0
        self.rebuild_mismatches = 0  # a replayed observation differed from the log
        self.rebuild_failures = 0  # the replay itself failed (reset or step error)
        self.abandoned_episodes = 0
        self.rebuild_seconds: list[float] = []  # reset + replay, per rebuilt episode
        self._open: deque[OpenEpisode] = deque()
        self.at_gate = 0  # slots waiting at the staleness gate right now
        self._segments: dict[str, OpenSegment] = {}  # trajectory id -> its open segment
        self._segments_opened = 0
        self.incarnation = uuid.uuid4().hex[:8]  # trajectory ids never repeat across restarts
        self._seed_span = SEED_SPAN // self.replicas
        self._seed_base = int(event_id(self.incarnation)[:8], 16) % self._seed_span
        self._version_seen = asyncio.Condition()

    @classmethod
    def from_config(cls, cfg: Config) -> SamplerCore:
        """Exploration schedule (perturbed if configured); vLLM when policy.backend = "vllm"."""
        tokenizer = build_tokenizer(cfg)
        return cls(cfg, make_holder(cfg, build_acting_policy(cfg, tokenizer)),
                   build_context_builder(cfg, tokenizer))

    @cached_property
    def roots(self) -> StorageRoots:
        """Where a ``policy-version`` may point: the run's checkpoint root (config)."""
        return StorageRoots.from_config(self.cfg)

    # -- following the learner -------------------------------------------------------------
    async def follow(self, event: PolicyVersion) -> None:
        """Load a newer version (or a rollback's) and move the gate to the learner's place.
        One the run's learner did not announce, or whose checkpoint lies outside the run's
        checkpoint root, raises (the actor dead-letters it) and moves nothing."""
        address = self.roots.checkpoint_of(event)
        if event.version <= self.holder.version and event.reason != "rollback":
            return
        await asyncio.to_thread(self.holder.load, address, event.checkpoint_hash,
                                event.version)
        async with self._version_seen:
            self.learner_version = max(self.learner_version, event.version) \
                if event.reason != "rollback" else event.version
            self.learner_consumed = max(self.learner_consumed, event.consumed_steps)
            self._version_seen.notify_all()

    async def follow_drop(self, event: SegmentDropped) -> None:
        """The learner dropped a segment: its consumed count (carried by the event) moves the
        gate now, not at the next version (which a learner short of a batch never makes)."""
        if event.consumed_steps > self.learner_consumed:
            async with self._version_seen:
                self.learner_consumed = max(self.learner_consumed, event.consumed_steps)
                self._version_seen.notify_all()

    def resume(self, steps_emitted: int, open_episodes: Sequence[OpenEpisode] = ()) -> None:
        """Take over from an earlier incarnation of this sampler (same name): count the
        steps it published, so a restart goes on from its place under the gate instead of
        a fresh budget, and the episodes it left open, which the slots rebuild (or end as
        abandoned) before they start new ones."""
        self.steps_emitted = max(self.steps_emitted, steps_emitted)
        self._open.extend(open_episodes)

    def seed_of(self, group: int) -> int:
        """The environment seed of GRPO group ``group`` (see the module docstring)."""
        k = (self._seed_base + group) % self._seed_span
        return self.cfg.task.train_seed_start + self.replicas * k + self.replica

    def _admissible(self, tid: str, opens_segment: bool) -> bool:
        version, learner = self.holder.version, self.learner_version
        if version < 0 or self.gate.sampler_must_pause(version, learner):
            return False
        if not self.gate.may_sample(self.steps_emitted, learner, self.learner_consumed):
            return False
        own = self._segments.get(tid)
        if not opens_segment and own is None:
            return True  # a rebuilt episode inside a segment its predecessor opened
        return self.gate.may_step(self.steps_emitted, learner, self.learner_consumed, version,
                                  None if opens_segment else own,
                                  list(self._segments.values()))

    async def _admit(self, tid: str, opens_segment: bool = True,
                     steps_after: int | None = None) -> None:
        """Wait until the staleness gate admits one more step of trajectory ``tid``
        (``opens_segment``: the first of a segment), or raise :class:`_Stopped` when the
        sampler stops first: a stop never waits on the learner, nor on a cancellation to
        reach the slot. ``steps_after``: steps the episode may still take after this one
        (its cap), which bounds its segment's remaining steps (None: unbounded)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self._version_seen:
                if not self._admissible(tid, opens_segment):
                    self.at_gate += 1
                    try:
                        await self._version_seen.wait_for(
                            lambda: self._admissible(tid, opens_segment) or self._stopped())
                    finally:
                        self.at_gate -= 1
                    if not self._admissible(tid, opens_segment):
                        raise _Stopped
        finally:  # a wait the run's end cuts short was a pause too
            self.paused_s += loop.time() - started
        self.steps_emitted += 1
        if opens_segment:
            self._track(tid, self.holder.version, 1, steps_after=steps_after)
        elif (own := self._segments.get(tid)) is not None:
            self._track(tid, own.first_version, own.length + 1, own.order, steps_after)

    def _track(self, tid: str, first_version: int, length: int, order: int | None = None,
               steps_after: int | None = None) -> None:
        """Pace ``tid``'s open segment: made from ``first_version`` on, ``length`` steps so
        far, so it may take ``max_segment_steps - length`` more, and no more than the
        ``steps_after`` its episode's cap leaves (a segment late in an episode holds back
        only what it can still take); ``order``: kept from its opening (None: it opens now,
        after every segment open so far)."""
        if order is None:
            self._segments_opened += 1
            order = self._segments_opened
        remaining = self.cfg.segmenter.max_segment_steps - length
        if steps_after is not None:
            remaining = min(remaining, steps_after)
        self._segments[tid] = OpenSegment(first_version, length, max(remaining, 0), order)

    def _track_rebuilt_segment(self, tid: str, steps: Sequence[LoggedStep], length: int,
                               max_steps: int) -> None:
        """A rebuilt episode stands inside a segment its predecessor opened (``length``
        steps so far): pace it like one this sampler opened, aged by the version of its
        first logged step, so its room is kept and counted (a log without versions leaves
        it unpaced, under the hard cap only). ``max_steps``: the episode's cap."""
        if 0 < length <= len(steps) and steps[-length].policy_version >= 0:
            self._track(tid, steps[-length].policy_version, length,
                        steps_after=max_steps - len(steps) + 1)

    async def _segment_closed(self, tid: str) -> None:
        """A segment of ``tid`` closed (or its episode ended): slots held back for it may go."""
        if self._segments.pop(tid, None) is not None:
            async with self._version_seen:
                self._version_seen.notify_all()

    async def _count(self) -> None:
        self.steps_emitted += 1

    def _stopped(self) -> bool:
        return self._stopping is not None and self._stopping.is_set()

    async def _open_gate_on(self, stopping: asyncio.Event) -> None:
        """Wake every slot waiting at the gate once ``stopping`` is set (they then leave)."""
        await stopping.wait()
        async with self._version_seen:
            self._version_seen.notify_all()

    # -- producing ---------------------------------------------------------------------------
    async def run(self, producer: str, publish: Callable[[Event], None],
                  stopping: asyncio.Event) -> None:
        """Run ``sampler.num_envs`` slots until ``stopping`` is set (each slot between two
        episodes) or ``sampler.max_episodes`` episodes have started. ``producer`` names the
        trajectories. Whether it returns, raises or is cancelled, every slot has ended (and
        closed its environment) by the time it does."""
        sampler = self.cfg.sampler
        params = sampling_params_at(self.cfg, max(self.holder.version, 0))
        batcher = ActionBatcher(self.holder, params, wait_s=sampler.batch_wait_s,
                                seed=self.cfg.run.seed * self.replicas + self.replica)
        shared = _Run(producer, publish, stopping, batcher)
        self._stopping = stopping
        opener = asyncio.create_task(self._open_gate_on(stopping), name=f"{producer}-gate")
        slots = [asyncio.create_task(self._slot(shared), name=f"{producer}-slot-{i}")
                 for i in range(sampler.num_envs)]
        try:
            await asyncio.gather(*slots)
        finally:
            for task in [*slots, opener]:
                task.cancel()
            await asyncio.gather(*slots, opener, return_exceptions=True)
            batcher.close()

    async def _slot(self, shared: _Run) -> None:
        cfg = self.cfg
        env = with_macros(with_faults(make_env(cfg.task.env, **cfg.task.env_config), cfg.task,
                                      (cfg.run.seed, self.replica)), cfg.macros)
        rounds = 0

        def learner_reached_round() -> bool:
            return self.learner_version >= rounds or self._stopped()

        try:
            while not shared.stopping.is_set():
                if self._open:
                    await self._resume(env, shared, self._open.popleft())
                    continue
                if cfg.sampler.max_episodes and self.episodes >= cfg.sampler.max_episodes:
                    return
                if cfg.run.mode == "sync":  # one episode per slot per version
                    async with self._version_seen:
                        await self._version_seen.wait_for(learner_reached_round)
                    if self._stopped():
                        return
                    rounds = self.learner_version + 1
                await self._episode(env, shared)
        except _Stopped:
            return  # it waited at the gate when the sampler stopped
        finally:
            await env.close()

    async def _episode(self, env: Env, shared: _Run) -> None:
        cfg = self.cfg
        n = self.episodes
        self.episodes += 1
        group = n // cfg.sampler.group_size  # consecutive episodes share a task (GRPO group)
        seed = self.seed_of(group)
        tid = f"{shared.producer}-{self.incarnation}-{n}"
        task_id = task_id_of(cfg.task.env, seed)

        async def play(on_step: Callable[[StepRecord], Awaitable[None]],
                       before_step: Callable[[], Awaitable[None]]) -> EpisodeSummary:
            return await run_episode(env, task_id, seed, self._act(shared, tid), self.builder,
                                     step_timeout_s=cfg.sampler.step_timeout_s,
                                     on_step=on_step, before_step=before_step,
                                     segments=cfg.segmenter)

        await self._play(shared, tid, task_id, play, env.max_steps)

    async def _resume(self, env: Env, shared: _Run, episode: OpenEpisode) -> None:
        """Rebuild an episode a predecessor left open and play it on (or end it visibly)."""
        cfg = self.cfg
        run_id, producer = cfg.run.run_id, shared.producer
        if not env.rebuildable or episode.unrebuildable:
            self.abandoned_episodes += 1
            why = "" if env.rebuildable else f"environment {cfg.task.env!r} is not rebuildable"
            shared.publish(episode.abandoned(run_id, producer, why))
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        state = await rebuild_episode(env, episode.task_id, episode.seed, episode.reset_hash,
                                      episode.steps, self.builder,
                                      step_timeout_s=cfg.sampler.step_timeout_s,
                                      segments=cfg.segmenter)
        if isinstance(state, EnvFailure):
            if state.reason == "rebuild-mismatch":
                self.rebuild_mismatches += 1
            else:
                self.rebuild_failures += 1
            shared.publish(episode.ending(run_id, producer, kind=state.kind,
                                          message=state.message, reason=state.reason))
            return
        self.rebuilt_episodes += 1
        self.rebuild_seconds.append(loop.time() - started)
        rebuilt: EpisodeState = state
        self._track_rebuilt_segment(episode.trajectory_id, episode.steps, rebuilt.segment.length,
                                    env.max_steps)

        async def play(on_step: Callable[[StepRecord], Awaitable[None]],
                       before_step: Callable[[], Awaitable[None]]) -> EpisodeSummary:
            return await play_episode(env, rebuilt, self._act(shared, episode.trajectory_id),
                                      self.builder, step_timeout_s=cfg.sampler.step_timeout_s,
                                      on_step=on_step, before_step=before_step)

        await self._play(shared, episode.trajectory_id, episode.task_id, play, env.max_steps,
                         opens_segment=rebuilt.segment.opens_segment,
                         first_step=len(episode.steps))

    def _act(self, shared: _Run, tid: str) -> Callable[[list[int]], Awaitable[Acted]]:
        """How an episode asks for actions: with segment contexts, under its trajectory id,
        so that a policy that keeps keys/values reuses the episode's cached prefix."""
        if not self.builder.segments:
            return shared.batcher.act
        return functools.partial(shared.batcher.act, session=tid)

    async def _play(self, shared: _Run, tid: str, task_id: str, play: Play, max_steps: int,
                    opens_segment: bool = True, first_step: int = 0) -> None:
        """Play an episode (``play(on_step, before_step)``), publishing each step and, if
        the environment failed, the ``env-error`` that ends the trajectory. ``max_steps``:
        the environment's cap (an episode's step indices end at it, see ``play_episode``);
        ``opens_segment``: the first step opens a segment (a rebuilt episode may stand
        inside one, its steps so far ``first_step``)."""
        cfg = self.cfg
        opens = [opens_segment]  # does the next step open a segment (the segmenter's rule)
        index = [first_step]  # the next step's index

        async def admit() -> None:
            await self._admit(tid, opens[0], steps_after=max_steps - index[0])

        async def on_step(record: StepRecord) -> None:
            index[0] = record.step_index + 1
            opens[0] = record.boundary is not None
            shared.publish(step_event(cfg.run.run_id, shared.producer, tid, task_id, record))
            if opens[0]:
                await self._segment_closed(tid)

        shared.batcher.active += 1
        try:
            summary = await play(on_step,
                                 self._count if cfg.run.mode == "sync" else admit)
        finally:
            shared.batcher.active -= 1
            await self._segment_closed(tid)
            if self.builder.segments:
                self.holder.policy.forget_session(tid)  # its cached keys/values, if any
        if summary.failure is not None:
            self.env_errors += 1
            shared.publish(EnvError(
                event_id=event_id("env-error", cfg.run.run_id, tid),
                run_id=cfg.run.run_id, producer=shared.producer, key=tid,
                trajectory_id=tid, task_id=task_id, step_index=summary.steps,
                kind=summary.failure.kind, message=summary.failure.message,
            ))

    def stats(self) -> dict[str, float]:
        return {"episodes": float(self.episodes), "steps": float(self.steps_emitted),
                "policy_version": float(self.holder.version),
                "replica": float(self.replica),
                "env_errors": float(self.env_errors), "paused_s": self.paused_s,
                "rebuilt_episodes": float(self.rebuilt_episodes),
                "rebuild_mismatches": float(self.rebuild_mismatches),
                "rebuild_failures": float(self.rebuild_failures),
                "abandoned_episodes": float(self.abandoned_episodes),
                "rebuild_s_median": (statistics.median(self.rebuild_seconds)
                                     if self.rebuild_seconds else 0.0),
                "at_gate": float(self.at_gate),
                # context tokens the policy computed, and those it reused from its cache
                "prefill_computed": float(self.holder.policy.prefill_computed),
                "prefill_reused": float(self.holder.policy.prefill_reused),
                # acting's forward passes, and the drafted tokens they read and kept
                "act_forwards": float(self.holder.policy.act_forwards),
                "drafted_tokens": float(self.holder.policy.drafted_tokens),
                "accepted_tokens": float(self.holder.policy.accepted_tokens),
                **exploration_stats(self.holder)}


def step_event(run_id: str, producer: str, trajectory_id: str, task_id: str,
               record: StepRecord) -> TrajectoryStep:
    """The ``trajectory-step`` of one step the episode runner took."""
    result = record.result
    return TrajectoryStep(
        event_id=event_id("step", run_id, trajectory_id, record.step_index),
        run_id=run_id, producer=producer, key=trajectory_id,
        trajectory_id=trajectory_id, task_id=task_id, step_index=record.step_index,
        policy_version=record.acted.policy_version,
        context_tokens=record.context[record.context_prefix:],
        context_prefix=record.context_prefix,
        action_tokens=record.acted.action.tokens,
        action_logprobs=record.acted.action.logprobs, action_text=record.acted.action.text,
        feedback=result.feedback,
        milestones=[Milestone(name=m.name, proof=m.proof) for m in result.milestones],
        state_changed=result.state_changed, tool_latency_s=record.latency_s, done=result.done,
        truncated=result.truncated, success=result.success, score=result.score,
        next_context_tokens=(None if record.next_context is None
                             else record.next_context[record.next_context_prefix:]),
        next_context_prefix=record.next_context_prefix, context_full=record.context_full,
        observation_hash=observation_hash(result.observation), reset_hash=record.reset_hash,
        **step_fields(result),
    )
