"""How far apart two policies are: KL on probe contexts, and relative parameter change.

Two uses. The keeper calls an update *large* when the new version's next-token
distributions moved more than ``keeper.large_update_kl`` nats (mean KL, parent -> new) on a
fixed probe set, or its weights moved more than ``keeper.large_update_param_change``
relative to the parent's. Parameter-space noise adapts its scale so the perturbed policy
sits a target KL away from the unperturbed one on recent contexts.

KL is measured on the first action token's distribution after each context (the raw policy,
temperature 1, action vocabulary applied): one forward pass per context, and the token that
decides which action is taken. Both functions have slow reference versions for the tests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import torch

from schemas.config import Config


def mean_kl(logp_p: torch.Tensor, logp_q: torch.Tensor) -> float:
    """Mean over rows of KL(p || q) for log-prob matrices [B, V] (-inf where p is 0)."""
    p = logp_p.exp()
    # 0 * log 0 terms are 0; where p > 0 and q is 0 the divergence is infinite (and stays so).
    diff = torch.where(p > 0, logp_p - logp_q, torch.zeros_like(logp_p))
    return float((p * diff).sum(-1).mean())


def mean_kl_reference(logp_p: Sequence[Sequence[float]], logp_q: Sequence[Sequence[float]]
                      ) -> float:
    """Slow, obviously-correct mean KL(p || q): loops over rows and tokens."""
    total = 0.0
    for row_p, row_q in zip(logp_p, logp_q):
        kl = 0.0
        for lp, lq in zip(row_p, row_q):
            if lp == -math.inf:
                continue
            kl += math.exp(lp) * (lp - lq)
        total += kl
    return total / len(logp_p)


def relative_param_change(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
                          ) -> float:
    """||new - old|| / ||old|| over all floating-point tensors (one flat vector)."""
    num = den = 0.0
    for name, a in old.items():
        if not a.is_floating_point():
            continue
        a64, b64 = a.detach().double(), new[name].detach().double()
        num += float(((b64 - a64) ** 2).sum())
        den += float((a64 ** 2).sum())
    return math.sqrt(num) / math.sqrt(den) if den > 0 else 0.0


def relative_param_change_reference(old: Mapping[str, torch.Tensor],
                                    new: Mapping[str, torch.Tensor]) -> float:
    """Slow reference: element by element."""
    num = den = 0.0
    for name, a in old.items():
        if not a.is_floating_point():
            continue
        for x, y in zip(a.reshape(-1).tolist(), new[name].reshape(-1).tolist()):
            num += (y - x) ** 2
            den += x * x
    return math.sqrt(num / den) if den > 0 else 0.0


def policy_kl(policy, state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor],
              contexts: list[list[int]]) -> float:
    """Mean KL(pi_a || pi_b) of next-token distributions on ``contexts``.

    Loads each state into ``policy`` in turn (the caller owns ``policy`` and its weights are
    left as ``state_b``).
    """
    policy.load_state_dict(state_a)
    logp_a = policy.next_token_logprobs(contexts)
    policy.load_state_dict(state_b)
    logp_b = policy.next_token_logprobs(contexts)
    return mean_kl(logp_a, logp_b)


async def probe_contexts(cfg: Config, tokenizer, n: int, seed_start: int) -> list[list[int]]:
    """A fixed, reproducible probe set: contexts from ``n`` seeds after a few random steps.

    Seed ``seed_start + i`` is reset, then ``i % 8`` uniformly random admissible actions
    (from a generator seeded with the seed) are taken, so the set covers start states and
    states a little way in. No policy is involved: the set is the same for every version.
    """
    from gyre_async.envs import make_env
    from gyre_async.policy.context import ContextBuilder
    from gyre_async.core.rollout import milestone_summary

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
