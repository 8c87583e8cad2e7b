"""Building a policy from the policy config and a vocabulary, and moving its weights.

Nothing here knows environments: the words a tokenizer needs and the words actions are made
of come in as arguments. The composition root (:mod:`gyre_async.compose`) asks the
environment for them and calls these builders, so every role (sampler, learner, evaluator)
builds byte-identical policies from one config and any checkpoint fits all.

``policy.backend`` picks the model: ``tiny`` (default) the small transformer built here;
``hf`` a pretrained causal LM from ``policy.model`` (``smollm2``: converted once into the
cache), trained by torch; ``vllm`` the same weights, but the sampler acts with a vLLM engine
(:func:`make_acting_policy`) that reloads every published checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre_async.policy.base import Policy
from gyre_async.policy.tokenizer import BaseTokenizer, tokenizer_for_vocabulary
from gyre_async.policy.torch_policy import ModelConfig, TorchPolicy
from gyre_async.storage.checkpoints import VERSION_KEY, CheckpointStore, load_checkpoint
from schemas.config import Config


def model_path(cfg: Config) -> str:
    """The local model directory of the ``hf``/``vllm`` backends (converting SmolLM2 once)."""
    if cfg.policy.model == "smollm2":
        from gyre_async.policy.smollm2 import ensure_converted

        return str(ensure_converted())
    return cfg.policy.model


def make_tokenizer(cfg: Config, words: Sequence[str]) -> BaseTokenizer:
    """``tiny``: a word tokenizer over ``words`` (bytes when there are none); ``hf`` /
    ``vllm``: the pretrained model's own tokenizer (``words`` are not needed)."""
    if cfg.policy.backend == "tiny":
        return tokenizer_for_vocabulary(words)
    from gyre_async.policy.hf_policy import HFTokenizer

    return HFTokenizer.from_pretrained(model_path(cfg))


def allowed_action_ids(cfg: Config, tokenizer: BaseTokenizer,
                       action_words: Sequence[str]) -> tuple[int, ...]:
    """Token ids the policy may generate (empty: any token).

    Only the ``tiny`` backend with ``policy.constrain_actions`` is constrained, to the
    tokens of ``action_words``; subword vocabularies may use any token.
    """
    if not cfg.policy.constrain_actions or cfg.policy.backend != "tiny" or not action_words:
        return ()
    return tuple(sorted({i for w in action_words for i in tokenizer.encode(w)}
                        - {tokenizer.unk_id}))


def make_policy(cfg: Config, tokenizer: BaseTokenizer,
                action_words: Sequence[str] = ()) -> Policy:
    """The trainable policy (learner, evaluator; the sampler too unless backend is vllm), on
    ``policy.device`` with weights in ``policy.dtype``."""
    import torch

    dtype = getattr(torch, cfg.policy.dtype)
    if cfg.policy.backend != "tiny":
        from gyre_async.policy.hf_policy import HFPolicy

        hf = HFPolicy.from_pretrained(model_path(cfg), tokenizer=tokenizer, seed=cfg.run.seed,
                                      lora=cfg.policy.lora, dtype=dtype).to(cfg.policy.device)
        hf.draft_tokens = cfg.policy.draft_tokens
        return hf
    shape = cfg.policy
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, d_model=shape.d_model, n_layers=shape.n_layers,
        n_heads=shape.n_heads, max_len=shape.context_tokens + shape.max_action_tokens + 1,
        action_token_ids=allowed_action_ids(cfg, tokenizer, action_words),
    )
    policy = TorchPolicy(config, tokenizer, seed=cfg.run.seed)
    policy.draft_tokens = cfg.policy.draft_tokens
    if cfg.policy.device != "cpu" or cfg.policy.dtype != "float32":
        policy.to(cfg.policy.device, dtype)
    return policy


def make_acting_policy(cfg: Config, tokenizer: BaseTokenizer,
                       action_words: Sequence[str] = ()) -> Policy:
    """The policy the sampler acts with: a vLLM engine for ``backend = "vllm"``, else the
    same policy as :func:`make_policy`."""
    if cfg.policy.backend != "vllm":
        return make_policy(cfg, tokenizer, action_words)
    if cfg.sampler.exploration.param_noise_target_kl > 0:
        raise ValueError("sampler.exploration.param_noise_target_kl perturbs the sampler's torch "
                         "weights, which a vLLM engine does not expose: set it to 0 or use "
                         "policy.backend = 'hf'")
    if cfg.policy.draft_tokens:
        raise ValueError("policy.draft_tokens drafts in Gyre's own acting loop (the tiny and hf "
                         "backends); a vLLM engine decodes by itself: set it to 0 with "
                         "policy.backend = 'vllm'")
    from gyre_async.policy.vllm_policy import VLLMPolicy

    shape = cfg.policy
    return VLLMPolicy(model_path(cfg), tokenizer, seed=cfg.run.seed,
                      max_model_len=shape.context_tokens + shape.max_action_tokens + 1,
                      lora=shape.lora, lora_serving=shape.vllm_lora)


def save_weights(store: CheckpointStore, policy: Policy, version: int,
                 extra: dict[str, str] | None = None):
    """Write the policy's weights as version ``version``; returns the CheckpointRef.

    The header records what :meth:`Policy.checkpoint_metadata` says (format, model config,
    tokenizer), so :func:`load_weights` can refuse a checkpoint of another model."""
    meta = {k: v for k, v in policy.checkpoint_metadata().items() if k != "version"}
    meta.update(extra or {})
    meta.pop(VERSION_KEY, None)
    tensors = {k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}
    return store.save(version, tensors, meta)


def load_weights(policy: Policy, address: str, sha256: str) -> None:
    """Load a checkpoint into ``policy``: hash verified and weights finite, then its header
    checked against the policy (CheckpointMismatch names both model configs), then the
    tensors. ``address`` comes from the caller's own store or was resolved inside the run's
    roots (:class:`~gyre_async.storage.roots.StorageRoots`): this function trusts it."""
    tensors, meta = load_checkpoint(address, sha256)
    policy.load_checkpoint(tensors, meta, address)
