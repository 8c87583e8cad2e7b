"""The policy interface the sampler and the learner program against, and checkpoint files.

Log-probabilities, decided once for every backend:

- ``Action.logprobs`` are the **behaviour** log-probs: of each sampled token under the
  distribution it was actually drawn from (after temperature and top-p, renormalised). PPO's
  importance ratio needs exactly these for the "old" policy. Greedy decoding draws from a
  point mass, so its behaviour log-probs are 0.
- ``Action.policy_logprobs`` are the same tokens under the raw policy (temperature 1, no
  top-p): what :meth:`Policy.evaluate` returns for them with the same weights (the tests
  check equality to 1e-5). With temperature 1 and top-p 1 both lists are equal.

Generation stops at ``<eos>`` or after ``max_action_tokens``; an emitted ``<eos>`` is part
of ``Action.tokens`` (and has a log-prob), so the learner also trains the decision to stop.

Checkpoints: one codec, :class:`gyre_async.storage.checkpoints.CheckpointStore`
(content-addressed safetensors, atomic, sha256-checked); policies only say what goes into a
checkpoint's header (:meth:`Policy.checkpoint_metadata`: format, model config, tokenizer)
and whether a header fits them (:meth:`Policy.check_checkpoint`, called by
:meth:`Policy.load_checkpoint`).
:func:`gyre_async.policy.factory.save_weights` and ``load_weights`` join the two.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from gyre_async.storage.errors import CheckpointError


class CheckpointMismatch(CheckpointError):
    """A checkpoint that does not fit this policy: another format, model config or shapes."""


@dataclass(frozen=True)
class SamplingParams:
    """How actions are drawn. ``greedy`` overrides temperature and top-p."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_action_tokens: int = 4
    greedy: bool = False

    def __post_init__(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError("SamplingParams: temperature must be > 0 (or set greedy=True)")
        if not 0 < self.top_p <= 1:
            raise ValueError("SamplingParams: top_p must be in (0, 1]")
        if self.max_action_tokens < 1:
            raise ValueError("SamplingParams: max_action_tokens must be >= 1")


@dataclass(frozen=True)
class Action:
    """One generated action. ``tokens`` include ``<eos>`` when it was emitted."""

    tokens: list[int]
    logprobs: list[float]          # behaviour log-probs (as sampled), see module docstring
    policy_logprobs: list[float]   # raw policy log-probs (temperature 1)
    text: str                      # decoded without special tokens
    policy_version: int = 0


@dataclass
class EvalOutput:
    """Learner-side evaluation of given actions; tensors carry grad.

    ``logprobs`` and ``entropy`` are [B, A] (A = longest action), zero where ``mask`` is 0;
    ``values`` [B] is the value of each context (the state before acting).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


class Policy(abc.ABC):
    """A text policy with a value head. Pure library: no bus, no asyncio.

    ``act_batch`` is called from a worker thread (``asyncio.to_thread``); implementations
    serialise it against weight loading, so a new version never lands mid-batch.
    """

    version: int = 0
    #: context tokens acting computed (prefill), and those it took from a cache instead
    prefill_computed: int = 0
    prefill_reused: int = 0
    #: forward passes acting ran, and the drafted tokens they read and kept (speculative
    #: decoding; both 0 without drafts)
    act_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @abc.abstractmethod
    def act_batch(self, contexts: list[list[int]], params: SamplingParams,
                  seed: int | None = None, sessions: list[str | None] | None = None
                  ) -> list[Action]:
        """Generate one action per context (token ids, e.g. from ContextBuilder).

        ``sessions`` (one per context, or None) names the episode each context belongs to.
        A backend that keeps keys/values between calls reuses a session's cached prefix
        when its new context extends it (segment contexts, ``policy.context = "segment"``);
        the actions are those it would take without the cache."""

    def forget_session(self, session: str) -> None:
        """Drop what is cached for ``session`` (its episode ended). Nothing by default."""
        return None

    @abc.abstractmethod
    def evaluate(self, contexts: list[list[int]], actions: list[list[int]]) -> EvalOutput:
        """Log-probs, entropies and values for given actions, with grad (for PPO)."""

    @abc.abstractmethod
    def values(self, contexts: list[list[int]]) -> torch.Tensor:
        """Values of contexts, [B], without grad (bootstrapping at segment boundaries)."""

    @abc.abstractmethod
    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]: ...

    @abc.abstractmethod
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None: ...

    def close(self) -> None:
        """Free what the policy holds outside Python's memory (nothing, unless a backend
        says otherwise: a vLLM policy's model folders)."""
        return None

    def checkpoint_metadata(self) -> dict[str, str]:
        """Strings stored in the checkpoint header (config, tokenizer, version)."""
        return {"version": str(self.version)}

    def load_checkpoint(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
                        address: str) -> None:
        """Load tensors read from the checkpoint at ``address`` once its header fits this
        policy; any misfit is a :class:`CheckpointMismatch` naming the file."""
        self.check_checkpoint(metadata, address)
        try:
            self.load_state_dict(tensors)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointMismatch(f"checkpoint {address} does not fit this policy: {exc}"
                                     ) from exc

    def check_checkpoint(self, metadata: Mapping[str, str], address: str) -> None:
        """Raise :class:`CheckpointMismatch` unless a checkpoint whose header holds
        ``metadata`` was saved by a policy of this kind. Here: the ``format`` must match
        where both record one; backends with a model config compare it too."""
        mine, theirs = self.checkpoint_metadata().get("format"), metadata.get("format")
        if mine is not None and theirs is not None and mine != theirs:
            raise CheckpointMismatch(f"checkpoint {address} holds a {theirs} policy, this "
                                     f"policy is a {mine}: point it at a checkpoint of the "
                                     "same policy.backend")
