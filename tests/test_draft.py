"""Acting with prompt-lookup drafts (``policy.draft_tokens``): exact speculative sampling.

- the draft is what followed the latest earlier occurrence of the longest suffix;
- greedy acting with drafts gives the very tokens and log-probs of one token per pass, in
  fewer passes, with and without cached sessions (the tiny policy and a Hugging Face Llama);
- sampled acting with drafts draws from the policy's own distribution: the chance of the
  drafted tokens and the first token's marginal match the exact ones (a sampler that kept
  drafts too often, or drew the refused token again, fails), and every recorded log-prob
  is the learner's for the same token;
- sessions kept by drafted acting hold no refused column: the segment path's checks pass.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_segment_contexts import (
    OBSERVATIONS,
    TOK,
    check_segment_path,
    llama_dir,  # noqa: F401  (a module fixture, used by name)
    tiny_policy,
)

from gyre_async.policy import ContextBuilder, SamplingParams
from gyre_async.policy.draft import prompt_lookup


def test_the_draft_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    seq = [1, 2, 3, 9, 8, 5, 2, 3, 7, 6, 1, 2, 3]
    assert prompt_lookup(seq, 2) == [9, 8]  # the longest suffix, [1, 2, 3], at the start
    assert prompt_lookup(seq, 2, max_ngram=2) == [7, 6]  # [2, 3]: the latest, not the first
    assert prompt_lookup(seq, 2, max_ngram=1) == [7, 6]
    assert prompt_lookup(seq, 20) == seq[3:]  # as far as the sequence goes
    assert prompt_lookup([5, 6, 7], 4) == []  # nothing occurs earlier
    assert prompt_lookup(seq, 0) == [] and prompt_lookup([3], 2) == []
    assert prompt_lookup([7, 7], 3) == [7]  # an occurrence right before the end


def play_greedy(policy, builder: ContextBuilder, sessions: bool, steps: int = 6):
    """Episodes of ``OBSERVATIONS`` acted greedily through one segment context each."""
    params = SamplingParams(greedy=True, max_action_tokens=6)
    contexts = [builder.opening(obs[0], "done none") for obs in OBSERVATIONS]
    played = []
    for t in range(steps):
        acts = policy.act_batch(contexts, params, sessions=["a", "b"] if sessions else None)
        played.append(acts)
        contexts = [c + a.tokens + builder.continuation(a.tokens, obs[(t + 1) % len(obs)])
                    for c, a, obs in zip(contexts, acts, OBSERVATIONS)]
    return played


def check_greedy(make, budget: int, atol: float) -> None:
    builder = ContextBuilder(make(0).tokenizer, budget, 0, mode="segment")
    for sessions in (True, False):
        plain, drafted = make(0), make(8)
        ours = play_greedy(drafted, builder, sessions)
        theirs = play_greedy(plain, builder, sessions)
        for step_ours, step_theirs in zip(ours, theirs):
            for a, b in zip(step_ours, step_theirs):
                assert a.tokens == b.tokens
                assert a.policy_logprobs == pytest.approx(b.policy_logprobs, abs=atol)
        assert drafted.accepted_tokens > 0  # drafts were read and kept ...
        assert drafted.act_forwards < plain.act_forwards  # ... in fewer passes
        # the same contexts; an action's last token, kept from a draft, is already cached
        assert (drafted.prefill_computed + drafted.prefill_reused
                == plain.prefill_computed + plain.prefill_reused)
        assert drafted.prefill_computed <= plain.prefill_computed


def drafting(policy, n: int):
    policy.draft_tokens = n
    return policy


def test_greedy_acting_with_drafts_acts_as_one_token_per_pass_in_fewer_passes():
    check_greedy(lambda n: drafting(tiny_policy(), n), 240, atol=1e-5)


def test_sampled_acting_with_drafts_keeps_the_segment_paths_checks():
    policy = drafting(tiny_policy(), 6)
    check_segment_path(policy, budget=240, atol=1e-5)
    assert policy.drafted_tokens > policy.accepted_tokens > 0


def test_a_hugging_face_model_acts_with_drafts_exactly(llama_dir):  # noqa: F811
    from gyre_async.policy.hf_policy import HFPolicy

    def make(n: int) -> HFPolicy:  # actions of several tokens: a few words, no newline
        tokenizer = HFPolicy.from_pretrained(llama_dir).tokenizer
        words = [t for w in ("open", "take", "fridge", "apple", "key", "door")
                 for t in tokenizer.encode(" " + w)]
        return drafting(HFPolicy.from_pretrained(llama_dir, seed=1, action_token_ids=words), n)

    check_greedy(make, 400, atol=1e-4)
    policy = make(6)
    check_segment_path(policy, budget=400, atol=1e-4)
    assert policy.accepted_tokens > 0


def exact(policy, context: list[int], temperature: float) -> torch.Tensor:
    """Behaviour distribution [V] of the next token after ``context``."""
    logp = policy.next_token_logprobs([context])[0]
    return torch.softmax(logp / temperature, -1)  # log-probs shift-invariant: logits / T


def test_sampled_drafts_draw_from_the_policys_own_distribution():
    policy = drafting(tiny_policy(seed=3), 2)
    lead, stem = TOK.token_id("start"), [TOK.token_id(w) for w in ("order", "of", "need")]
    assert TOK.unk_id not in (lead, *stem)
    allowed = [t for t in torch.nonzero(policy.allowed).squeeze(1).tolist()
               if t not in (lead, *stem, TOK.eos_id)]

    def context(x1: int, x2: int) -> list[int]:  # [lead x1 x2 ... lead]: the draft is x1 x2
        return [lead, x1, x2] + stem + [lead]

    # the drafted first token whose chance is nearest 1/2 (a sampler that keeps drafts too
    # often or too rarely is then far off), then the most likely second token after it; a
    # fresh model's distributions are flat, a low temperature sharpens them
    x2 = allowed[0]
    for temperature in (0.5, 0.2, 0.1, 0.05, 0.02):
        x1 = min(allowed, key=lambda x: abs(
            float(exact(policy, context(x, x2), temperature)[x]) - 0.5))
        if 0.2 < float(exact(policy, context(x1, x2), temperature)[x1]) < 0.8:
            break
    x2 = max(allowed, key=lambda x: float(exact(policy, context(x1, x) + [x1], temperature)[x]))
    c = context(x1, x2)
    assert prompt_lookup(c, 2) == [x1, x2]
    p1 = exact(policy, c, temperature)
    p2 = exact(policy, c + [x1], temperature)
    assert 0.1 < float(p1[x1]) < 0.9
    params = SamplingParams(temperature=temperature, max_action_tokens=2)
    first, both, n = torch.zeros_like(p1), 0, 0
    for seed in range(10):
        for action in policy.act_batch([c] * 400, params, seed=seed):
            first[action.tokens[0]] += 1
            both += action.tokens == [x1, x2]
            n += 1
            assert action.logprobs[0] == pytest.approx(math.log(p1[action.tokens[0]]), abs=1e-4)
    assert policy.accepted_tokens > 0
    for observed, p in ((float(first[x1]) / n, float(p1[x1])),
                        (both / n, float(p1[x1] * p2[x2]))):
        assert abs(observed - p) < 4.5 * math.sqrt(p * (1 - p) / n), (observed, p)
    total_variation = 0.5 * float((first / n - p1).abs().sum())
    assert total_variation < 0.05
    # a drafted action's log-probs are the learner's for the same tokens
    acts = policy.act_batch([c] * 8, params, seed=99)
    out = policy.evaluate([c] * 8, [a.tokens for a in acts])
    for i, a in enumerate(acts):
        assert a.policy_logprobs == pytest.approx(out.logprobs[i, :len(a.tokens)].tolist(),
                                                  abs=1e-5)


def test_drafts_are_off_by_default_and_refused_for_a_vllm_engine(tiny):
    from gyre_async.policy.factory import make_acting_policy

    assert tiny_policy().draft_tokens == 0
    cfg = tiny.config(policy={"backend": "vllm", "draft_tokens": 4})
    with pytest.raises(ValueError, match="draft_tokens"):
        make_acting_policy(cfg, TOK)

