"""A vLLM backend for acting (``act_batch`` only). UNTESTED HERE: vllm cannot be installed on
the CPU-only development machine, so this module is written against vLLM's documented offline
API (``vllm.LLM.generate`` with token prompts, ``SamplingParams(logprobs=0)``, engine option
``logprobs_mode="processed_logprobs"``, available since vLLM 0.10.2, and
``LLM.collective_rpc("reload_weights", kwargs={"weights_path": ...})`` for new versions) and
only imports vllm when constructed. Run it once on a GPU machine before relying on it.

Division of labour: the sampler acts with vLLM; the learner evaluates and trains with
:class:`~gyre_async.policy.hf_policy.HFPolicy` over the same model, and publishes weights in
Hugging Face layout (a directory) that :meth:`VLLMPolicy.load` reloads in place.

Log-probs: the engine runs with ``logprobs_mode="processed_logprobs"``, so the log-prob of each
sampled token is taken from the distribution it was drawn from (after temperature / top-p):
the behaviour log-prob (``Action.logprobs``). vLLM reports one log-prob mode per engine, so
``Action.policy_logprobs`` equal the behaviour ones only at temperature 1 / top-p 1; otherwise
they are left empty and the learner recomputes raw log-probs with ``evaluate``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .base import Action, CheckpointMismatch, EvalOutput, Policy, SamplingParams
from .tokenizer import BaseTokenizer


class VLLMPolicy(Policy):
    """Batched acting with a vLLM engine over a local Hugging Face model directory."""

    def __init__(self, model_path: str, tokenizer: BaseTokenizer, *, seed: int = 0,
                 max_model_len: int = 4096, gpu_memory_utilization: float = 0.5,
                 **engine_kwargs: Any):
        try:
            import vllm
        except ImportError as exc:
            raise ImportError("VLLMPolicy needs vllm (pip install 'gyre[vllm]' on a GPU "
                              "machine); use TorchPolicy on CPU") from exc
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.llm = vllm.LLM(model=model_path, seed=seed, max_model_len=max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization,
                            logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                            **engine_kwargs)

    def act_batch(self, contexts: list[list[int]], params: SamplingParams,
                  seed: int | None = None) -> list[Action]:
        vllm = self._vllm
        sampling = vllm.SamplingParams(
            n=1, temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p, max_tokens=params.max_action_tokens,
            stop_token_ids=[self.tokenizer.eos_id], logprobs=0, seed=seed,
            skip_special_tokens=True)
        prompts = [{"prompt_token_ids": list(c)} for c in contexts]  # a TokensPrompt
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        same = params.greedy or (params.temperature == 1.0 and params.top_p == 1.0)
        actions = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [0.0 if params.greedy else float(step[tok].logprob)
                        for tok, step in zip(tokens, completion.logprobs)]
            actions.append(Action(tokens=tokens, logprobs=logprobs,
                                  policy_logprobs=list(logprobs) if same and not params.greedy
                                  else [], text=self.tokenizer.decode(tokens),
                                  policy_version=self.version))
        return actions

    def load(self, path: str | os.PathLike[str], expected_sha256: str | None = None) -> None:
        """Reload weights in place from a Hugging Face model directory ``path``.

        ``expected_sha256`` is checked against ``model.safetensors`` in that directory.
        """
        path = os.fspath(path)
        if expected_sha256 is not None:
            with open(os.path.join(path, "model.safetensors"), "rb") as f:
                actual = hashlib.sha256(f.read()).hexdigest()
            if actual != expected_sha256.lower():
                raise CheckpointMismatch(f"{path}/model.safetensors has sha256 {actual}, "
                                         f"expected {expected_sha256}; refusing to load")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})

    # The learner side lives in HFPolicy; vLLM serves sampling only.
    def _learner_only(self, *_: Any) -> Any:
        raise NotImplementedError("VLLMPolicy only acts; evaluate/train with HFPolicy")

    def evaluate(self, contexts: list[list[int]], actions: list[list[int]]) -> EvalOutput:
        return self._learner_only()

    def values(self, contexts: list[list[int]]) -> torch.Tensor:
        return self._learner_only()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self._learner_only()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._learner_only()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._learner_only()

    def save(self, path: str | os.PathLike[str]) -> str:
        return self._learner_only()
