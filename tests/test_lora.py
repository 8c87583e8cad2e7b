"""LoRA adapters through peft on the Hugging Face policy, and export as a model directory.

A small Llama built from config (two layers, 64 wide) with SmolLM2's tokenizer stands in
for the real model, so these run in seconds: the code paths are the ones SmolLM2 takes.
Checked: an update moves only adapter and value-head weights; an adapter checkpoint holds
only those, round-trips exactly and refuses another base model by name; the exported model
directory loads in plain ``transformers`` and gives the policy's log-probs.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from gyre_async.policy.base import CheckpointMismatch  # noqa: E402
from gyre_async.policy.context import ContextBuilder  # noqa: E402
from gyre_async.policy.factory import load_weights, save_weights  # noqa: E402
from gyre_async.policy.hf_policy import VALUE_HEAD, HFPolicy  # noqa: E402
from gyre_async.policy.smollm2 import ensure_converted  # noqa: E402
from gyre_async.storage.checkpoints import CheckpointStore  # noqa: E402
from schemas.config import LoraSection  # noqa: E402

LORA = LoraSection(rank=4, alpha=8.0)


def small_llama(directory, seed: int):
    """A 2-layer Llama from config with SmolLM2's tokenizer, saved as a model directory."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_converted())
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return small_llama(tmp_path_factory.mktemp("base"), seed=0)


def batch(policy: HFPolicy):
    builder = ContextBuilder(policy.tokenizer, 96, 1)
    contexts = [builder.build("You are in the kitchen. A fridge is here."),
                builder.build("The fridge is open. Inside is an apple.")]
    actions = [policy.tokenizer.encode("open fridge") + [policy.tokenizer.eos_id],
               policy.tokenizer.encode("take apple") + [policy.tokenizer.eos_id]]
    return contexts, actions


def train_step(policy: HFPolicy) -> None:
    contexts, actions = batch(policy)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    out = policy.evaluate(contexts, actions)
    loss = -(out.logprobs * out.mask).sum() + (out.values - 1.0).pow(2).sum()
    loss.backward()
    optimizer.step()


def test_lora_update_moves_only_adapters_and_the_value_head(base_dir):
    policy = HFPolicy.from_pretrained(base_dir, seed=1, lora=LORA)
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    trainable = {id(p) for p in policy.parameters()}
    train_step(policy)
    after = policy.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the update changed nothing: the test shows nothing"
    assert all("lora_" in k or k.startswith(VALUE_HEAD) for k in changed), sorted(changed)[:5]
    assert any(k.startswith(VALUE_HEAD) for k in changed)
    assert any("lora_B" in k for k in changed)  # B starts at 0: version 0 is the base model
    n_trainable = sum(p.numel() for p in policy.model.parameters() if id(p) in trainable)
    n_all = sum(p.numel() for p in policy.model.parameters())
    assert n_trainable < 0.05 * n_all, (n_trainable, n_all)


def test_adapter_checkpoints_are_small_round_trip_and_refuse_another_base(base_dir, tmp_path):
    policy = HFPolicy.from_pretrained(base_dir, seed=1, lora=LORA)
    train_step(policy)
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    ref = save_weights(store, policy, 1)
    tensors, meta = store.load(ref.address, ref.sha256)
    assert set(tensors) == set(policy.state_dict())
    assert all("lora_" in k or k.startswith(VALUE_HEAD) for k in tensors)
    assert meta["format"] == "gyre-hf-lora" and meta["base_model"] == policy.base_model
    assert meta["base_model_path"] == base_dir

    fresh = HFPolicy.from_pretrained(base_dir, seed=2, lora=LORA)
    contexts, actions = batch(policy)
    with torch.no_grad():
        assert not torch.equal(fresh.evaluate(contexts, actions).logprobs,
                               policy.evaluate(contexts, actions).logprobs)
        load_weights(fresh, ref.address, ref.sha256)
        assert torch.equal(fresh.evaluate(contexts, actions).logprobs,
                           policy.evaluate(contexts, actions).logprobs)

    other = HFPolicy.from_pretrained(small_llama(tmp_path / "other", seed=5), seed=1, lora=LORA)
    with pytest.raises(CheckpointMismatch, match="base model"):
        load_weights(other, ref.address, ref.sha256)
    full = HFPolicy.from_pretrained(base_dir, seed=1)  # no LoRA: a full-weights policy
    with pytest.raises(CheckpointMismatch):
        load_weights(full, ref.address, ref.sha256)


def test_export_model_merges_the_adapters_and_loads_in_transformers(base_dir, tiny, tmp_path):
    import asyncio

    import msgspec

    from gyre_async.core.keeper_best import BestVersion, best_path
    from gyre_async.offline.export_model import choose_version, export_model

    cfg = tiny.config(policy={"backend": "hf", "model": base_dir, "context_tokens": 96,
                              "lora": {"rank": 4, "alpha": 8.0}})
    run_dir = cfg.run.run_dir
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "wb") as f:
        f.write(msgspec.json.encode(cfg))
    policy = HFPolicy.from_pretrained(base_dir, seed=cfg.run.seed, lora=cfg.policy.lora)
    train_step(policy)
    ref = save_weights(CheckpointStore(os.path.join(run_dir, "checkpoints")), policy, 3)
    best = BestVersion(run_id=cfg.run.run_id, version=3, success_rate=0.5, mean_score=0.5,
                       episodes=32, checkpoint=ref.address, checkpoint_hash=ref.sha256,
                       source_checkpoint=ref.address, source_checkpoint_hash=ref.sha256,
                       chosen_by="keeper")
    with open(best_path(run_dir), "wb") as f:
        f.write(msgspec.json.encode(best))

    chosen = asyncio.run(choose_version(run_dir, "best"))
    assert chosen.version == 3 and "best" in chosen.chosen_by
    out = tmp_path / "exported"
    record = export_model(run_dir, str(out), chosen)
    assert record["lora_merged"] and record["version"] == 3
    assert json.loads((out / "gyre_export.json").read_text())["checkpoint_sha256"] == ref.sha256

    lm = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    # RL from the export (``policy.model`` = the folder) goes on with the run's critic
    again = HFPolicy.from_pretrained(str(out), seed=cfg.run.seed + 1, value_prior=5.0)
    for name in ("weight", "bias"):
        assert torch.equal(getattr(again.model.value_head, name),
                           getattr(policy.model.value_head, name)), name
    base = HFPolicy.from_pretrained(base_dir, seed=cfg.run.seed)
    contexts, actions = batch(policy)
    with torch.no_grad():
        mine = policy.evaluate(contexts, actions)
        # the adapters changed the model: the export must carry them, not the base
        assert not torch.allclose(base.evaluate(contexts, actions).logprobs, mine.logprobs,
                                  atol=1e-3)
        for i, (context, action) in enumerate(zip(contexts, actions)):
            ids = torch.tensor([context + action])
            logits = lm(ids).logits[0, len(context) - 1: -1]
            theirs = torch.log_softmax(logits.float(), -1).gather(
                1, torch.tensor(action)[:, None]).squeeze(1)
            assert torch.allclose(theirs, mine.logprobs[i, :len(action)], atol=1e-4), i

    # what a vLLM engine is given of the export (``--model`` of a vLLM run, the judge's vLLM
    # engine): the LM's tensors, untied, and not the critic beside them, which the engine's
    # loader refuses ("no module or parameter named 'bias'")
    import shutil

    from safetensors import safe_open

    from gyre_async.policy.vllm_policy import serving_copy

    assert (out / "value_head.safetensors").exists()
    served = serving_copy(out)
    try:
        with safe_open(str(served / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "lm_head.weight" in names
        assert all(n.startswith(("model.", "lm_head.")) for n in names), sorted(names)[:5]
        assert not (served / "value_head.safetensors").exists()
    finally:
        shutil.rmtree(served)


def test_kl_to_base_estimator_against_a_slow_reference():
    from gyre_async.core.learner_ppo import kl_to_base

    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=gen) * 3
    base = -torch.rand(3, 5, generator=gen) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    slow = 0.0
    for i in range(3):
        for j in range(5):
            if mask[i, j]:
                r = float(base[i, j] - logp[i, j])
                slow += pow(2.718281828459045, r) - r - 1.0
    assert abs(float(kl_to_base(logp, base, mask)) - slow) < 1e-5
    assert float(kl_to_base(logp, logp, mask)) == 0.0  # the policy is its base: no penalty
    assert float(kl_to_base(logp, base, mask)) > 0.0


def test_the_base_is_the_policy_with_its_adapters_disabled(base_dir, tiny):
    from gyre_async.config import validate
    from gyre_async.errors import ConfigError

    policy = HFPolicy.from_pretrained(base_dir, seed=1, lora=LORA)
    train_step(policy)
    plain = HFPolicy.from_pretrained(base_dir, seed=1)
    contexts, actions = batch(policy)
    with torch.no_grad():
        base = policy.base_logprobs(contexts, actions)
        assert torch.allclose(base, plain.evaluate(contexts, actions).logprobs, atol=1e-6)
        assert not torch.allclose(base, policy.evaluate(contexts, actions).logprobs, atol=1e-3)
    with pytest.raises(ValueError, match="lora"):
        plain.base_logprobs(contexts, actions)
    with pytest.raises(ConfigError, match="kl_to_base"):
        validate(tiny.config(learner={"kl_to_base": 0.1}))


def test_an_adapter_checkpoint_written_as_a_peft_folder_loads_in_peft_and_acts_the_same(
        base_dir, tmp_path):
    """What a vLLM sampler serves per version (``write_adapter_folder``) is an ordinary peft
    adapter: ``PeftModel.from_pretrained`` on the base gives the policy's log-probs; and the
    base fingerprint read from the model directory (no model built) is the policy's."""
    import peft

    from gyre_async.policy.lora import base_fingerprint_of_dir, write_adapter_folder

    policy = HFPolicy.from_pretrained(base_dir, seed=1, lora=LORA)
    train_step(policy)
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    ref = save_weights(store, policy, 1)
    tensors, meta = store.load(ref.address, ref.sha256)
    adapter = {k: v for k, v in tensors.items() if not k.startswith(VALUE_HEAD)}
    folder = write_adapter_folder(tmp_path / "adapter", adapter, meta)
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == LORA.rank

    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_dir), str(folder)).eval()
    contexts, actions = batch(policy)
    with torch.no_grad():
        ours = policy.evaluate(contexts, actions)
        for i, (context, action) in enumerate(zip(contexts, actions)):
            logits = model(torch.tensor([context + action])).logits[0].float()
            logp = torch.log_softmax(logits[len(context) - 1:-1], -1)
            theirs = logp.gather(1, torch.tensor(action)[:, None]).squeeze(1)
            torch.testing.assert_close(theirs, ours.logprobs[i, :len(action)],
                                       atol=1e-4, rtol=0)
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        context, action = contexts[0], actions[0]
        base_logits = base(torch.tensor([context + action])).logits[0, len(context) - 1:-1]
        assert not torch.allclose(torch.log_softmax(base_logits.float(), -1)
                                  .gather(1, torch.tensor(action)[:, None]).squeeze(1),
                                  ours.logprobs[0, :len(action)], atol=1e-4)

    assert base_fingerprint_of_dir(base_dir) == policy.base_model
    other = small_llama(tmp_path / "other", seed=5)
    assert base_fingerprint_of_dir(other) != policy.base_model


def test_merge_adapter_matches_peft_merge_and_unload(base_dir):
    """The vLLM policy's merged serving (``policy.vllm_lora = "merged"``) folds a checkpoint's
    adapter into the base weights itself; peft's ``merge_and_unload`` is the reference."""
    from gyre_async.policy.lora import merge_adapter

    policy = HFPolicy.from_pretrained(base_dir, seed=0, lora=LORA)
    train_step(policy)  # lora_B starts at zero: one step makes every delta non-zero
    adapter = {k: v for k, v in policy.state_dict().items() if not k.startswith(VALUE_HEAD)}
    base = {k: v.clone() for k, v in transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, local_files_only=True).state_dict().items()}
    merged = merge_adapter(base, adapter, LORA.alpha / LORA.rank)
    reference = policy.merged_lm().state_dict()
    changed = [k for k in base if not torch.equal(merged[k], base[k])]
    assert len(changed) == 2 * len(LORA.target_modules)  # 2 layers x q/k/v/o
    for name in base:
        assert torch.allclose(merged[name], reference[name], atol=1e-6), name
    with pytest.raises(CheckpointMismatch, match="no base weight"):
        merge_adapter({k: v for k, v in base.items() if "q_proj" not in k}, adapter, 2.0)
