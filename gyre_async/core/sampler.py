"""The sampler's core: many environments acting with one batched policy, under the gate.

Each environment slot runs episodes back to back; all slots share one batched policy
(:class:`~gyre_async.core.rollout.ActionBatcher`). Every step becomes a ``TrajectoryStep``
stamped with the policy version that chose the action. Bounded staleness (see
``gyre_async.rl.staleness``):

- a step is admitted only while steps_emitted < (learner_version + max_staleness + 1) *
  steps_per_version (the learner's pace throttles sampling; the exact rule, and each
  replica's share of it when several samplers run, is ``StalenessGate.may_sample``);
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

No bus here: events go to the ``publish`` callback given to :meth:`SamplerCore.run`, and
the learner's progress comes in through :meth:`SamplerCore.follow`. asyncio stays, because
running environments concurrently is what this core does.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from gyre_async.compose import build_acting_policy, build_tokenizer
from gyre_async.core.exploration import (
    exploration_stats,
    make_holder,
    sampling_params_at,
)
from gyre_async.core.rollout import ActionBatcher, PolicyHolder, StepRecord, run_episode
from gyre_async.envs import make_env
from gyre_async.envs.base import Env
from gyre_async.envs.faults import with_faults
from gyre_async.envs.macros import step_fields, with_macros
from gyre_async.errors import ConfigError
from gyre_async.policy.context import ContextBuilder
from gyre_async.rl.staleness import StalenessGate
from schemas import Event, event_id
from schemas.config import Config
from schemas.events import EnvError, Milestone, PolicyVersion, TrajectoryStep

#: Training seeds lie in ``[train_seed_start, train_seed_start + SEED_SPAN)``.
SEED_SPAN = 10**7


@dataclass(frozen=True)
class _Run:
    """What every slot of one :meth:`SamplerCore.run` shares."""

    producer: str
    publish: Callable[[Event], None]
    stopping: asyncio.Event
    batcher: ActionBatcher


class SamplerCore:
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
        self.incarnation = uuid.uuid4().hex[:8]  # trajectory ids never repeat across restarts
        self._seed_span = SEED_SPAN // self.replicas
        self._seed_base = int(event_id(self.incarnation)[:8], 16) % self._seed_span
        self._version_seen = asyncio.Condition()

    @classmethod
    def from_config(cls, cfg: Config) -> SamplerCore:
        """Exploration schedule (perturbed if configured); vLLM when policy.backend = "vllm"."""
        tokenizer = build_tokenizer(cfg)
        return cls(cfg, make_holder(cfg, build_acting_policy(cfg, tokenizer)),
                   ContextBuilder(tokenizer, cfg.policy.context_tokens, cfg.policy.history_turns))

    # -- following the learner -------------------------------------------------------------
    async def follow(self, event: PolicyVersion) -> None:
        """Load a newer version (or a rollback's) and move the gate to the learner's place."""
        if event.version <= self.holder.version and event.reason != "rollback":
            return
        await asyncio.to_thread(self.holder.load, event.checkpoint, event.checkpoint_hash,
                                event.version)
        async with self._version_seen:
            self.learner_version = max(self.learner_version, event.version) \
                if event.reason != "rollback" else event.version
            self.learner_consumed = max(self.learner_consumed, event.consumed_steps)
            self._version_seen.notify_all()

    def resume(self, steps_emitted: int) -> None:
        """Count the steps an earlier incarnation of this sampler (same name) published, so
        a restart goes on from its place under the gate instead of a fresh budget."""
        self.steps_emitted = max(self.steps_emitted, steps_emitted)

    def seed_of(self, group: int) -> int:
        """The environment seed of GRPO group ``group`` (see the module docstring)."""
        k = (self._seed_base + group) % self._seed_span
        return self.cfg.task.train_seed_start + self.replicas * k + self.replica

    async def _admit(self) -> None:
        """Wait until the staleness gate admits one more step."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with self._version_seen:
            await self._version_seen.wait_for(
                lambda: self.holder.version >= 0
                and self.gate.may_sample(self.steps_emitted, self.learner_version,
                                         self.learner_consumed)
                and not self.gate.sampler_must_pause(self.holder.version, self.learner_version)
            )
        self.steps_emitted += 1
        self.paused_s += loop.time() - started

    async def _count(self) -> None:
        self.steps_emitted += 1

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
        slots = [asyncio.create_task(self._slot(shared), name=f"{producer}-slot-{i}")
                 for i in range(sampler.num_envs)]
        try:
            await asyncio.gather(*slots)
        finally:
            for slot in slots:
                slot.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            batcher.close()

    async def _slot(self, shared: _Run) -> None:
        cfg = self.cfg
        env = with_macros(with_faults(make_env(cfg.task.env, **cfg.task.env_config), cfg.task,
                                      (cfg.run.seed, self.replica)), cfg.macros)
        rounds = 0

        def learner_reached_round() -> bool:
            return self.learner_version >= rounds

        try:
            while not shared.stopping.is_set():
                if cfg.sampler.max_episodes and self.episodes >= cfg.sampler.max_episodes:
                    return
                if cfg.run.mode == "sync":  # one episode per slot per version
                    async with self._version_seen:
                        await self._version_seen.wait_for(learner_reached_round)
                    rounds = self.learner_version + 1
                await self._episode(env, shared)
        finally:
            await env.close()

    async def _episode(self, env: Env, shared: _Run) -> None:
        cfg = self.cfg
        n = self.episodes
        self.episodes += 1
        group = n // cfg.sampler.group_size  # consecutive episodes share a task (GRPO group)
        seed = self.seed_of(group)
        tid = f"{shared.producer}-{self.incarnation}-{n}"
        task_id = f"{cfg.task.env}:{seed}"

        async def on_step(record: StepRecord) -> None:
            shared.publish(step_event(cfg.run.run_id, shared.producer, tid, task_id, record))

        shared.batcher.active += 1
        try:
            summary = await run_episode(
                env, task_id, seed, shared.batcher.act, self.builder,
                step_timeout_s=cfg.sampler.step_timeout_s, on_step=on_step,
                before_step=self._count if cfg.run.mode == "sync" else self._admit,
            )
        finally:
            shared.batcher.active -= 1
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
                **exploration_stats(self.holder)}


def step_event(run_id: str, producer: str, trajectory_id: str, task_id: str,
               record: StepRecord) -> TrajectoryStep:
    """The ``trajectory-step`` of one step the episode runner took."""
    result = record.result
    return TrajectoryStep(
        event_id=event_id("step", run_id, trajectory_id, record.step_index),
        run_id=run_id, producer=producer, key=trajectory_id,
        trajectory_id=trajectory_id, task_id=task_id, step_index=record.step_index,
        policy_version=record.acted.policy_version, context_tokens=record.context,
        action_tokens=record.acted.action.tokens,
        action_logprobs=record.acted.action.logprobs, action_text=record.acted.action.text,
        feedback=result.feedback,
        milestones=[Milestone(name=m.name, proof=m.proof) for m in result.milestones],
        state_changed=result.state_changed, tool_latency_s=record.latency_s, done=result.done,
        truncated=result.truncated, success=result.success, score=result.score,
        next_context_tokens=record.next_context, **step_fields(result),
    )


class UnfinishedTrajectories:
    """The trajectories a previous incarnation of a sampler left open, folded from its steps.

    A sampler that died mid-episode can never finish those episodes; without an end their
    open segments would pin the segmenter's commit floor forever. Each gets an ``EnvError``
    (the segmenter closes it as truncated); nothing is lost or invented. Fold only the
    events of one sampler (one actor name): with many samplers in a run, a restarted replica
    ends its own open trajectories, never another replica's. ``steps`` counts what that
    sampler published, each step once (redelivered copies too), for :meth:`SamplerCore.resume`.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, int]] = {}  # trajectory id -> (task id, last step)
        self._ended: set[str] = set()

    def fold(self, event: Event) -> None:
        match event:
            case TrajectoryStep():
                _, last = self._last.get(event.trajectory_id, ("", -1))
                self._last[event.trajectory_id] = (event.task_id, max(last, event.step_index))
                if event.done or event.truncated:
                    self._ended.add(event.trajectory_id)
            case EnvError():
                self._ended.add(event.trajectory_id)

    @property
    def steps(self) -> int:
        """Steps published: steps are numbered from 0 without gaps in each trajectory."""
        return sum(last + 1 for _, last in self._last.values())

    def abandoned(self, run_id: str, producer: str) -> list[EnvError]:
        return [EnvError(
            event_id=event_id("env-error", run_id, tid), run_id=run_id, producer=producer,
            key=tid, trajectory_id=tid, task_id=task_id, step_index=last_step + 1,
            kind="exception", message="abandoned: the sampler restarted mid-episode",
        ) for tid, (task_id, last_step) in self._last.items() if tid not in self._ended]
