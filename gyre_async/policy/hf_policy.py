"""A local Hugging Face causal LM (e.g. SmolLM2-135M) as a trainable Gyre policy.

It reuses :class:`~gyre_async.policy.torch_policy.CausalLMPolicy`, so batching (left padding,
positions counting real tokens only), sampling, log-prob conventions and the PPO-side
``evaluate`` are exactly those of the tiny transformer. A fresh value head (conservatively
initialised: values start at ``value_prior``) reads the last context token's final hidden
state. Nothing is ever downloaded: ``from_pretrained`` only reads a local directory.

Token ids are the model's own from end to end: :class:`HFTokenizer` builds contexts, the
sampler records those ids (``TrajectoryStep.context_tokens`` / ``action_tokens``), the
segment store keeps them as int32, and the learner re-evaluates exactly them.

Context markers: a pretrained vocabulary has no ``<obs>``/``<act>`` tokens, so markers are
text. For chat models in the ChatML format (SmolLM2-Instruct) a context reads as a chat::

    <|im_start|>system\\n{system prompt}[\\nProgress: summary]<|im_end|>\\n
    <|im_start|>user\\n{example}<|im_end|>\\n<|im_start|>assistant\\n{its command}<|im_end|>\\n
    <|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n{action}<|im_end|>\\n
    <|im_start|>user\\n ... <|im_start|>assistant\\n      <- the policy generates here

and the model's end-of-turn token (``<|im_end|>``) ends an action, as it was trained to.
Other tokenizers get plain ``Observation:`` / ``Action:`` lines.

Checkpoints hold the language model's tensors under their Hugging Face names (tied copies
left out) plus ``value_head.weight`` / ``value_head.bias``; without the value head they are
a model directory's ``model.safetensors``, which is how the vLLM backend serves them. With
``[policy.lora]`` (:mod:`gyre_async.policy.lora`) the base stays frozen, only adapters and
value head train, and checkpoints hold only those, naming the base they apply to.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gyre_async.policy.lora import (
    adapter_state,
    apply_lora,
    base_fingerprint,
    check_adapter_base,
    load_adapter_state,
    lora_metadata,
)
from gyre_async.policy.tokenizer import BaseTokenizer
from gyre_async.policy.torch_policy import CausalLMPolicy
from schemas.config import LoraSection
from schemas.hint import present_hint, split_hint, split_hint_changes

if TYPE_CHECKING:  # transformers is imported lazily (see _need_transformers)
    from transformers import PreTrainedModel

SYSTEM_PROMPT = ("You are playing a text adventure game. Reply with one command only, "
                 "such as one of the valid actions.")
VALID_ACTIONS_HEADING = "\n\nValid actions:\n"
VALID_ACTIONS_SEPARATOR = "\n"


def chat_observation(observation: str) -> str:
    """A hinted observation as a chat model reads it best: the game's text, then the valid
    commands one per line right before the answer (a 135M model copies a command from
    there, and otherwise answers in prose; with " | " between them it copied several)."""
    changes = split_hint_changes(observation)
    if changes is not None:  # a segment context's later step: the list as it changed
        added, removed, text = changes
        out = text + "\n\nValid actions: as before"
        if removed:  # on one line: not a list a small model would copy a command from
            out += ", but no longer: " + ", ".join(removed)
        if added:
            out += "\nNow also valid:\n" + VALID_ACTIONS_SEPARATOR.join(added)
        return out
    valid, text = split_hint(observation)
    if not valid:
        return observation
    return text + VALID_ACTIONS_HEADING + VALID_ACTIONS_SEPARATOR.join(valid)


# One worked exchange after the system prompt, in the format every turn must keep: without it
# SmolLM2-135M-Instruct answers "You choose to take the apple." (measured: docs/llm.md).
EXAMPLE_TURN = ("<|im_end|>\n<|im_start|>user\n" + chat_observation(present_hint(
    ["go north", "inventory", "look", "take shovel"],
    "-= Garden =- You are in a garden. There is a shovel here. Exits: north."))
    + "<|im_end|>\n<|im_start|>assistant\ntake shovel")
CHATML_MARKERS = {
    "bos": "<|im_start|>system\n" + SYSTEM_PROMPT,
    "task": "\nTask: ",
    "sum": "\nProgress: ",
    "shot": EXAMPLE_TURN,
    "obs": "<|im_end|>\n<|im_start|>user\n",
    "act": "<|im_end|>\n<|im_start|>assistant\n",
    "sep": "\n",
}
PLAIN_MARKERS = {"obs": "\nObservation: ", "act": "\nAction: ", "sum": "Progress: ",
                 "task": "Task: ", "sep": "\n"}
VALUE_HEAD = "value_head."
#: The critic's file beside an exported model (``gyre export-model``): not part of the LM, so
#: whatever loads the folder as a Hugging Face model (a vLLM engine) leaves it out.
EXPORTED_VALUE_HEAD = "value_head.safetensors"


def _need_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("the 'hf' policy backend needs transformers: pip install "
                          "'gyre[llm]' (the tiny backend needs nothing extra)") from exc
    return transformers


@functools.cache
def _cache_argument(forward: Callable[..., Any]) -> str:
    """The name a decoder's ``forward`` takes its key/value cache by, which is also the name
    of its output's field: ``cache`` in recent transformers 5 releases (5.25 here, where
    ``past_key_values`` warns and is to go in 5.40), ``past_key_values`` in earlier ones."""
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class HFTokenizer(BaseTokenizer):
    """Adapter from a ``transformers`` tokenizer to Gyre's tokenizer interface."""

    def __init__(self, hf_tokenizer: Any, path: str = ""):
        self.hf = hf_tokenizer
        self.path = path
        self.vocab_size = len(hf_tokenizer)
        vocab = hf_tokenizer.get_vocab()
        self.chat = "<|im_start|>" in vocab and "<|im_end|>" in vocab
        if self.chat:
            self.eos_id = vocab["<|im_end|>"]
        elif hf_tokenizer.eos_token_id is not None:
            self.eos_id = hf_tokenizer.eos_token_id
        else:
            raise ValueError(f"tokenizer at {path!r} has no end-of-sequence token; a policy "
                             "needs one to end its actions")
        self.pad_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None \
            else self.eos_id
        self.bos_id = hf_tokenizer.bos_token_id if hf_tokenizer.bos_token_id is not None \
            else self.eos_id
        self.unk_id = hf_tokenizer.unk_token_id if hf_tokenizer.unk_token_id is not None \
            else self.pad_id
        self.special_ids = frozenset(hf_tokenizer.all_special_ids)
        self.markers = CHATML_MARKERS if self.chat else PLAIN_MARKERS

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        path = os.fspath(path)
        hf = _need_transformers().AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(hf, path)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def marker(self, name: str) -> list[int]:
        if name == "bos" and "bos" not in self.markers:
            return [self.bos_id]
        if name == "shot" and name not in self.markers:
            return []
        return self.encode(self.markers[name])

    def format_observation(self, observation: str) -> str:
        return chat_observation(observation) if self.chat else observation

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        """A chat model's command ends at its end-of-turn token or at a line break (the
        valid commands are listed one per line, and a small model goes on to copy the next
        line; the break ends the command, as the game reads one line)."""
        if not self.chat:
            return frozenset({self.eos_id})
        return frozenset({self.eos_id} | {
            i for token, i in self.hf.get_vocab().items()
            if i not in self.special_ids and "\n" in self.hf.convert_tokens_to_string([token])})

    def to_json(self) -> str:
        return json.dumps({"kind": "hf", "path": self.path})


class _LMWithValue(nn.Module):
    def __init__(self, lm: PreTrainedModel, value_prior: float):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=next(lm.parameters()).dtype)
        # The final norm's output has norm ~sqrt(hidden): these weights move values ~1e-3.
        nn.init.normal_(self.value_head.weight, std=1e-3 / hidden ** 0.5)
        nn.init.constant_(self.value_head.bias, value_prior)


def tied_weight_names(lm: nn.Module) -> set[str]:
    """State-dict names that are copies of another tensor (e.g. ``lm_head.weight``)."""
    tied = getattr(lm, "all_tied_weights_keys", None) or getattr(lm, "_tied_weights_keys", None)
    if isinstance(tied, Mapping):
        names = set(tied)
    else:
        names = set(tied or ())
    if getattr(lm.config, "tie_word_embeddings", False):
        names.add("lm_head.weight")
    state = lm.state_dict(keep_vars=True)
    return {n for n in names if n in state}


class HFPolicy(CausalLMPolicy):
    """A Hugging Face causal LM with a value head, behind the :class:`Policy` interface."""

    #: acting appends keys/values into preallocated room (:func:`_roomy_layer`); False:
    #: transformers' own ``DynamicLayer`` (what ``ops/bench/act_sessions.py`` compares with)
    roomy_cache = True

    def __init__(self, lm: PreTrainedModel, tokenizer: BaseTokenizer, *,
                 value_prior: float = 0.0, action_token_ids: Sequence[int] = (), seed: int = 0,
                 lora: LoraSection | None = None, model_path: str = ""):
        config = lm.config
        max_len = int(getattr(config, "max_position_embeddings", 4096))
        super().__init__(tokenizer, config.vocab_size, max_len, action_token_ids, seed)
        self._tied = tied_weight_names(lm)
        self.model_path = model_path
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self.base_model = base_fingerprint(lm) if self.lora is not None else ""
        with torch.random.fork_rng(devices=[]):  # every role builds identical adapters/head
            torch.manual_seed(seed)
            model: Any = apply_lora(lm, self.lora) if self.lora is not None else lm
            self._model = _LMWithValue(model, value_prior)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, tokenizer: BaseTokenizer | None = None,
                        dtype: torch.dtype = torch.float32, **kwargs: Any) -> HFPolicy:
        """Load ``path`` (a local model directory) with ``transformers``; never downloads. A
        directory that ``gyre export-model`` wrote holds the run's critic beside the model
        (:data:`EXPORTED_VALUE_HEAD`): it becomes the value head (``value_prior`` unused)."""
        transformers = _need_transformers()
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"HFPolicy.from_pretrained: {path} is not a local model "
                                    "directory (nothing is downloaded at run time; for SmolLM2 "
                                    "run `python -m gyre_async.policy.smollm2` once)")
        lm = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                               dtype=dtype)
        lm.eval()  # no dropout: acting and evaluate must see the same function
        policy = cls(lm, tokenizer or HFTokenizer.from_pretrained(path), model_path=path,
                     **kwargs)
        critic = os.path.join(path, EXPORTED_VALUE_HEAD)
        if os.path.isfile(critic):  # a model exported by ``gyre export-model``: RL goes on
            from safetensors.torch import load_file  # with the critic it had

            policy._model.value_head.load_state_dict(load_file(critic), strict=True)
        return policy

    @property
    def model(self) -> nn.Module:
        return self._model

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: Any = None
                 ) -> tuple[torch.Tensor, Any]:
        # The decoder alone (final norm included): the LM head runs only where logits are
        # needed, not over a whole context times a 49k vocabulary.
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)[:, mask.shape[1] - ids.shape[1]:]
        use_cache = cache is not None or torch.is_inference_mode_enabled()
        decoder = self._model.lm.get_decoder()
        name = _cache_argument(type(decoder).forward)
        out = decoder(input_ids=ids, attention_mask=mask.long(), position_ids=positions,
                      use_cache=use_cache, **{name: cache})
        return out.last_hidden_state, getattr(out, name)

    def _forward_right_padded(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """No attention mask at all, only the causal one (the padding is after every real
        token): with an explicit mask, torch's CPU flash attention computes every block of
        the square, with ``is_causal`` only the lower triangle. A padded pair of 1,024-token
        rows went from ~90 to ~140 tokens/s through forward and backward on SmolLM2 here,
        and the learner reads whole segments of up to 2,048 tokens (ops/bench/learner_update.py)."""
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        out = self._model.lm.get_decoder()(input_ids=ids, attention_mask=None,
                                           position_ids=positions, use_cache=False)
        return out.last_hidden_state

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._model.lm.get_output_embeddings()(h)

    def _cache_layers(self, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _as_cache(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> Any:
        """A ``DynamicCache`` whose layers append in place into ``buffers``' spare columns
        (:func:`_roomy_layer`): transformers' own layer copies the whole cache for every
        generated token, and its constructor copies what it is given once more."""
        from transformers.cache_utils import DynamicCache

        if not self.roomy_cache:
            return DynamicCache(ddp_cache_data=[(k[:, :, :length], v[:, :, :length])
                                                for k, v in buffers],
                                config=self._model.lm.config)
        layer = _roomy_layer()
        return self._cache_of([layer.holding(k, v, length) for k, v in buffers])

    def _empty_cache(self, room: int) -> Any:
        if not self.roomy_cache:
            return None  # the model makes its own
        layer = _roomy_layer()
        layers = self._model.lm.config.get_text_config(decoder=True).num_hidden_layers
        return self._cache_of([layer(room) for _ in range(layers)])

    def _cache_of(self, layers: list[Any]) -> Any:
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self._model.lm.config)
        cache.layers = layers
        return cache

    def _value(self, h_last: torch.Tensor) -> torch.Tensor:
        return self._model.value_head(h_last).squeeze(-1)

    def parameters(self):
        """What trains: every weight, or with LoRA the adapters and the value head."""
        return (p for p in self._model.parameters() if p.requires_grad)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """LM tensors under their Hugging Face names (tied copies left out) + value head;
        with LoRA the adapter tensors (peft's names) + value head."""
        if self.lora is not None:
            out = adapter_state(self._model.lm)
        else:
            out = {k: v for k, v in self._model.lm.state_dict().items() if k not in self._tied}
        out.update({VALUE_HEAD + k: v for k, v in self._model.value_head.state_dict().items()})
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        lm_part = {k: v for k, v in state_dict.items() if not k.startswith(VALUE_HEAD)}
        head = {k[len(VALUE_HEAD):]: v for k, v in state_dict.items() if k.startswith(VALUE_HEAD)}
        with self._lock:
            self.forget_sessions()  # keys/values of the old weights
            if self.lora is not None:
                load_adapter_state(self._model.lm, lm_part)
                self._model.value_head.load_state_dict(head, strict=True)
                return
            result = self._model.lm.load_state_dict(lm_part, strict=False)
            missing = set(result.missing_keys) - self._tied
            if missing or result.unexpected_keys:
                raise RuntimeError(f"weights do not fit this model: missing {sorted(missing)[:5]}"
                                   f", unexpected {sorted(result.unexpected_keys)[:5]}")
            self._model.value_head.load_state_dict(head, strict=True)

    def checkpoint_metadata(self) -> dict[str, str]:
        meta = {"format": "gyre-hf-policy", "version": str(self.version),
                "tokenizer": self.tokenizer.to_json()}
        if self.lora is not None:
            meta.update(lora_metadata(self.lora, self.base_model, self.model_path))
        return meta

    def check_checkpoint(self, metadata: Mapping[str, str], address: str) -> None:
        """Besides the format: an adapter loads only on the base it was trained on."""
        if self.lora is not None:
            check_adapter_base(metadata, address, self.base_model, self.model_path)
        super().check_checkpoint(metadata, address)

    def base_logprobs(self, contexts: list[list[int]], actions: list[list[int]]
                      ) -> torch.Tensor:
        """Log-probs [B, A] of ``actions`` under the base model: this policy with its LoRA
        adapters disabled (peft's ``disable_adapter``), without grad."""
        with self.adapters_off():
            return self.evaluate(contexts, actions).logprobs

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """While inside: this policy is its base model (LoRA adapters disabled, peft's
        ``disable_adapter``), without grad; any evaluation (``evaluate``,
        ``evaluate_sequences``) gives the base's log-probs."""
        if self.lora is None:
            raise ValueError("base_logprobs needs [policy.lora]: without adapters the base "
                             "model is not in memory")
        lm: Any = self._model.lm
        with lm.disable_adapter(), torch.no_grad():
            yield

    def merged_lm(self) -> nn.Module:
        """The language model alone, adapters folded into the base weights (for export;
        the policy itself is left unusable for training afterwards with LoRA)."""
        lm: Any = self._model.lm
        return lm.merge_and_unload() if self.lora is not None else lm


@functools.cache
def _roomy_layer() -> Any:
    """transformers' ``DynamicLayer`` that appends into spare columns of a buffer instead of
    concatenating (which copies the whole cache: per layer, for every generated token).
    ``keys``/``values`` are views of the buffer's first columns, so everything that reads
    the layer sees what a ``DynamicLayer`` would hold; a full buffer grows by copying once,
    with ``room`` spare columns again. Built on first use: transformers is optional."""
    from transformers.cache_utils import DynamicLayer

    class RoomyLayer(DynamicLayer):
        def __init__(self, room: int = 0):
            super().__init__()
            self.room = room
            self._keys: torch.Tensor | None = None
            self._values: torch.Tensor | None = None

        @classmethod
        def holding(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> RoomyLayer:
            """A layer holding ``keys``/``values``' first ``length`` columns, the rest room."""
            layer = cls()
            layer.lazy_initialization(keys, values)
            layer._keys, layer._values = keys, values
            layer.keys, layer.values = keys[:, :, :length], values[:, :, :length]
            return layer

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            old_keys, old_values = self.keys, self.values
            assert old_keys is not None and old_values is not None  # initialized above
            held = old_keys.shape[-2] if old_keys.dim() == 4 else 0
            need = held + key_states.shape[-2]
            if self._keys is None or self._values is None or need > self._keys.shape[-2]:
                b, h, _, d = key_states.shape
                keys = key_states.new_empty((b, h, need + self.room, d))
                values = value_states.new_empty((b, value_states.shape[1], need + self.room,
                                                 value_states.shape[-1]))
                if held:
                    keys[:, :, :held] = old_keys
                    values[:, :, :held] = old_values
                self._keys, self._values = keys, values
            self._keys[:, :, held:need] = key_states
            self._values[:, :, held:need] = value_states
            self.keys, self.values = self._keys[:, :, :need], self._values[:, :, :need]
            return self.keys, self.values

    return RoomyLayer
