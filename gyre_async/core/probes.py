"""The probe set: fixed contexts on which two policies are compared (the keeper's KL).

Collecting it runs environment episodes, so it lives with the roles' cores and not in
:mod:`gyre_async.rl` (maths only): :func:`gyre_async.rl.policy_distance.policy_kl` takes the
contexts this module builds.
"""

from __future__ import annotations

import random

from gyre_async.core.rollout import milestone_summary
from gyre_async.envs import make_env
from gyre_async.policy.context import ContextBuilder
from schemas.config import Config


async def probe_contexts(cfg: Config, tokenizer, n: int, seed_start: int) -> list[list[int]]:
    """A fixed, reproducible probe set: contexts from ``n`` seeds after a few random steps.

    Seed ``seed_start + i`` is reset, then ``i % 8`` uniformly random admissible actions
    (from a generator seeded with the seed) are taken, so the set covers start states and
    states a little way in. No policy is involved: the set is the same for every version.
    """
    builder = ContextBuilder(tokenizer, cfg.policy.context_tokens, cfg.policy.history_turns)

    async def one(i: int) -> list[int]:
        seed = seed_start + i
        env = make_env(cfg.task.env, **{**cfg.task.env_config, "latency_mean_s": 0.0}) \
            if cfg.task.env == "workshop" else make_env(cfg.task.env, **cfg.task.env_config)
        try:
            observation = await env.reset(f"{cfg.task.env}:{seed}", seed)
            rng = random.Random(seed)
            reached: list[str] = []
            for _ in range(i % 8):
                actions = env.admissible_actions() if hasattr(env, "admissible_actions") else []
                if not actions:
                    break
                result = await env.step(rng.choice(actions))
                reached += [m.name for m in result.milestones]
                if result.over:
                    break
                observation = result.observation
            return builder.build(observation, [], milestone_summary(reached))
        finally:
            await env.close()

    return [await one(i) for i in range(n)]
