"""Building the run's policy from config, and moving its weights through checkpoints.

One place decides the tokenizer, the model shape and the action vocabulary, so every role
(sampler, learner, evaluator) builds byte-identical policies and any checkpoint fits all.

``policy.backend`` picks the model: ``tiny`` (default) the small transformer built here;
``hf`` a pretrained causal LM from ``policy.model`` (``smollm2``: converted once into the
cache), trained by torch; ``vllm`` the same weights, but the sampler acts with a vLLM engine
(:func:`build_acting_policy`) that reloads every published checkpoint.
"""

from __future__ import annotations

from schemas.config import Config

from gyre_async.storage.checkpoints import VERSION_KEY, CheckpointStore
from gyre_async.policy.base import Policy
from gyre_async.policy.tokenizer import BaseTokenizer, tokenizer_for_env
from gyre_async.policy.torch_policy import ModelConfig, TorchPolicy


def model_path(cfg: Config) -> str:
    """The local model directory of the ``hf``/``vllm`` backends (converting SmolLM2 once)."""
    if cfg.policy.model == "smollm2":
        from gyre_async.policy.smollm2 import ensure_converted

        return str(ensure_converted())
    return cfg.policy.model


def build_tokenizer(cfg: Config) -> BaseTokenizer:
    if cfg.policy.backend == "tiny":
        from gyre_async.envs.macros import macro_words

        return tokenizer_for_env(cfg.task.env, macro_words(cfg.macros),
                                 cfg.task.env_config)
    from gyre_async.policy.hf_policy import HFTokenizer

    return HFTokenizer.from_pretrained(model_path(cfg))


def action_token_ids(cfg: Config, tokenizer: BaseTokenizer) -> tuple[int, ...]:
    """Token ids the policy may generate (empty: any token)."""
    from gyre_async.envs import game_vocabulary, is_text_game
    from gyre_async.envs.macros import macro_words

    if not cfg.policy.constrain_actions or cfg.policy.backend != "tiny":
        return ()  # subword vocabularies: any token may be used
    if is_text_game(cfg.task.env):  # words seen in the game's valid and gold actions
        words = [*game_vocabulary(cfg.task.env, cfg.task.env_config).action_words]
    elif cfg.task.env == "workshop":
        from gyre_async.envs.workshop import ACTION_WORDS

        words = list(ACTION_WORDS)
    else:
        return ()
    words += macro_words(cfg.macros)  # macro names are actions too
    return tuple(sorted({i for w in words for i in tokenizer.encode(w)} - {tokenizer.unk_id}))


def build_policy(cfg: Config, tokenizer: BaseTokenizer | None = None) -> Policy:
    """The trainable policy (learner, evaluator; the sampler too unless backend is vllm)."""
    tokenizer = tokenizer or build_tokenizer(cfg)
    P = cfg.policy
    if P.backend != "tiny":
        from gyre_async.policy.hf_policy import HFPolicy

        return HFPolicy.from_pretrained(model_path(cfg), tokenizer=tokenizer, seed=cfg.run.seed)
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, d_model=P.d_model, n_layers=P.n_layers,
        n_heads=P.n_heads, max_len=P.context_tokens + P.max_action_tokens + 1,
        action_token_ids=action_token_ids(cfg, tokenizer),
    )
    return TorchPolicy(config, tokenizer, seed=cfg.run.seed)


def build_acting_policy(cfg: Config, tokenizer: BaseTokenizer | None = None) -> Policy:
    """The policy the sampler acts with: a vLLM engine for ``backend = "vllm"``, else the
    same policy as :func:`build_policy`."""
    if cfg.policy.backend != "vllm":
        return build_policy(cfg, tokenizer)
    if cfg.sampler.exploration.param_noise_target_kl > 0:
        raise ValueError("sampler.exploration.param_noise_target_kl perturbs the sampler's torch "
                         "weights, which a vLLM engine does not expose: set it to 0 or use "
                         "policy.backend = 'hf'")
    from gyre_async.policy.vllm_policy import VLLMPolicy

    P = cfg.policy
    return VLLMPolicy(model_path(cfg), tokenizer or build_tokenizer(cfg), seed=cfg.run.seed,
                      max_model_len=P.context_tokens + P.max_action_tokens + 1)


def save_weights(store: CheckpointStore, policy: Policy, version: int,
                 extra: dict[str, str] | None = None):
    """Write the policy's weights as version ``version``; returns the CheckpointRef.

    The header records what :meth:`Policy.checkpoint_metadata` says (format, model config,
    tokenizer), so :func:`load_weights` can refuse a checkpoint of another model."""
    meta = {k: v for k, v in policy.checkpoint_metadata().items() if k != "version"}
    meta.update(extra or {})
    meta.pop(VERSION_KEY, None)
    tensors = {k: v.detach().contiguous() for k, v in policy.state_dict().items()}
    return store.save(version, tensors, meta)


def load_weights(policy: Policy, address: str, sha256: str) -> None:
    """Load a published checkpoint into ``policy``: hash verified, then its header checked
    against the policy (CheckpointMismatch names both model configs), then the tensors."""
    directory = address.rsplit("/", 1)[0]
    tensors, meta = CheckpointStore(directory).load(address, sha256)
    policy.load_checkpoint(tensors, meta, address)
