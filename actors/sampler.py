"""Sampler: many environments, acting with the current policy, one event per step.

consumes: policy-version (PolicyVersion)
emits:    trajectory-step (TrajectoryStep, EnvError)

Each environment slot runs episodes back to back; all slots share one batched policy.
Every step is published as a ``trajectory-step`` stamped with the policy version that chose
the action. Bounded staleness (see ``gyre_async.rl.staleness``):
- a step is admitted only while steps_emitted < (learner_version + max_staleness + 1) *
  steps_per_version (the learner's pace throttles sampling);
- the sampler pauses while its loaded policy is more than max_staleness versions behind.
In ``sync`` mode each version samples exactly one episode per slot, then waits for the next
version: the strict sample-then-train baseline.

A slow or hung environment step ends only its own trajectory (``env-error`` + truncation).
"""

from __future__ import annotations

import asyncio
import uuid

from gyre_async.runtime.actor import Actor, Emit
from gyre_async.bus.reading import iter_topics
from gyre_async.audit.runlog import current_policy_version
from gyre_async.envs import make_env
from gyre_async.envs.macros import step_fields, with_macros
from gyre_async.compose import build_acting_policy, build_tokenizer
from gyre_async.policy.context import ContextBuilder
from gyre_async.rl.exploration import exploration_stats, make_holder, sampling_params_at
from gyre_async.rl.staleness import StalenessGate
from gyre_async.core.rollout import ActionBatcher, StepRecord, run_episode
from schemas import decode, event_id
from schemas.config import Config
from schemas.events import EnvError, Milestone, PolicyVersion, TrajectoryStep
from schemas.topics import POLICY_VERSION, TRAJECTORY_STEP


class Sampler(Actor):
    role = "sampler"
    consumes = (POLICY_VERSION,)
    emits = (TRAJECTORY_STEP,)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg)
        # exploration schedule (perturbed if configured); vLLM when policy.backend = "vllm"
        self.holder = make_holder(cfg, build_acting_policy(cfg, self.tokenizer))
        self.builder = ContextBuilder(self.tokenizer, cfg.policy.context_tokens,
                                      cfg.policy.history_turns)
        self.gate = StalenessGate(0 if cfg.run.mode == "sync" else cfg.loop.max_staleness,
                                  cfg.learner.batch_steps,
                                  cfg.sampler.num_envs * cfg.segmenter.max_segment_steps)
        self.learner_version = -1
        self.learner_consumed = 0  # steps the learner trained on or dropped (the gate's base)
        self.steps_emitted = 0
        self.episodes = 0
        self.env_errors = 0
        self.incarnation = uuid.uuid4().hex[:8]
        self._version_seen = asyncio.Condition()
        self._outbox: list[Emit] = []
        self.paused_s = 0.0
        self.abandoned = 0

    @classmethod
    def from_config(cls, cfg: Config) -> Sampler:
        return cls(cfg)

    # -- following the learner -------------------------------------------------------------
    async def on_start(self) -> None:
        await self._abandon_unfinished()
        latest = await current_policy_version(self.runner.bus)
        if latest is not None:
            await self._follow(latest)

    async def _abandon_unfinished(self) -> None:
        """End, visibly, the trajectories a previous incarnation of this sampler left open.

        A sampler that died mid-episode can never finish those episodes; without an end
        their open segments would pin the segmenter's commit floor forever. Each gets an
        ``env-error`` (the segmenter closes it as truncated); nothing is lost or invented.
        """
        known = {t.name for t in await self.runner.bus.topics()}
        if TRAJECTORY_STEP not in known:
            return
        last: dict[str, TrajectoryStep] = {}
        ended: set[str] = set()
        prefix = f"{self.runner.name}-"
        async for record in iter_topics(self.runner.bus, [TRAJECTORY_STEP]):
            if not (record.key or b"").decode(errors="replace").startswith(prefix):
                continue
            event = decode(TRAJECTORY_STEP, record.value, 1 << 40)
            match event:
                case TrajectoryStep() if event.done or event.truncated:
                    ended.add(event.trajectory_id)
                case TrajectoryStep():
                    last[event.trajectory_id] = event
                case EnvError():
                    ended.add(event.trajectory_id)
        orphans = [s for tid, s in last.items() if tid not in ended]
        await self.runner.emit([Emit(TRAJECTORY_STEP, EnvError(
            event_id=event_id("env-error", self.cfg.run.run_id, s.trajectory_id),
            run_id=self.cfg.run.run_id, producer=self.runner.name, key=s.trajectory_id,
            trajectory_id=s.trajectory_id, task_id=s.task_id, step_index=s.step_index + 1,
            kind="exception", message="abandoned: the sampler restarted mid-episode",
        )) for s in orphans])
        self.abandoned = len(orphans)

    async def handle(self, event, record):
        match event:
            case PolicyVersion():
                await self._follow(event)
        return []

    async def _follow(self, event: PolicyVersion) -> None:
        if event.version <= self.holder.version and event.reason != "rollback":
            return
        await asyncio.to_thread(self.holder.load, event.checkpoint, event.checkpoint_hash,
                                event.version)
        async with self._version_seen:
            self.learner_version = max(self.learner_version, event.version) \
                if event.reason != "rollback" else event.version
            self.learner_consumed = max(self.learner_consumed, event.consumed_steps)
            self._version_seen.notify_all()

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

    # -- producing ----------------------------------------------------------------------------
    async def produce(self) -> None:
        s = self.cfg.sampler
        params = sampling_params_at(self.cfg, max(self.holder.version, 0))
        self.batcher = ActionBatcher(self.holder, params, wait_s=s.batch_wait_s,
                                     seed=self.cfg.run.seed)
        flusher = asyncio.create_task(self._flush_loop())
        slots = [asyncio.create_task(self._slot(i)) for i in range(s.num_envs)]
        episodes = asyncio.gather(*slots)
        try:
            # a publish that failed for good must crash the actor (its supervisor restarts
            # it), not leave the slots stepping into an outbox nobody sends
            await asyncio.wait([episodes, flusher], return_when=asyncio.FIRST_COMPLETED)
            if flusher.done():
                episodes.cancel()
                flusher.result()
            await episodes
        finally:
            for t in slots:
                t.cancel()
            self.batcher.close()
            await self._flush()
            flusher.cancel()

    async def _slot(self, slot: int) -> None:
        cfg = self.cfg
        env = with_macros(make_env(cfg.task.env, **cfg.task.env_config), cfg.macros)
        rounds = 0
        try:
            while not self.runner.stopping.is_set():
                if cfg.sampler.max_episodes and self.episodes >= cfg.sampler.max_episodes:
                    return
                if cfg.run.mode == "sync":  # one episode per slot per version
                    async with self._version_seen:
                        await self._version_seen.wait_for(lambda: self.learner_version >= rounds)
                    rounds = self.learner_version + 1
                await self._episode(env, slot)
        finally:
            await env.close()

    async def _episode(self, env, slot: int) -> None:
        n = self.episodes
        self.episodes += 1
        group = n // self.cfg.sampler.group_size  # consecutive episodes share a task (GRPO group)
        seed = self.cfg.task.train_seed_start + int(event_id(self.incarnation, group)[:8], 16) % 10**7
        tid = f"{self.runner.name}-{self.incarnation}-{n}"
        task_id = f"{self.cfg.task.env}:{seed}"
        sync = self.cfg.run.mode == "sync"

        async def on_step(rec: StepRecord) -> None:
            r = rec.result
            self._outbox.append(Emit(TRAJECTORY_STEP, TrajectoryStep(
                event_id=event_id("step", self.cfg.run.run_id, tid, rec.step_index),
                run_id=self.cfg.run.run_id, producer=self.runner.name, key=tid,
                trajectory_id=tid, task_id=task_id, step_index=rec.step_index,
                policy_version=rec.acted.policy_version, context_tokens=rec.context,
                action_tokens=rec.acted.action.tokens,
                action_logprobs=rec.acted.action.logprobs, action_text=rec.acted.action.text,
                feedback=r.feedback,
                milestones=[Milestone(name=m.name, proof=m.proof) for m in r.milestones],
                state_changed=r.state_changed, tool_latency_s=rec.latency_s, done=r.done,
                truncated=r.truncated, success=r.success, score=r.score,
                next_context_tokens=rec.next_context, **step_fields(r),
            )))

        self.batcher.active += 1
        try:
            summary = await run_episode(
                env, task_id, seed, self.batcher.act, self.builder,
                step_timeout_s=self.cfg.sampler.step_timeout_s, on_step=on_step,
                before_step=self._count if sync else self._admit,
            )
        finally:
            self.batcher.active -= 1
        if summary.failure is not None:
            self.env_errors += 1
            self._outbox.append(Emit(TRAJECTORY_STEP, EnvError(
                event_id=event_id("env-error", self.cfg.run.run_id, tid),
                run_id=self.cfg.run.run_id, producer=self.runner.name, key=tid,
                trajectory_id=tid, task_id=task_id, step_index=summary.steps,
                kind=summary.failure.kind, message=summary.failure.message,
            )))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sampler.flush_interval_s)
            await self._flush()

    async def _flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            await self.runner.emit(batch)

    def stats(self):
        return {"episodes": float(self.episodes), "steps": float(self.steps_emitted),
                "policy_version": float(self.holder.version),
                "env_errors": float(self.env_errors), "paused_s": self.paused_s,
                **exploration_stats(self.holder)}
