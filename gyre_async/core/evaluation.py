"""Validation: a fixed set of unseen tasks, played greedily (or sampled) by one policy.

The validation set is explicit in config: ``evaluator.tasks`` (task ids handed to the
environment's reset; default ``<env>:<seed>``) x ``evaluator.seeds`` (game / variation
indices; default ``episodes`` seeds from ``task.eval_seed_start``), played with
``task.env_config`` overridden by ``evaluator.env_config`` (e.g. ``split = "dev"`` for the
text games, whose splits are disjoint from training). It never changes during a run, so
every evaluation is comparable. Environment latency is kept as configured, so validation
measures the task the sampler sees.

Which versions (:func:`eval_trigger`): every ``evaluator.every_versions`` versions (version
0 unless ``evaluator.start`` is off), the one the learner marks final, every rollback
version, and any version published for a reason in ``evaluator.on_reasons`` (warm-start).
Nothing here touches the bus: the evaluator actor and ``gyre run``'s closing evaluation
publish what :meth:`Evaluation.run` returns. Episodes run concurrently (asyncio) so that one batched
policy serves them all.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import sys
import time
from typing import TextIO

from gyre_async.compose import (
    build_acting_policy,
    build_context_builder,
    build_policy,
    build_tokenizer,
)
from gyre_async.core.rollout import (
    ActionBatcher,
    EpisodeSummary,
    PolicyHolder,
    StepRecord,
    run_episode,
)
from gyre_async.envs import make_env
from gyre_async.envs.macros import with_macros
from gyre_async.policy.base import Policy, SamplingParams
from gyre_async.policy.context import ContextBuilder
from gyre_async.policy.tokenizer import BaseTokenizer
from gyre_async.storage.roots import StorageRoots
from schemas import event_id
from schemas.config import Config
from schemas.events import EvalResult, PolicyVersion


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate over ``n`` episodes (unlike the
    normal approximation it stays inside [0, 1] and is honest at 0 or n successes, where
    validation figures of few episodes often sit)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def validation_policy(cfg: Config, tokenizer: BaseTokenizer) -> Policy:
    """The policy validation plays with: the sampler's acting engine when
    ``evaluator.engine = "sampler"`` (vLLM for ``policy.backend = "vllm"``), else a torch
    copy of the trainable policy."""
    make = build_acting_policy if cfg.evaluator.engine == "sampler" else build_policy
    return make(cfg, tokenizer)


def validation_set(cfg: Config, episodes: int | None = None) -> list[tuple[str, int]]:
    """(task id, seed) of every validation episode, in order (fixed by config)."""
    evaluator = cfg.evaluator
    start = cfg.task.eval_seed_start
    seeds = list(evaluator.seeds) or list(range(start, start + (episodes or evaluator.episodes)))
    if evaluator.tasks:
        return [(task, seed) for task, seed in itertools.product(evaluator.tasks, seeds)]
    return [(f"{cfg.task.env}:{seed}", seed) for seed in seeds]


async def evaluate(cfg: Config, holder: PolicyHolder, builder: ContextBuilder,
                   episodes: int | None, greedy: bool,
                   progress: EvalProgress | None = None) -> dict:
    """Run the validation episodes concurrently with one batched policy; summarise them.
    ``progress`` hears of every step and every episode's end (96 language-model games take
    tens of minutes)."""
    params = SamplingParams(temperature=cfg.evaluator.temperature,
                            max_action_tokens=cfg.policy.max_action_tokens,
                            greedy=greedy)
    plan = validation_set(cfg, episodes)
    env_config = {**cfg.task.env_config, **cfg.evaluator.env_config}
    batcher = ActionBatcher(holder, params, wait_s=cfg.sampler.batch_wait_s, seed=cfg.run.seed)
    at_once = concurrent_episodes(cfg, holder.policy, builder, len(plan))
    gate = asyncio.Semaphore(at_once)
    batcher.active = at_once
    ended = 0

    async def one(index: int, task_id: str, seed: int):
        nonlocal ended
        async with gate:
            env = with_macros(make_env(cfg.task.env, **env_config), cfg.macros)
            # segment contexts: each episode acts on its own cached prefix, forgotten at its
            # end (named per call: weights may change between two calls)
            session = f"validation-{id(batcher)}-{index}" if builder.segments else None
            act = functools.partial(batcher.act, session=session)
            try:
                summary = await run_episode(env, task_id, seed, act, builder,
                                            step_timeout_s=cfg.sampler.step_timeout_s,
                                            segments=cfg.segmenter,
                                            on_step=None if progress is None else progress.step)
                if progress is not None:
                    progress.episode(summary, len(plan))
                return summary
            finally:
                ended += 1  # the next episode takes this one's place while any is left
                batcher.active = min(at_once, len(plan) - ended)
                if session is not None:
                    holder.policy.forget_session(session)
                await env.close()

    try:
        results = await asyncio.gather(*(one(i, t, s) for i, (t, s) in enumerate(plan)))
    finally:
        batcher.close()
    milestone_counts: dict[str, int] = {}
    for r in results:
        for name in {m.split("#")[0] for m in r.milestones}:
            milestone_counts[name] = milestone_counts.get(name, 0) + 1
    per_task: dict[str, list[bool]] = {}
    for (task_id, _), r in zip(plan, results):
        per_task.setdefault(task_id, []).append(r.success)
    n = max(len(results), 1)
    return {
        "episodes": len(results),
        "success_rate": sum(r.success for r in results) / n,
        "mean_score": sum(r.score for r in results) / n,
        "mean_length": sum(r.steps for r in results) / n,
        "milestone_rates": {k: v / n for k, v in sorted(milestone_counts.items())},
        "env_steps": sum(r.steps for r in results),
        "decoding": "greedy" if greedy else "sampled",
        "task_success_rates": ({t: sum(v) / len(v) for t, v in per_task.items()}
                               if cfg.evaluator.tasks else {}),
        "validation_seeds": sorted({s for _, s in plan}),
        "validation_config": {k: str(v) for k, v in cfg.evaluator.env_config.items()},
    }


def concurrent_episodes(cfg: Config, policy: Policy, builder: ContextBuilder, planned: int
                        ) -> int:
    """How many validation episodes play at once: ``evaluator.concurrency`` (0: all), and
    with segment contexts at most the sessions the policy keeps cached."""
    at_once = cfg.evaluator.concurrency or planned
    kept = getattr(policy, "max_sessions", None)
    if builder.segments and kept:
        at_once = min(at_once, kept)
    return max(1, min(at_once, planned))


class EvalProgress:
    """An evaluation's progress on stderr (:func:`evaluate`'s ``progress``): env steps
    played, episodes ended of those planned and won so far, elapsed seconds; a line at most
    every ``every_s`` seconds and at the last episode. Episodes run all at once, so most
    end together near the end: the steps are what moves."""

    def __init__(self, label: str, every_s: float = 30.0, out: TextIO | None = None):
        self.label, self.every_s = label, every_s
        self.out = out if out is not None else sys.stderr
        self.started = self._printed = time.monotonic()
        self.steps = self.ended = self.won = 0
        self.planned = 0

    async def step(self, _record: StepRecord) -> None:
        self.steps += 1
        self._maybe_print()

    def episode(self, summary: EpisodeSummary, planned: int) -> None:
        self.ended += 1
        self.won += int(summary.success)
        self.planned = planned
        self._maybe_print(force=self.ended == planned)

    def _maybe_print(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._printed < self.every_s:
            return
        self._printed = now
        planned = f"/{self.planned}" if self.planned else ""
        print(f"[eval {now - self.started:6.0f}s] {self.label}: {self.steps} env steps, "
              f"{self.ended}{planned} episodes ended, {self.won} won", file=self.out,
              flush=True)


def eval_trigger(cfg: Config, version: PolicyVersion) -> str:
    """Why this version is evaluated ("" when it is not)."""
    if version.metrics.get("final", 0.0) > 0:
        return "final"
    if version.version == 0 and not cfg.evaluator.start:
        return ""
    if version.reason == "rollback" or version.reason in cfg.evaluator.on_reasons:
        return f"reason:{version.reason}"  # a rollback's recovery is always measured
    if version.version % max(cfg.evaluator.every_versions, 1) == 0:
        return "schedule"
    return ""


class Evaluation:
    """One policy, loaded version by version, played on the validation set."""

    def __init__(self, cfg: Config, holder: PolicyHolder, builder: ContextBuilder):
        self.cfg = cfg
        self.holder = holder
        self.builder = builder
        self.roots = StorageRoots.from_config(cfg)  # where a policy-version may point
        self.evaluated = 0

    @classmethod
    def from_config(cls, cfg: Config) -> Evaluation:
        tokenizer = build_tokenizer(cfg)
        return cls(cfg, PolicyHolder(validation_policy(cfg, tokenizer)),
                   build_context_builder(cfg, tokenizer))

    async def run(self, version: PolicyVersion, *, greedy: bool, trigger: str, cause: str,
                  producer: str) -> EvalResult:
        """Load ``version``'s weights (announced by the run's learner, in its checkpoint
        root, hash verified) and validate them. ``cause`` is the id of
        the event that asked for it: one result per (version, reason, cause)."""
        address = self.roots.checkpoint_of(version)  # or raise: the evaluator dead-letters
        await asyncio.to_thread(self.holder.load, address, version.checkpoint_hash,
                                version.version)
        summary = await evaluate(self.cfg, self.holder, self.builder, None, greedy)
        self.evaluated += 1
        return EvalResult(
            event_id=event_id("eval", self.cfg.run.run_id, version.version, version.reason,
                              cause),
            run_id=self.cfg.run.run_id, producer=producer, key="eval",
            policy_version=version.version, trigger=trigger, **summary)
