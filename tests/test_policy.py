"""Tokenizers, bounded contexts, the torch policy (acting, evaluation); its checkpoints are
tested with the checkpoint store (test_checkpoints.py)."""

from __future__ import annotations

import asyncio
import collections
import math

import msgspec
import pytest
import torch

from gyre_async.envs import ACTION_WORDS, VOCAB, WorkshopConfig, WorkshopEnv, oracle_action
from gyre_async.policy import (
    ByteTokenizer,
    ContextBuilder,
    ModelConfig,
    SamplingParams,
    TorchPolicy,
    WordTokenizer,
    summarize_milestones,
    tokenizer_for_vocabulary,
    tokenizer_from_json,
)

TOK = tokenizer_for_vocabulary(VOCAB)  # the workshop's words (the composition root's choice)


def make_policy(seed: int = 0, restrict: bool = True, **overrides) -> TorchPolicy:
    ids = tuple(TOK.token_id(w) for w in ACTION_WORDS) if restrict else ()
    config = ModelConfig(vocab_size=TOK.vocab_size, action_token_ids=ids, **overrides)
    return TorchPolicy(config, TOK, seed=seed)


def workshop_samples(n_episodes: int, steps: int, builder: ContextBuilder, first_seed: int = 0):
    """(context, oracle action text) pairs from real workshop episodes."""
    async def collect():
        out = []
        for seed in range(first_seed, first_seed + n_episodes):
            env = WorkshopEnv(WorkshopConfig())
            obs, history = await env.reset("t", seed), []
            for _ in range(steps):
                action = oracle_action(obs)
                out.append((builder.build(obs, history, "done craft:axe#1"), action))
                result = await env.step(action)
                history.append((obs, action))
                obs = result.observation
        return out
    return asyncio.run(collect())


# -- tokenizers -------------------------------------------------------------------------------

def test_word_tokenizer_round_trip_and_json():
    assert isinstance(TOK, WordTokenizer) and TOK.vocab_size == 8 + len(VOCAB)
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
    text = "order 3 of 1 2 : axe x 2 . need wood 1 stone 0 ore 1 smelt 0 ingot 1 . chop ok"
    ids = TOK.encode(text)
    assert TOK.unk_id not in ids and TOK.decode(ids) == text
    assert TOK.decode(TOK.encode("Order 12.")) == "order 1 2 ."  # digits and punctuation split
    assert TOK.encode("dragon") == [TOK.unk_id]
    assert TOK.decode([TOK.bos_id, *TOK.encode("craft"), TOK.eos_id]) == "craft"
    assert TOK.decode([TOK.eos_id], skip_special=False) == "<eos>"
    again = tokenizer_from_json(TOK.to_json())
    assert again.encode(text) == ids and again.vocab_size == TOK.vocab_size
    with pytest.raises(ValueError, match="not one token"):
        WordTokenizer(["two words"])


def test_byte_tokenizer_round_trip():
    tok = tokenizer_for_vocabulary([])  # an environment that cannot list its words
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 8 + 256
    text = "naïve café: 42 ✓"
    ids = tok.encode(text)
    assert min(ids) >= 8 and tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    assert isinstance(tokenizer_from_json(tok.to_json()), ByteTokenizer)


# -- contexts ---------------------------------------------------------------------------------

def test_context_builder_is_bounded_and_keeps_newest():
    builder = ContextBuilder(TOK, max_tokens=96, history_turns=3)
    history = [(f"order {i % 10} of 9 : axe x 1", "chop tree") for i in range(20_000)]
    history[-1] = ("need wood 7", "mine rock")
    history[0] = ("need stone 5", "cut stone")
    summary = summarize_milestones(["craft:saw#1", "craft:axe#2", "craft:lamp#3"], last=2)
    ctx = builder.build("ready yes", history, summary)
    assert len(ctx) <= 96 and ctx[0] == TOK.bos_id and ctx[-1] == TOK.act_id
    assert ctx[1] == TOK.sum_id and TOK.unk_id not in ctx
    assert TOK.decode(ctx[2:13]) == "done craft : axe # 2 craft : lamp # 3"
    text = TOK.decode(ctx)
    assert text.endswith("need wood 7 mine rock ready yes") and "stone 5" not in text
    assert ctx.count(TOK.obs_id) == 4  # three turns + the current observation
    assert builder.build("ready yes", history, summary) == ctx  # deterministic
    tail = collections.deque(history[-3:], maxlen=3)  # deques work too
    assert builder.build("ready yes", tail, summary) == ctx
    # Pathological sizes stay bounded; the current observation always survives.
    small = ContextBuilder(TOK, max_tokens=24, history_turns=50)
    ctx = small.build("wood " * 500 + "ready yes", history, "axe " * 500)
    assert len(ctx) <= 24 and TOK.decode(ctx).endswith("ready yes")
    assert TOK.decode(ContextBuilder(TOK, 64, 0).build("ready yes", history)) == "ready yes"


# -- acting and evaluating --------------------------------------------------------------------

CONTEXTS = [s[0] for s in workshop_samples(3, 7, ContextBuilder(TOK, 100, 2))]


def test_act_batch_shapes_eos_and_vocab():
    policy = make_policy()
    params = SamplingParams(max_action_tokens=6)
    actions = policy.act_batch(CONTEXTS, params, seed=1)
    allowed = {TOK.token_id(w) for w in ACTION_WORDS} | {TOK.eos_id}
    assert len(actions) == len(CONTEXTS)
    saw_eos = False
    for a in actions:
        assert 1 <= len(a.tokens) <= 6
        assert len(a.logprobs) == len(a.tokens) == len(a.policy_logprobs)
        assert all(lp <= 0 for lp in a.logprobs) and set(a.tokens) <= allowed
        if TOK.eos_id in a.tokens:
            saw_eos = True
            assert a.tokens.index(TOK.eos_id) == len(a.tokens) - 1  # stops at eos, keeps it
        else:
            assert len(a.tokens) == 6
        assert a.text == TOK.decode(a.tokens)
    assert saw_eos
    assert [a.tokens for a in policy.act_batch(CONTEXTS, params, seed=1)] == \
        [a.tokens for a in actions]  # seeded sampling is reproducible
    with pytest.raises(ValueError, match="max_len"):
        policy.act_batch([[1] * 126], params)
    assert policy.act_batch([], params) == []


def test_logprobs_match_evaluate():
    policy = make_policy(seed=3)
    actions = policy.act_batch(CONTEXTS, SamplingParams(), seed=7)
    out = policy.evaluate(CONTEXTS, [a.tokens for a in actions])
    assert out.logprobs.requires_grad and out.values.shape == (len(CONTEXTS),)
    for i, a in enumerate(actions):
        n = len(a.tokens)
        assert a.logprobs == a.policy_logprobs  # temperature 1: behaviour = policy
        assert torch.allclose(out.logprobs[i, :n], torch.tensor(a.logprobs), atol=1e-5)
        assert out.mask[i].sum() == n and (out.logprobs[i, n:] == 0).all()
        assert (out.entropy[i, :n] > 0).all()
    # Tempered / nucleus sampling: policy_logprobs still match evaluate, behaviour differs.
    tempered = policy.act_batch(CONTEXTS, SamplingParams(temperature=0.5, top_p=0.8), seed=7)
    out = policy.evaluate(CONTEXTS, [a.tokens for a in tempered])
    for i, a in enumerate(tempered):
        n = len(a.tokens)
        assert torch.allclose(out.logprobs[i, :n], torch.tensor(a.policy_logprobs), atol=1e-5)
        assert all(lp <= 0 for lp in a.logprobs)
    assert any(a.logprobs != a.policy_logprobs for a in tempered)  # drawn from another dist
    greedy = policy.act_batch(CONTEXTS, SamplingParams(greedy=True))
    assert all(lp == 0.0 for a in greedy for lp in a.logprobs)


def test_padding_does_not_change_results():
    policy = make_policy(seed=5)
    short = min(CONTEXTS, key=len)
    longest = max(CONTEXTS, key=len)
    assert len(longest) > len(short) + 20
    action = policy.act_batch([short], SamplingParams(max_action_tokens=4), seed=0)[0].tokens
    alone = policy.evaluate([short], [action])
    batched = policy.evaluate([longest, short, longest], [[TOK.eos_id], action, action + action])
    assert torch.allclose(alone.logprobs[0, :len(action)], batched.logprobs[1, :len(action)],
                          atol=1e-5)
    assert torch.allclose(alone.values[0], batched.values[1], atol=1e-5)
    assert torch.allclose(policy.values([short]), policy.values([longest, short])[1:], atol=1e-5)
    g_alone = policy.act_batch([short], SamplingParams(greedy=True, max_action_tokens=4))[0]
    g_batch = policy.act_batch([longest, short], SamplingParams(greedy=True,
                                                                max_action_tokens=4))[1]
    assert g_alone.tokens == g_batch.tokens
    assert all(math.isclose(a, b, abs_tol=1e-5)
               for a, b in zip(g_alone.policy_logprobs, g_batch.policy_logprobs))


def test_value_head_starts_at_the_prior():
    config = ModelConfig(vocab_size=TOK.vocab_size)
    values = TorchPolicy(config, TOK, value_prior=0.25).values(CONTEXTS)
    assert values.shape == (len(CONTEXTS),) and torch.allclose(values, torch.tensor(0.25),
                                                               atol=0.01)


# -- it can learn -----------------------------------------------------------------------------

@pytest.mark.slow
def test_supervised_sanity_learns_the_workshop_rule():
    """200 steps of cross-entropy on oracle actions: the rule is learnable by this model."""
    torch.manual_seed(0)
    builder = ContextBuilder(TOK, max_tokens=48, history_turns=0)
    train = workshop_samples(12, 40, builder)
    test = workshop_samples(4, 40, builder, first_seed=500)  # unseen seeds
    policy = make_policy(seed=0)
    optim = torch.optim.Adam(policy.parameters(), lr=3e-3)
    targets = [TOK.encode(a) + [TOK.eos_id] for _, a in train]
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = torch.randint(len(train), (32,), generator=gen).tolist()
        out = policy.evaluate([train[i][0] for i in batch], [targets[i] for i in batch])
        loss = -(out.logprobs.sum() / out.mask.sum()) - 0.01 * out.entropy.sum() / out.mask.sum()
        loss = loss + 0.1 * (out.values ** 2).mean()
        optim.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)
        optim.step()
    for samples in (train, test):
        acts = policy.act_batch([c for c, _ in samples], SamplingParams(greedy=True))
        accuracy = sum(a.text == t and a.tokens[-1] == TOK.eos_id
                       for a, (_, t) in zip(acts, samples)) / len(samples)
        assert accuracy >= 0.95, f"greedy accuracy {accuracy:.1%} after 200 steps"


# -- the composition root ---------------------------------------------------------------------

def test_policy_package_imports_no_environment():
    """policy/ builds from the words it is handed; only gyre_async.compose meets envs."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "gyre_async" / "policy"
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for module in modules:
                assert not module.startswith("gyre_async.envs"), f"{path.name} imports {module}"
                assert not (isinstance(node, ast.ImportFrom) and node.level and "envs" in module)


def test_compose_builds_from_the_environments_vocabulary():
    from gyre_async.compose import action_token_ids, build_tokenizer
    from schemas.config import Config

    cfg = Config()  # the workshop, tiny backend
    tok = build_tokenizer(cfg)
    assert isinstance(tok, WordTokenizer) and tok.to_json() == TOK.to_json()
    allowed = {tok.decode([i]) for i in action_token_ids(cfg, tok)}
    assert allowed == set(ACTION_WORDS)
    assert action_token_ids(msgspec.structs.replace(
        cfg, policy=msgspec.structs.replace(cfg.policy, constrain_actions=False)), tok) == ()
