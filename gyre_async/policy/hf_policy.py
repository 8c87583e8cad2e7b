"""A local Hugging Face causal LM as a Gyre policy (needs ``transformers``; not tested here).

It reuses :class:`~gyre_async.policy.torch_policy.CausalLMPolicy`, so batching, padding,
sampling, log-prob conventions and checkpoints are exactly those of the tiny transformer. A
fresh value head (conservatively initialised) reads the last context token's final hidden
state. Nothing is ever downloaded: ``from_pretrained`` only reads a local directory.

Context markers (``<obs>``, ``<act>``, ``<sum>``) are plain text here (``"\\nObservation:"``
etc., see :class:`HFTokenizer`), since a pretrained vocabulary has no such tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .tokenizer import BaseTokenizer
from .torch_policy import CausalLMPolicy

_MARKERS = {"obs": "\nObservation: ", "act": "\nAction: ", "sum": "Progress: ", "sep": "\n"}


class HFTokenizer(BaseTokenizer):
    """Adapter from a ``transformers`` tokenizer to Gyre's tokenizer interface."""

    def __init__(self, hf_tokenizer: Any, path: str = ""):
        self.hf = hf_tokenizer
        self.path = path
        self.vocab_size = len(hf_tokenizer)
        self.eos_id = hf_tokenizer.eos_token_id
        self.pad_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None \
            else self.eos_id
        self.bos_id = hf_tokenizer.bos_token_id if hf_tokenizer.bos_token_id is not None \
            else self.eos_id
        self.unk_id = hf_tokenizer.unk_token_id if hf_tokenizer.unk_token_id is not None \
            else self.pad_id
        self.special_ids = frozenset(hf_tokenizer.all_special_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def marker(self, name: str) -> list[int]:
        if name == "bos":
            return [self.bos_id]
        return self.encode(_MARKERS[name])

    def to_json(self) -> str:
        import json

        return json.dumps({"kind": "hf", "path": self.path})


class _LMWithValue(nn.Module):
    def __init__(self, lm: nn.Module, value_prior: float):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.normal_(self.value_head.weight, std=1e-3 / hidden ** 0.5)
        nn.init.constant_(self.value_head.bias, value_prior)


class HFPolicy(CausalLMPolicy):
    """A Hugging Face causal LM with a value head, behind the :class:`Policy` interface."""

    def __init__(self, lm: nn.Module, tokenizer: HFTokenizer, *, value_prior: float = 0.0,
                 action_token_ids: Sequence[int] = (), seed: int = 0):
        config = lm.config
        max_len = int(getattr(config, "max_position_embeddings", 4096))
        super().__init__(tokenizer, config.vocab_size, max_len, action_token_ids, seed)
        self._model = _LMWithValue(lm, value_prior)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, value_prior: float = 0.0,
                        dtype: torch.dtype | None = None, **kwargs: Any) -> HFPolicy:
        """Load ``path`` (a local model directory) with ``transformers``; never downloads."""
        try:
            import transformers
        except ImportError as exc:
            raise ImportError("HFPolicy needs the 'transformers' package (pip install "
                              "transformers); the tiny TorchPolicy needs nothing extra") from exc
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"HFPolicy.from_pretrained: {path} is not a local model "
                                    "directory (nothing is downloaded at run time)")
        lm = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                               torch_dtype=dtype)
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(lm, HFTokenizer(tok, path), value_prior=value_prior, **kwargs)

    @property
    def model(self) -> nn.Module:
        return self._model

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: Any = None
                 ) -> tuple[torch.Tensor, Any]:
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)[:, mask.shape[1] - ids.shape[1]:]
        out = self._model.lm(input_ids=ids, attention_mask=mask.long(), position_ids=positions,
                             past_key_values=cache, use_cache=True, output_hidden_states=True)
        return out.hidden_states[-1], out.past_key_values

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._model.lm.get_output_embeddings()(h)

    def _value(self, h_last: torch.Tensor) -> torch.Tensor:
        return self._model.value_head(h_last.to(self._model.value_head.weight.dtype)).squeeze(-1)

    def checkpoint_metadata(self) -> dict[str, str]:
        return {"format": "gyre-hf-policy", "version": str(self.version),
                "tokenizer": self.tokenizer.to_json()}
