"""The torch backend: a small causal transformer policy with a value head.

Sized to train from scratch on a laptop CPU (d_model 64, 2 layers: ~0.1M parameters with the
workshop's word vocabulary). The same batching code serves any causal LM through
:class:`CausalLMPolicy`; :mod:`.hf_policy` plugs a local Hugging Face model into it.

Batching: contexts are **left-padded** so every row's last context token sits in the same
column; positions count real tokens only and padded keys are masked out of attention, so a
context's log-probs and value do not depend on what it is batched with (tested to 1e-5).
``evaluate`` lays actions out right after that column, so it sees exactly the tokens and
positions that ``act_batch`` saw when it sampled them.

Action vocabulary: ``ModelConfig.action_token_ids`` (when not empty) restricts what the
policy may generate to those tokens plus ``<eos>``; otherwise every non-special token and
``<eos>`` may be generated. The restriction is part of the policy (applied in ``act_batch``
*and* ``evaluate``), so behaviour and learner log-probs agree. For the workshop, passing the
ids of ``ACTION_WORDS`` shrinks the first-step search from ~75 tokens to ~20.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from gyre_async.policy.base import Action, CheckpointMismatch, EvalOutput, Policy, SamplingParams
from gyre_async.policy.tokenizer import BaseTokenizer


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shape of the tiny transformer (stored in every checkpoint's header)."""

    vocab_size: int
    """Tokens in the tokenizer (``tokenizer.vocab_size``)."""
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 128
    """Longest context + action the model can see (learned positional embeddings)."""
    dropout: float = 0.0
    tie_embeddings: bool = True
    """Output projection shares the token embedding (fewer parameters to learn)."""
    action_token_ids: tuple[int, ...] = ()
    """If not empty: the only tokens (plus ``<eos>``) the policy may generate."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("ModelConfig: d_model must be divisible by n_heads")
        if any(not 0 <= t < self.vocab_size for t in self.action_token_ids):
            raise ValueError("ModelConfig: action_token_ids must be < vocab_size")


Cache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, H, T, D/H]


class _Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.dropout = c.n_heads, c.dropout
        self.ln1, self.ln2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.mlp = nn.Sequential(nn.Linear(c.d_model, 4 * c.d_model), nn.GELU(),
                                 nn.Linear(4 * c.d_model, c.d_model), nn.Dropout(c.dropout))

    def forward(self, x: torch.Tensor, bias: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x)), (k, v)


class TinyTransformer(nn.Module):
    """Causal transformer: ids -> final hidden states, with an optional key/value cache."""

    def __init__(self, c: ModelConfig, value_prior: float = 0.0):
        super().__init__()
        self.config = c
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.max_len, c.d_model)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.value_head = nn.Linear(c.d_model, 1)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # Conservative critic: starts at the prior everywhere (the final LayerNorm's output
        # has norm ~sqrt(d_model), so these weights move values by ~1e-3 at first).
        nn.init.normal_(self.value_head.weight, std=1e-3 / c.d_model ** 0.5)
        nn.init.constant_(self.value_head.bias, value_prior)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: Cache | None = None
                ) -> tuple[torch.Tensor, Cache]:
        """Hidden states [B,t,D] of ``ids`` [B,t], which follow the ``cache`` d tokens.

        ``mask`` [B, cached + t] marks real (non-pad) tokens over the whole sequence so far.
        Positions count real tokens only; each query sees real keys up to itself (and itself,
        so that padded rows stay finite: their outputs are never used).
        """
        t, total = ids.shape[1], mask.shape[1]
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)[:, total - t:]
        x = self.tok_emb(ids) + self.pos_emb(positions)
        q_idx = torch.arange(total - t, total, device=ids.device)[:, None]
        k_idx = torch.arange(total, device=ids.device)[None, :]
        visible = ((k_idx <= q_idx) & mask[:, None, :]) | (k_idx == q_idx)
        bias = torch.zeros(visible.shape, dtype=x.dtype, device=ids.device)
        bias = bias.masked_fill(~visible, float("-inf"))[:, None]  # [B, 1, t, total]
        new_cache: Cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, bias, cache[i] if cache is not None else None)
            new_cache.append(kv)
        return self.ln_f(x), new_cache

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        return h @ weight.T

    def value(self, h_last: torch.Tensor) -> torch.Tensor:
        return self.value_head(h_last).squeeze(-1)


def _left_pad(seqs: Sequence[Sequence[int]], width: int, pad: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = True
    return ids, mask


def _behaviour_logp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs of the distribution tokens are drawn from (temperature, then top-p)."""
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()  # mass of better tokens
        drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, before >= params.top_p)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


class CausalLMPolicy(Policy):
    """Batched acting/evaluation over any causal LM with a value head (see module doc)."""

    def __init__(self, tokenizer: BaseTokenizer, vocab_size: int, max_len: int,
                 action_token_ids: Sequence[int] = (), seed: int = 0):
        self.tokenizer = tokenizer
        self.max_len = max_len
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        if action_token_ids:
            allowed[list(action_token_ids)] = True
        else:
            allowed[:] = True
            allowed[list(tokenizer.special_ids)] = False
        allowed[tokenizer.eos_id] = True
        self.allowed = allowed
        self.stops = torch.tensor(sorted(tokenizer.stop_ids))  # tokens that end an action
        self.device = torch.device("cpu")  # where the model's weights are (see ``to``)
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = threading.RLock()

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None
           ) -> CausalLMPolicy:
        """Move the model (and cast its weights to ``dtype``). Inputs are built on the CPU
        and moved in; results come back to the CPU (what the learner and the bus use), and
        sampling draws on the CPU with the policy's seeded generator, so a run's samples do
        not depend on the device. Log-probs are taken in float32 whatever ``dtype`` is."""
        with self._lock:
            self.model.to(device=device, dtype=dtype)
            self.device = torch.device(device)
            self.allowed = self.allowed.to(self.device)
            self.stops = self.stops.to(self.device)
        return self

    @property
    @abc.abstractmethod
    def model(self) -> nn.Module: ...

    @abc.abstractmethod
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: Any = None
                 ) -> tuple[torch.Tensor, Any]:
        """(hidden [B,t,D], new cache) for ``ids`` following ``cache``; ``mask`` covers all."""

    @abc.abstractmethod
    def _logits(self, h: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def _value(self, h_last: torch.Tensor) -> torch.Tensor: ...

    def _logp(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float().masked_fill(~self.allowed, float("-inf")), -1)

    def _check(self, contexts: Sequence[Sequence[int]], extra: int) -> int:
        if not contexts or any(len(c) == 0 for c in contexts):
            raise ValueError("every context needs at least one token (use ContextBuilder)")
        width = max(len(c) for c in contexts)
        if width + extra > self.max_len:
            raise ValueError(f"context of {width} tokens + {extra} action tokens exceeds the "
                             f"model's max_len {self.max_len}; lower ContextBuilder.max_tokens")
        return width

    def act_batch(self, contexts: list[list[int]], params: SamplingParams,
                  seed: int | None = None) -> list[Action]:
        if not contexts:
            return []
        n_new = params.max_action_tokens
        width = self._check(contexts, n_new)
        gen = torch.Generator().manual_seed(seed) if seed is not None else self._generator
        with self._lock, torch.inference_mode():
            ids, mask = _left_pad(contexts, width, self.tokenizer.pad_id)
            ids = torch.cat([ids, torch.full((len(contexts), n_new), self.tokenizer.pad_id)], 1)
            mask = torch.cat([mask, torch.zeros((len(contexts), n_new), dtype=torch.bool)], 1)
            ids, mask = ids.to(self.device), mask.to(self.device)
            tokens: list[list[int]] = [[] for _ in contexts]
            behaviour: list[list[float]] = [[] for _ in contexts]
            raw: list[list[float]] = [[] for _ in contexts]
            live = torch.ones(len(contexts), dtype=torch.bool, device=self.device)
            hidden, cache = self._forward(ids[:, :width], mask[:, :width])
            for j in range(n_new):
                if j:  # one new column, attending to the cached ones
                    hidden, cache = self._forward(ids[:, width + j - 1:width + j],
                                                  mask[:, :width + j], cache)
                logits = self._logits(hidden[:, -1]).float()
                logits = logits.masked_fill(~self.allowed, float("-inf"))
                raw_logp = torch.log_softmax(logits, -1)
                if params.greedy:
                    choice = raw_logp.argmax(-1)
                    b_logp = torch.zeros(len(contexts), device=self.device)
                else:
                    logp = _behaviour_logp(logits, params)
                    choice = torch.multinomial(logp.exp().cpu(), 1, generator=gen).squeeze(1)
                    choice = choice.to(self.device)
                    b_logp = logp.gather(1, choice[:, None]).squeeze(1)
                r_logp = raw_logp.gather(1, choice[:, None]).squeeze(1)
                ids[:, width + j] = torch.where(live, choice, self.tokenizer.pad_id)
                mask[:, width + j] = live
                rows = zip(live.tolist(), choice.tolist(), b_logp.tolist(), r_logp.tolist())
                for i, (alive, token, b_lp, r_lp) in enumerate(rows):
                    if alive:
                        tokens[i].append(token)
                        behaviour[i].append(b_lp)
                        raw[i].append(r_lp)
                live &= ~torch.isin(choice, self.stops)
                if not live.any():
                    break
        return [Action(tokens=t, logprobs=b, policy_logprobs=r, policy_version=self.version,
                       text=self.tokenizer.decode(t).strip())
                for t, b, r in zip(tokens, behaviour, raw)]

    def evaluate(self, contexts: list[list[int]], actions: list[list[int]]) -> EvalOutput:
        if len(contexts) != len(actions):
            raise ValueError("evaluate: one action per context")
        n_act = max((len(a) for a in actions), default=0)
        width = self._check(contexts, n_act)
        ids, mask = _left_pad(contexts, width, self.tokenizer.pad_id)
        act_ids = torch.full((len(actions), n_act), self.tokenizer.pad_id, dtype=torch.long)
        act_mask = torch.zeros((len(actions), n_act), dtype=torch.bool)
        for i, a in enumerate(actions):
            act_ids[i, :len(a)] = torch.as_tensor(a, dtype=torch.long)
            act_mask[i, :len(a)] = True
        with self._lock:
            hidden, _ = self._forward(torch.cat([ids, act_ids], 1).to(self.device),
                                      torch.cat([mask, act_mask], 1).to(self.device))
            values = self._value(hidden[:, width - 1]).float().cpu()
            logp = self._logp(self._logits(hidden[:, width - 1:width - 1 + n_act])).cpu()
        # Padding slots gather <eos> (always allowed, so finite) and are then zeroed; the
        # entropy's 0 * -inf terms are written as 0 * 0 so no gradient becomes NaN.
        index = torch.where(act_mask, act_ids, self.tokenizer.eos_id)
        chosen = logp.gather(2, index[..., None]).squeeze(2)
        entropy = -(logp.exp() * logp.masked_fill(~self.allowed.cpu(), 0.0)).sum(-1)
        m = act_mask.to(chosen.dtype)
        return EvalOutput(logprobs=chosen * m, entropy=entropy * m, values=values, mask=m)

    def next_token_logprobs(self, contexts: list[list[int]]) -> torch.Tensor:
        """Log-probs [B, V] of the first action token after each context (raw policy:
        temperature 1, action vocabulary applied; disallowed tokens are -inf).

        What the keeper and parameter-space noise measure KL divergences on.
        """
        width = self._check(contexts, 0)
        with self._lock, torch.inference_mode():
            ids, mask = _left_pad(contexts, width, self.tokenizer.pad_id)
            hidden, _ = self._forward(ids.to(self.device), mask.to(self.device))
            return self._logp(self._logits(hidden[:, -1])).float().cpu().clone()

    def values(self, contexts: list[list[int]]) -> torch.Tensor:
        width = self._check(contexts, 0)
        with self._lock, torch.inference_mode():
            ids, mask = _left_pad(contexts, width, self.tokenizer.pad_id)
            hidden, _ = self._forward(ids.to(self.device), mask.to(self.device))
            return self._value(hidden[:, -1]).float().cpu().clone()

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            self.model.load_state_dict(state_dict, strict=True)


class TorchPolicy(CausalLMPolicy):
    """The tiny transformer policy (the quickstart's policy)."""

    def __init__(self, config: ModelConfig, tokenizer: BaseTokenizer, *, seed: int = 0,
                 value_prior: float = 0.0):
        if config.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"ModelConfig.vocab_size {config.vocab_size} != tokenizer's "
                             f"{tokenizer.vocab_size}")
        super().__init__(tokenizer, config.vocab_size, config.max_len, config.action_token_ids,
                         seed)
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._model = TinyTransformer(config, value_prior)

    @property
    def model(self) -> TinyTransformer:
        return self._model

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: Any = None
                 ) -> tuple[torch.Tensor, Any]:
        return self._model(ids, mask, cache)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._model.logits(h)

    def _value(self, h_last: torch.Tensor) -> torch.Tensor:
        return self._model.value(h_last)

    def checkpoint_metadata(self) -> dict[str, str]:
        return {"format": "gyre-torch-policy", "version": str(self.version),
                "model_config": msgspec.json.encode(self.config).decode(),
                "tokenizer": self.tokenizer.to_json()}

    def check_checkpoint(self, metadata: Mapping[str, str], address: str) -> None:
        """Also refuse a checkpoint saved with another model config, naming both configs
        (instead of a shape error from deep inside ``load_state_dict``)."""
        super().check_checkpoint(metadata, address)
        theirs = metadata.get("model_config")
        if theirs is None:
            return  # a header without one (a plain tensor copy): shapes are checked on load
        try:
            same = msgspec.json.decode(theirs, type=ModelConfig) == self.config
        except msgspec.DecodeError:  # fields this version does not know: not this model
            same = False
        if not same:
            raise CheckpointMismatch(
                f"checkpoint {address} was saved with model config {theirs}, this policy has "
                f"{msgspec.json.encode(self.config).decode()}: build the policy from the "
                "config of the run that wrote the checkpoint (policy.* and the task's "
                "vocabulary)")
