"""The composition root: tokenizer, policy and acting policy of a run, built from its config.

The one place where environments meet policies. An environment owns its vocabulary
(:func:`gyre_async.envs.env_vocabulary`: the words its text uses and the words its actions
are made of, macro names added here); the policy package builds from words it is handed
(:mod:`gyre_async.policy.factory`) and never imports environments. Every role calls these
functions with the same config, so sampler, learner and evaluator build byte-identical
tokenizers and policies, and any checkpoint fits all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gyre_async.envs import EnvVocabulary, env_vocabulary
from gyre_async.envs.macros import macro_words
from gyre_async.policy.base import Policy
from gyre_async.policy.context import ContextBuilder
from gyre_async.policy.factory import (
    allowed_action_ids,
    load_weights,
    make_acting_policy,
    make_policy,
    make_tokenizer,
    model_path,
    save_weights,
)
from gyre_async.policy.tokenizer import BaseTokenizer, tokenizer_for_vocabulary
from schemas.config import Config

__all__ = ["action_token_ids", "build_acting_policy", "build_policy", "build_tokenizer",
           "load_weights", "model_path", "run_vocabulary", "save_weights", "tokenizer_for_env"]


def run_vocabulary(cfg: Config) -> EnvVocabulary:
    """The run's vocabulary: the environment's own, plus the macro names (also actions).

    Only the ``tiny`` backend reads it (pretrained models bring their own tokenizer), so
    the others never pay for building it (a text game plays episodes to collect it).
    """
    if cfg.policy.backend != "tiny":
        return EnvVocabulary()
    return env_vocabulary(cfg.task.env, cfg.task.env_config).plus_actions(macro_words(cfg.macros))


def build_tokenizer(cfg: Config) -> BaseTokenizer:
    """The run's tokenizer: words from the environment (``tiny``), or the model's own."""
    return make_tokenizer(cfg, run_vocabulary(cfg).words)


def build_context_builder(cfg: Config, tokenizer: BaseTokenizer) -> ContextBuilder:
    """The run's context builder (window or segment contexts, ``[policy]``): the one the
    sampler acts with, so warm-start, validation and held-out judges read what it reads."""
    return ContextBuilder(tokenizer, cfg.policy.context_tokens, cfg.policy.history_turns,
                          mode=cfg.policy.context, hint=cfg.policy.segment_hint)


def action_token_ids(cfg: Config, tokenizer: BaseTokenizer) -> tuple[int, ...]:
    """Token ids the policy may generate (empty: any token)."""
    return allowed_action_ids(cfg, tokenizer, run_vocabulary(cfg).action_words)


def build_policy(cfg: Config, tokenizer: BaseTokenizer | None = None) -> Policy:
    """The trainable policy (learner, evaluator; the sampler too unless backend is vllm)."""
    vocabulary = run_vocabulary(cfg)
    tokenizer = tokenizer or make_tokenizer(cfg, vocabulary.words)
    return make_policy(cfg, tokenizer, vocabulary.action_words)


def build_acting_policy(cfg: Config, tokenizer: BaseTokenizer | None = None) -> Policy:
    """The policy the sampler acts with: a vLLM engine for ``backend = "vllm"``, else the
    same policy as :func:`build_policy`."""
    vocabulary = run_vocabulary(cfg)
    tokenizer = tokenizer or make_tokenizer(cfg, vocabulary.words)
    return make_acting_policy(cfg, tokenizer, vocabulary.action_words)


def tokenizer_for_env(env_name: str, extra_words: Sequence[str] = (),
                      env_config: Mapping[str, Any] | None = None) -> BaseTokenizer:
    """The word tokenizer of ``env_name`` (its vocabulary, then ``extra_words``), or the
    byte tokenizer when the environment cannot list its words."""
    words = env_vocabulary(env_name, env_config).plus_actions(extra_words).words
    return tokenizer_for_vocabulary(words)
