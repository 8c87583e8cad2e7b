"""Evaluator: a fixed validation set of unseen tasks, run on selected policy versions.

consumes: policy-version (PolicyVersion)
emits:    eval (EvalResult)

Validation seeds start at ``task.eval_seed_start`` (never used for training). Versions are
evaluated every ``evaluator.every_versions`` versions, on the first one, and on the one the
learner marks final, and on every rollback version; decoding is greedy unless configured otherwise. Environment latency is
kept as configured, so validation measures the same task the sampler sees.
"""

from __future__ import annotations

import asyncio

from gyre_async.actor import Actor, Emit
from gyre_async.envs import make_env
from gyre_async.envs.macros import with_macros
from gyre_async.policy.base import SamplingParams
from gyre_async.policy.context import ContextBuilder
from gyre_async.policy.factory import build_policy, build_tokenizer
from gyre_async.rollout import ActionBatcher, PolicyHolder, run_episode
from schemas import event_id
from schemas.config import Config
from schemas.events import EvalResult, PolicyVersion
from schemas.topics import EVAL, POLICY_VERSION


async def evaluate(cfg: Config, holder: PolicyHolder, builder: ContextBuilder,
                   episodes: int, greedy: bool) -> dict:
    """Run the validation episodes concurrently with one batched policy; summarise them."""
    params = SamplingParams(temperature=1.0, max_action_tokens=cfg.policy.max_action_tokens,
                            greedy=greedy)
    batcher = ActionBatcher(holder, params, wait_s=cfg.sampler.batch_wait_s, seed=cfg.run.seed)
    batcher.active = episodes

    async def one(i: int):
        env = with_macros(make_env(cfg.task.env, **cfg.task.env_config), cfg.macros)
        seed = cfg.task.eval_seed_start + i
        try:
            return await run_episode(env, f"{cfg.task.env}:{seed}", seed, batcher.act, builder,
                                     step_timeout_s=cfg.sampler.step_timeout_s)
        finally:
            batcher.active -= 1
            await env.close()

    try:
        results = await asyncio.gather(*(one(i) for i in range(episodes)))
    finally:
        batcher.close()
    milestone_counts: dict[str, int] = {}
    for r in results:
        for name in {m.split("#")[0] for m in r.milestones}:
            milestone_counts[name] = milestone_counts.get(name, 0) + 1
    n = max(len(results), 1)
    return {
        "episodes": len(results),
        "success_rate": sum(r.success for r in results) / n,
        "mean_score": sum(r.score for r in results) / n,
        "mean_length": sum(r.steps for r in results) / n,
        "milestone_rates": {k: v / n for k, v in sorted(milestone_counts.items())},
        "env_steps": sum(r.steps for r in results),
    }


class Evaluator(Actor):
    role = "evaluator"
    consumes = (POLICY_VERSION,)
    emits = (EVAL,)

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

    def wants(self, event: PolicyVersion) -> bool:
        every = max(self.cfg.evaluator.every_versions, 1)
        return (event.version % every == 0 or event.metrics.get("final", 0.0) > 0
                or event.reason == "rollback")  # a rollback's recovery is always measured

    async def handle(self, event, record):
        match event:
            case PolicyVersion() if self.wants(event):
                await asyncio.to_thread(self.holder.load, event.checkpoint,
                                        event.checkpoint_hash, event.version)
                E = self.cfg.evaluator
                summary = await evaluate(self.cfg, self.holder, self.builder, E.episodes,
                                         E.greedy)
                self.evaluated += 1
                return [Emit(EVAL, EvalResult(
                    event_id=event_id("eval", self.cfg.run.run_id, event.version,
                                      event.reason, event.event_id),
                    run_id=self.cfg.run.run_id, producer=self.runner.name, key="eval",
                    policy_version=event.version, **summary))]
        return []

    def stats(self):
        return {"evaluated": float(self.evaluated)}
