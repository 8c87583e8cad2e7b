"""Evaluator: a fixed validation set of unseen tasks, run on selected policy versions.

consumes: policy-version (PolicyVersion), eval-request (EvalRequest)
emits:    eval (EvalResult)

The validation set is explicit in config: ``evaluator.tasks`` (task ids handed to the
environment's reset; default ``<env>:<seed>``) x ``evaluator.seeds`` (game / variation
indices; default ``episodes`` seeds from ``task.eval_seed_start``), played with
``task.env_config`` overridden by ``evaluator.env_config`` (e.g. ``split = "dev"`` for the
text games, whose splits are disjoint from training). It never changes during a run, so
every evaluation is comparable.

Which versions: every ``evaluator.every_versions`` versions (version 0 always), the one the
learner marks final, every rollback version, any version published for a reason in
``evaluator.on_reasons`` (warm-start), and any version named by an ``eval-request`` event (``gyre
evaluate``), which may also choose the decoding. Decoding is greedy unless configured (or
requested) otherwise; the result says which (``decoding``) and why it ran (``trigger``).
Environment latency is kept as configured, so validation measures the task the sampler sees.
"""

from __future__ import annotations

import asyncio
import itertools

from gyre_async.runtime.actor import Actor, Emit
from gyre_async.bus.reading import iter_topics
from gyre_async.envs import make_env
from gyre_async.envs.macros import with_macros
from gyre_async.policy.base import SamplingParams
from gyre_async.policy.context import ContextBuilder
from gyre_async.compose import build_policy, build_tokenizer
from gyre_async.core.rollout import ActionBatcher, PolicyHolder, run_episode
from schemas import decode, event_id
from schemas.config import Config
from schemas.events import EvalRequest, EvalResult, PolicyVersion
from schemas.topics import EVAL, EVAL_REQUEST, POLICY_VERSION


def validation_set(cfg: Config, episodes: int | None = None) -> list[tuple[str, int]]:
    """(task id, seed) of every validation episode, in order (fixed by config)."""
    E = cfg.evaluator
    seeds = list(E.seeds) or list(range(cfg.task.eval_seed_start,
                                        cfg.task.eval_seed_start + (episodes or E.episodes)))
    if E.tasks:
        return [(task, seed) for task, seed in itertools.product(E.tasks, seeds)]
    return [(f"{cfg.task.env}:{seed}", seed) for seed in seeds]


async def evaluate(cfg: Config, holder: PolicyHolder, builder: ContextBuilder,
                   episodes: int | None, greedy: bool) -> dict:
    """Run the validation episodes concurrently with one batched policy; summarise them."""
    params = SamplingParams(temperature=1.0, max_action_tokens=cfg.policy.max_action_tokens,
                            greedy=greedy)
    plan = validation_set(cfg, episodes)
    env_config = {**cfg.task.env_config, **cfg.evaluator.env_config}
    batcher = ActionBatcher(holder, params, wait_s=cfg.sampler.batch_wait_s, seed=cfg.run.seed)
    batcher.active = len(plan)

    async def one(task_id: str, seed: int):
        env = with_macros(make_env(cfg.task.env, **env_config), cfg.macros)
        try:
            return await run_episode(env, task_id, seed, batcher.act, builder,
                                     step_timeout_s=cfg.sampler.step_timeout_s)
        finally:
            batcher.active -= 1
            await env.close()

    try:
        results = await asyncio.gather(*(one(t, s) for t, s in plan))
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


class Evaluator(Actor):
    role = "evaluator"
    consumes = (POLICY_VERSION, EVAL_REQUEST)
    emits = (EVAL,)
    max_batch = 1  # an evaluation takes seconds to minutes: publish each result at once

    def __init__(self, cfg: Config):
        self.cfg = cfg
        tokenizer = build_tokenizer(cfg)
        self.holder = PolicyHolder(build_policy(cfg, tokenizer))
        self.builder = ContextBuilder(tokenizer, cfg.policy.context_tokens,
                                      cfg.policy.history_turns)
        self.evaluated = 0

    @classmethod
    def from_config(cls, cfg: Config) -> Evaluator:
        return cls(cfg)

    def trigger(self, event: PolicyVersion) -> str:
        """Why this version is evaluated ("" when it is not)."""
        if event.metrics.get("final", 0.0) > 0:
            return "final"
        if event.reason == "rollback" or event.reason in self.cfg.evaluator.on_reasons:
            return f"reason:{event.reason}"  # a rollback's recovery is always measured
        if event.version % max(self.cfg.evaluator.every_versions, 1) == 0:
            return "schedule"
        return ""

    def wants(self, event: PolicyVersion) -> bool:
        return bool(self.trigger(event))

    async def handle(self, event, record):
        match event:
            case PolicyVersion() if self.wants(event):
                return [await self._evaluate(event, self.cfg.evaluator.greedy,
                                             self.trigger(event), event.event_id)]
            case EvalRequest():
                version = await self._find_version(event.policy_version)
                if version is None:
                    self.runner.log.warning("eval-request.unknown-version",
                                            version=event.policy_version)
                    return []
                greedy = self.cfg.evaluator.greedy if event.greedy is None else event.greedy
                return [await self._evaluate(version, greedy, "request", event.event_id)]
        return []

    async def _find_version(self, wanted: int) -> PolicyVersion | None:
        """The last publication of version ``wanted`` (-1: the newest publication)."""
        found = None
        async for record in iter_topics(self.runner.bus, [POLICY_VERSION]):
            event = decode(POLICY_VERSION, record.value, 1 << 40)
            if wanted < 0 or event.version == wanted:
                found = event
        return found

    async def _evaluate(self, version: PolicyVersion, greedy: bool, trigger: str,
                        cause: str) -> Emit:
        await asyncio.to_thread(self.holder.load, version.checkpoint, version.checkpoint_hash,
                                version.version)
        summary = await evaluate(self.cfg, self.holder, self.builder, None, greedy)
        self.evaluated += 1
        return Emit(EVAL, EvalResult(
            event_id=event_id("eval", self.cfg.run.run_id, version.version, version.reason,
                              cause),
            run_id=self.cfg.run.run_id, producer=self.runner.name, key="eval",
            policy_version=version.version, trigger=trigger, **summary))

    def stats(self):
        return {"evaluated": float(self.evaluated)}
