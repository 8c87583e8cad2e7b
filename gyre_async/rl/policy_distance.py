"""How far apart two policies are: KL on probe contexts, and relative parameter change.

Two uses. The keeper calls an update *large* when the new version's next-token
distributions moved more than ``keeper.large_update_kl`` nats (mean KL, parent -> new) on a
fixed probe set, or its weights moved more than ``keeper.large_update_param_change``
relative to the parent's. Parameter-space noise adapts its scale so the perturbed policy
sits a target KL away from the unperturbed one on recent contexts.

KL is measured on the first action token's distribution after each context (the raw policy,
temperature 1, action vocabulary applied): one forward pass per context, and the token that
decides which action is taken. The probe contexts come from :mod:`gyre_async.core.probes`
(they need environment episodes); the slow reference versions of both measures, which the
fast ones are tested against, live in ``tests/test_exploration.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def mean_kl(logp_p: torch.Tensor, logp_q: torch.Tensor) -> float:
    """Mean over rows of KL(p || q) for log-prob matrices [B, V] (-inf where p is 0)."""
    p = logp_p.exp()
    # 0 * log 0 terms are 0; where p > 0 and q is 0 the divergence is infinite (and stays so).
    diff = torch.where(p > 0, logp_p - logp_q, torch.zeros_like(logp_p))
    return float((p * diff).sum(-1).mean())


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


def probe_logprobs(policy, state: Mapping[str, torch.Tensor], contexts: list[list[int]]
                   ) -> torch.Tensor:
    """Next-token log-probs [B, V] of ``state`` on ``contexts``, loaded into ``policy``
    (the caller owns it; its weights are left as ``state``)."""
    policy.load_state_dict(state)
    return policy.next_token_logprobs(contexts)


def policy_kl(policy, state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor],
              contexts: list[list[int]]) -> float:
    """Mean KL(pi_a || pi_b) of next-token distributions on ``contexts``.

    Loads each state into ``policy`` in turn (the caller owns ``policy`` and its weights are
    left as ``state_b``).
    """
    logp_a = probe_logprobs(policy, state_a, contexts)
    return mean_kl(logp_a, probe_logprobs(policy, state_b, contexts))
