"""Policies: tokenizers, bounded contexts, the policy interface and its backends.

Pure library code (no bus, no asyncio): the sampler calls :meth:`Policy.act_batch` from a
worker thread, the learner calls :meth:`Policy.evaluate`. Backends: :class:`TorchPolicy`
(the tiny transformer, default), ``hf_policy.HFPolicy`` (a local Hugging Face causal LM,
needs ``transformers``) and ``vllm_policy.VLLMPolicy`` (acting only, needs ``vllm``).
"""

from gyre_async.policy.base import (
    Action,
    CheckpointMismatch,
    EvalOutput,
    Policy,
    SamplingParams,
)
from gyre_async.policy.context import ContextBuilder, summarize_milestones
from gyre_async.policy.tokenizer import (
    SPECIAL_TOKENS,
    BaseTokenizer,
    ByteTokenizer,
    WordTokenizer,
    tokenizer_for_vocabulary,
    tokenizer_from_json,
)
from gyre_async.policy.torch_policy import CausalLMPolicy, ModelConfig, TinyTransformer, TorchPolicy

__all__ = [
    "Action", "BaseTokenizer", "ByteTokenizer", "CausalLMPolicy", "CheckpointMismatch",
    "ContextBuilder", "EvalOutput", "ModelConfig", "Policy", "SPECIAL_TOKENS", "SamplingParams",
    "TinyTransformer", "TorchPolicy", "WordTokenizer", "summarize_milestones",
    "tokenizer_for_vocabulary", "tokenizer_from_json",
]
