"""The torch backend: a small causal transformer policy with a value head.

Sized to train from scratch on a laptop CPU (d_model 64, 2 layers: ~0.1M parameters with the
workshop's word vocabulary). The same batching code serves any causal LM through
:class:`CausalLMPolicy`; :mod:`.hf_policy` plugs a local Hugging Face model into it.

Batching: contexts are **left-padded** so every row's last context token sits in the same
column; positions count real tokens only and padded keys are masked out of attention, so a
context's log-probs and value do not depend on what it is batched with (tested to 1e-5).
``evaluate`` lays actions out right after that column, so it sees exactly the tokens and
positions that ``act_batch`` saw when it sampled them.

Segment contexts (``policy.context = "segment"``) make each step's context an exact prefix
of the next one's. Two things follow:

- **Acting reuses the prefix.** ``act_batch`` called with ``sessions`` keeps, per session
  (an episode), the keys/values of what it has computed (context and action tokens), and
  the next call computes only the tokens past the longest prefix they share. The cached
  columns of a batch are laid out before the new ones (``[pad | cached][pad | new]``, the
  mask marking real tokens), so positions and visibility are those of the whole context.
  A context that shares more with another session's cache than with its own (a new
  episode or segment: the same prompt) starts from that one, as vLLM's prefix cache finds
  blocks by content. A new policy version (any ``load_state_dict``) drops every cached
  session; so does the end of an episode (:meth:`forget_session`). ``prefill_computed`` /
  ``prefill_reused`` count context tokens computed and taken from the cache. A row whose
  uncached part is much wider than the others' (a segment's opening) is prefilled apart
  first (:meth:`_prefill_apart`), so the batch does not pad every row to its width.
- **The learner reads a segment once.** :meth:`CausalLMPolicy.evaluate_sequences` runs one
  forward pass over a segment's whole sequence and reads every step's value (at its last
  context token) and its action's log-probs (at the positions that predict them) off it;
  equal, to float32 rounding, to :meth:`evaluate` of each step's context apart.

Drafts (``policy.draft_tokens``): acting may read a prompt-lookup draft of the next tokens
in the same forward pass as the token sampled last and keep what sampling would have
drawn (exact speculative sampling, :meth:`CausalLMPolicy._act_drafted`): the same
distribution and log-probs in fewer passes when actions repeat their context.

Action vocabulary: ``ModelConfig.action_token_ids`` (when not empty) restricts what the
policy may generate to those tokens plus ``<eos>``; otherwise every non-special token and
``<eos>`` may be generated. The restriction is part of the policy (applied in ``act_batch``
*and* ``evaluate``), so behaviour and learner log-probs agree. For the workshop, passing the
ids of ``ACTION_WORDS`` shrinks the first-step search from ~75 tokens to ~20.
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from gyre_async.policy.base import Action, CheckpointMismatch, EvalOutput, Policy, SamplingParams
from gyre_async.policy.draft import prompt_lookup
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


def _to_first_stop(draft: list[int], stops: set[int]) -> list[int]:
    """``draft`` up to its first stop token (kept: it ends the action; what follows it
    would be read for nothing)."""
    for j, token in enumerate(draft):
        if token in stops:
            return draft[:j + 1]
    return draft


@dataclass
class _Session:
    """One episode's cached keys/values: ``layers[l]`` is (keys, values) [H, T, D] of the
    ``tokens`` (its context so far and the action tokens fed back)."""

    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """How many first tokens every one of ``seqs`` shares."""
    first = seqs[0]
    return min((_shared_prefix(first, s) for s in seqs[1:]), default=len(first))


class CausalLMPolicy(Policy):
    """Batched acting/evaluation over any causal LM with a value head (see module doc)."""

    #: sessions whose keys/values are kept at most (least recently used dropped first);
    #: the sampler forgets each at its episode's end, so live ones are its environments
    max_sessions = 64
    #: the value head reads the features detached (``learner.value_trunk_gradient = false``,
    #: set by the learner): the value loss then trains the head alone, never the weights it
    #: shares with the policy
    critic_detached = False
    #: what one more forward pass costs beyond its tokens, in token columns (the weights are
    #: read once more): the price :meth:`_prefill_apart` weighs against the padding it saves
    pass_overhead_tokens = 32
    #: prompt-lookup draft length while acting (``policy.draft_tokens``; 0: one token per
    #: forward pass): see :meth:`_act_drafted`
    draft_tokens = 0

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
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._forgotten: set[str] = set()  # ended episodes' sessions, dropped under the lock

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None
           ) -> CausalLMPolicy:
        """Move the model (and cast its weights to ``dtype``). Inputs are built on the CPU
        and moved in; results come back to the CPU (what the learner and the bus use), and
        sampling draws on the CPU with the policy's seeded generator, so a run's samples do
        not depend on the device. Log-probs are taken in float32 whatever ``dtype`` is."""
        with self._lock:
            self.forget_sessions()
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

    def _forward_right_padded(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, t, D] of whole sequences, each row padded on the right only
        (``mask``: each row's ones, then zeros). A model may read such rows with its causal
        mask alone: a real token never sees a later position, so it never sees padding."""
        return self._forward(ids, mask)[0]

    @abc.abstractmethod
    def _logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def _cache_layers(self, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [B, H, T, D] of what ``_forward`` returned as cache."""
        return list(cache)

    def _as_cache(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> Any:
        """The model's cache object holding the first ``length`` columns of ``buffers``
        (per layer keys, values [B, H, T, D] with T >= length; inverse of ``_cache_layers``).
        The columns past ``length`` are room a cache may append into without copying."""
        return [(k[:, :, :length], v[:, :, :length]) for k, v in buffers]

    def _empty_cache(self, room: int) -> Any:
        """The cache to prefill into when nothing is reused (None: the model makes one)."""
        return None

    @abc.abstractmethod
    def _value(self, h_last: torch.Tensor) -> torch.Tensor: ...

    def _critic(self, h_last: torch.Tensor) -> torch.Tensor:
        """The values the learner trains on: through the shared features, or (``critic_detached``)
        on a detached copy of them."""
        return self._value(h_last.detach() if self.critic_detached else h_last)

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
                  seed: int | None = None, sessions: list[str | None] | None = None
                  ) -> list[Action]:
        if not contexts:
            return []
        if sessions is not None and len(sessions) != len(contexts):
            raise ValueError("act_batch: one session (or None) per context")
        n_new = params.max_action_tokens
        self._check(contexts, n_new)
        gen = torch.Generator().manual_seed(seed) if seed is not None else self._generator
        with self._lock, torch.inference_mode():
            self._drop_forgotten()
            if sessions is not None:
                self._prefill_apart(contexts, sessions)
            if self.draft_tokens:
                return self._actions(*self._act_drafted(contexts, params, gen, sessions))
            ids, mask, sources = self._prompt(contexts, sessions, n_new)
            width = ids.shape[1] - n_new
            start = max(r for _, r in sources)  # the first column computed
            tokens: list[list[int]] = [[] for _ in contexts]
            behaviour: list[list[float]] = [[] for _ in contexts]
            raw: list[list[float]] = [[] for _ in contexts]
            live = torch.ones(len(contexts), dtype=torch.bool, device=self.device)
            hidden, cache = self._forward(ids[:, start:width], mask[:, :width],
                                          self._past_cache(sources, ids.shape[1] - start))
            self.act_forwards += 1
            for j in range(n_new):
                if j:  # one new column, attending to the cached ones
                    hidden, cache = self._forward(ids[:, width + j - 1:width + j],
                                                  mask[:, :width + j], cache)
                    self.act_forwards += 1
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
            if sessions is not None:
                self._keep(sessions, ids, mask, cache)
        return self._actions(tokens, behaviour, raw)

    def _actions(self, tokens: list[list[int]], behaviour: list[list[float]],
                 raw: list[list[float]]) -> list[Action]:
        """Each row's sampled tokens and their log-probs as an :class:`Action`."""
        return [Action(tokens=t, logprobs=b, policy_logprobs=r, policy_version=self.version,
                       text=self.tokenizer.decode(t).strip())
                for t, b, r in zip(tokens, behaviour, raw)]

    def _act_drafted(self, contexts: list[list[int]], params: SamplingParams,
                     gen: torch.Generator, sessions: list[str | None] | None
                     ) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
        """Acting with prompt-lookup drafts (:mod:`.draft`): exact speculative sampling.

        Each forward pass reads, per row, the token sampled last and a draft of up to
        ``draft_tokens`` tokens found earlier in the row's own context and action so far,
        so it yields the next-token distribution before every drafted token and after the
        last. Drafted token ``d`` is kept with probability ``p(d)`` under the behaviour
        distribution (greedy: when it is the argmax); at the first one refused, the token
        is drawn from ``p`` with ``d`` removed (renormalised); with every one kept, one
        more is drawn from the distribution after the last. A point-mass draft makes this
        exact: ``d`` comes out with probability ``p(d)``, any other ``x`` with ``(1 - p(d))
        * p(x) / (1 - p(d)) = p(x)``; so actions are distributed as one token per pass
        would draw them, and their log-probs are read at the same positions. A refused
        draft's columns stay in the batch's cache but leave the mask (positions count
        real tokens only, no later token attends to them), so every kept token sees
        exactly the tokens and positions it would have seen without drafts; sessions keep
        real columns only."""
        n_new = params.max_action_tokens
        rows = len(contexts)
        pad = self.tokenizer.pad_id
        stops = set(self.stops.tolist())
        ids, mask, sources = self._prompt(contexts, sessions, 0)
        fed = max(r for _, r in sources)  # the first column not yet in the cache
        cache = self._past_cache(sources, ids.shape[1] - fed + n_new + 4 * self.draft_tokens)
        read = [list(c) for c in contexts]  # what each row has read and will: context, action
        tokens: list[list[int]] = [[] for _ in contexts]
        behaviour: list[list[float]] = [[] for _ in contexts]
        raw: list[list[float]] = [[] for _ in contexts]
        live = [True] * rows
        pending: list[int] | None = None  # each row's last sampled token, not yet read
        while any(live):
            drafts = [_to_first_stop(prompt_lookup(
                read[i], min(self.draft_tokens, n_new - len(tokens[i]))), stops)
                if live[i] else [] for i in range(rows)]
            lead, k = int(pending is not None), max(len(d) for d in drafts)
            new_ids = torch.full((rows, lead + k), pad, dtype=torch.long)
            new_mask = torch.zeros((rows, lead + k), dtype=torch.bool)
            for i, draft in enumerate(drafts):
                if live[i] and pending is not None:
                    new_ids[i, 0], new_mask[i, 0] = pending[i], True
                if draft:
                    new_ids[i, lead:lead + len(draft)] = torch.as_tensor(draft)
                    new_mask[i, lead:lead + len(draft)] = True
            ids = torch.cat([ids, new_ids.to(self.device)], 1)
            mask = torch.cat([mask, new_mask.to(self.device)], 1)
            hidden, cache = self._forward(ids[:, fed:], mask, cache)
            fed = ids.shape[1]
            self.act_forwards += 1
            self.drafted_tokens += sum(len(d) for d in drafts)
            # the distributions read: after each live row's last read token and each draft
            at = [(i, j) for i in range(rows) if live[i] for j in range(len(drafts[i]) + 1)]
            first: dict[int, int] = {}  # live row -> where its distributions start in ``at``
            for n, (i, _) in enumerate(at):
                first.setdefault(i, n)
            picked = hidden[torch.tensor([i for i, _ in at]),
                            torch.tensor([hidden.shape[1] - k - 1 + j for _, j in at])]
            logits = self._logits(picked).float().masked_fill(~self.allowed, float("-inf"))
            raw_logp = torch.log_softmax(logits, -1)
            b_logp = raw_logp if params.greedy else _behaviour_logp(logits, params)
            best = raw_logp.argmax(-1).tolist()
            coins = torch.rand(len(at), generator=gen).tolist()
            draws: list[tuple[int, int, int | None]] = []  # (row, where, refused token)
            for i in first:
                draft, n0, kept, ended = drafts[i], first[i], 0, False
                for j, token in enumerate(draft):
                    if params.greedy:
                        keep = best[n0 + j] == token
                    else:
                        p = float(b_logp[n0 + j, token].exp())
                        keep = coins[n0 + j] < p
                    if not keep:
                        break
                    self._take(i, token, b_logp[n0 + j], raw_logp[n0 + j], params.greedy,
                               tokens, behaviour, raw)
                    read[i].append(token)
                    kept += 1
                    if token in stops or len(tokens[i]) == n_new:
                        ended = True
                        break
                self.accepted_tokens += kept
                gone = slice(ids.shape[1] - k + kept, ids.shape[1] - k + len(draft))
                mask[i, gone] = False  # refused (or past the action's end): not read again
                if ended:
                    live[i] = False
                else:
                    draws.append((i, n0 + kept, draft[kept] if kept < len(draft) else None))
            pending = [pad] * rows
            chosen = self._draw(draws, b_logp, best, params.greedy, gen)
            for (i, n, _), token in zip(draws, chosen):
                self._take(i, token, b_logp[n], raw_logp[n], params.greedy,
                           tokens, behaviour, raw)
                read[i].append(token)
                pending[i] = token
                if token in stops or len(tokens[i]) == n_new:
                    live[i] = False
        if sessions is not None:
            self._keep(sessions, ids, mask, cache)
        return tokens, behaviour, raw

    @staticmethod
    def _take(row: int, token: int, b_logp: torch.Tensor, raw_logp: torch.Tensor,
              greedy: bool, tokens: list[list[int]], behaviour: list[list[float]],
              raw: list[list[float]]) -> None:
        tokens[row].append(token)
        behaviour[row].append(0.0 if greedy else float(b_logp[token]))
        raw[row].append(float(raw_logp[token]))

    @staticmethod
    def _draw(draws: list[tuple[int, int, int | None]], b_logp: torch.Tensor,
              best: list[int], greedy: bool, gen: torch.Generator) -> list[int]:
        """One token per ``(row, where, refused)``: from the behaviour distribution at
        ``where`` without the refused draft token (greedy: the argmax, which a refused
        token is not). A refusal whose rest has no mass left (``p(d)`` rounded below a
        coin of ``1 - 2^-24``) keeps the token after all: it was the only one possible."""
        if not draws:
            return []
        if greedy:
            return [best[n] for _, n, _ in draws]
        probs = b_logp[torch.tensor([n for _, n, _ in draws])].exp().cpu()
        for row, (_, _, refused) in enumerate(draws):
            if refused is not None:
                probs[row, refused] = 0.0
        empty = probs.sum(-1) <= 0
        probs[empty] = 1.0  # drawn from but replaced below
        chosen = torch.multinomial(probs, 1, generator=gen).squeeze(1).tolist()
        return [int(refused) if empty[row] and refused is not None else token
                for row, (token, (_, _, refused)) in enumerate(zip(chosen, draws))]

    # -- sessions: keys/values kept between an episode's steps ------------------------------
    def _prompt(self, contexts: list[list[int]], sessions: list[str | None] | None,
                n_new: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[_Session, int]]]:
        """ids and mask [B, P + S + n_new] of a batch whose first P columns are reused from
        cached sessions (right-aligned, ``[pad | cached]``) and the next S are computed
        (left-padded, ``[pad | new]``), and per row where its reused columns come from
        (the cached session, how many of its first tokens; 0: none). The reused columns'
        ids are the real tokens (never fed to the model: they only say what a session
        then holds)."""
        sources = [self._longest_prefix(c, s) for c, s in
                   zip(contexts, sessions or [None] * len(contexts))]
        reuse = [r for _, r in sources]
        self.prefill_reused += sum(reuse)
        self.prefill_computed += sum(len(c) - r for c, r in zip(contexts, reuse))
        ids, mask = self._layout(contexts, reuse, n_new)
        return ids, mask, sources

    def _layout(self, contexts: list[list[int]], reuse: list[int], n_new: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids and mask of :meth:`_prompt`'s layout, each row's first ``reuse`` tokens
        cached (nothing counted)."""
        pad = self.tokenizer.pad_id
        width_p = max(reuse)
        new_ids, new_mask = _left_pad([c[r:] for c, r in zip(contexts, reuse)],
                                      max(len(c) - r for c, r in zip(contexts, reuse)), pad)
        old_ids = torch.full((len(contexts), width_p), pad, dtype=torch.long)
        old_mask = torch.zeros((len(contexts), width_p), dtype=torch.bool)
        for i, (context, r) in enumerate(zip(contexts, reuse)):
            if r:
                old_ids[i, width_p - r:] = torch.as_tensor(context[:r], dtype=torch.long)
                old_mask[i, width_p - r:] = True
        ids = torch.cat([old_ids, new_ids, torch.full((len(contexts), n_new), pad)], 1)
        mask = torch.cat([old_mask, new_mask,
                          torch.zeros((len(contexts), n_new), dtype=torch.bool)], 1)
        return ids.to(self.device), mask.to(self.device)

    def _prefill_apart(self, contexts: list[list[int]], sessions: list[str | None]) -> None:
        """Prefill apart, first, the rows whose uncached part is much longer than the
        rest's (a segment opening among continuing segments). A batch computes every row
        as wide as its widest new part: one 500-token opening among seven 60-token
        continuations costs eight rows of 500, 4,000 token columns for 920 real tokens.
        The ``k`` rows with the longest new parts (``k`` minimising ``k * widest + n *
        (k+1)-th widest`` plus a pass's overhead, 0 when splitting saves nothing) have all
        of their context but its last token computed into their sessions here; the batch
        then reuses it. The tokens, positions and masks each row sees are the same either
        way (tested); the counters say what one pass would have counted."""
        if len(contexts) < 2:
            return
        found = [self._longest_prefix(c, s)[1] for c, s in zip(contexts, sessions)]
        new = [len(c) - r for c, r in zip(contexts, found)]
        by_width = sorted(range(len(contexts)), key=lambda i: -new[i])
        best_k, best_cost = 0, len(contexts) * new[by_width[0]]
        for k in range(1, len(contexts)):
            if sessions[by_width[k - 1]] is None:
                break  # a row without a session has nowhere to keep what is prefilled
            cost = (k * new[by_width[0]] + len(contexts) * new[by_width[k]]
                    + self.pass_overhead_tokens)
            if cost < best_cost:
                best_k, best_cost = k, cost
        rows = [i for i in by_width[:best_k] if new[i] > 1]
        if not rows:
            return
        computed, reused = self.prefill_computed, self.prefill_reused
        part = [contexts[i][:-1] for i in rows]
        own = [sessions[i] for i in rows]
        ids, mask, sources = self._prompt(part, own, 0)
        start = max(r for _, r in sources)
        _, cache = self._forward(ids[:, start:], mask,
                                 self._past_cache(sources, ids.shape[1] - start))
        self._keep(own, ids, mask, cache)
        # counted as one pass: these tokens computed; what the batch reuses of them, not
        ahead = sum(new[i] - 1 for i in rows)
        self.prefill_computed, self.prefill_reused = computed + ahead, reused - ahead

    def _longest_prefix(self, context: list[int], session: str | None
                        ) -> tuple[_Session, int]:
        """The cached keys/values sharing the longest prefix with ``context`` (at most all
        but its last token: its hidden state is needed): the session's own, or, when that
        holds less (a new episode, a new segment), any session's (the fixed prompt they
        share), as vLLM's prefix cache finds blocks by content. None for a context without
        a session."""
        empty = _Session([], [])
        if session is None:
            return empty, 0
        limit = len(context) - 1
        own = self._sessions.get(session)
        best, found = empty, 0
        if own is not None:
            best, found = own, min(_shared_prefix(own.tokens, context), limit)
        if own is None or found < len(own.tokens):
            for kept in self._sessions.values():
                if kept is not own and kept.tokens[:1] == context[:1]:
                    shared = min(_shared_prefix(kept.tokens, context), limit)
                    if shared > found:
                        best, found = kept, shared
        return best, found

    def _past_cache(self, sources: list[tuple[_Session, int]], room: int = 0) -> Any:
        """The model cache of the reused columns, with ``room`` more columns allocated for
        what this batch appends (its new prompt columns and generated tokens)."""
        width_p = max(r for _, r in sources)
        if not width_p:
            return self._empty_cache(room)
        first = next(kept for kept, r in sources if r)
        buffers = []
        for layer, (k0, v0) in enumerate(first.layers):
            keys = k0.new_zeros((len(sources), k0.shape[0], width_p + room, k0.shape[2]))
            values = v0.new_zeros((len(sources), v0.shape[0], width_p + room, v0.shape[2]))
            for i, (kept, r) in enumerate(sources):
                if r:
                    k, v = kept.layers[layer]
                    keys[i, :, width_p - r:width_p] = k[:, :r]
                    values[i, :, width_p - r:width_p] = v[:, :r]
            buffers.append((keys, values))
        return self._as_cache(buffers, width_p)

    def _keep(self, sessions: list[str | None], ids: torch.Tensor, mask: torch.Tensor,
              cache: Any) -> None:
        """Keep each session's real columns of ``cache`` (its context and the action tokens
        fed back), replacing what it held; the least recently used go past the bound."""
        layers = self._cache_layers(cache)
        width = layers[0][0].shape[2]
        for i, session in enumerate(sessions):
            if session is None:
                continue
            real = mask[i, :width]
            # a boolean index copies already: the batch's cache is not held by the session
            kept = [(k[i][:, real], v[i][:, real]) for k, v in layers]
            self._sessions[session] = _Session(ids[i, :width][real].tolist(), kept)
            self._sessions.move_to_end(session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def forget_session(self, session: str) -> None:
        """Drop one session (its episode ended). Episodes end on the event loop while a
        batch acts on a worker thread whose prefix search walks the sessions (a pop there
        raised "OrderedDict mutated during iteration"), and waiting for the policy's lock
        would stall the loop for a whole batch: the name is queued (a set add is atomic)
        and dropped under the lock, by the next batch or right away when the lock is free."""
        self._forgotten.add(session)
        if self._lock.acquire(blocking=False):
            try:
                self._drop_forgotten()
            finally:
                self._lock.release()

    def _drop_forgotten(self) -> None:
        """Under the lock: drop the queued sessions."""
        while self._forgotten:
            self._sessions.pop(self._forgotten.pop(), None)

    def forget_sessions(self) -> None:
        """Drop every cached session (the weights changed: their keys/values are stale)."""
        with self._lock:
            self._sessions.clear()

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
            values = self._critic(hidden[:, width - 1]).float().cpu()
            logp = self._logp(self._logits(hidden[:, width - 1:width - 1 + n_act])).cpu()
        # Padding slots gather <eos> (always allowed, so finite) and are then zeroed; the
        # entropy's 0 * -inf terms are written as 0 * 0 so no gradient becomes NaN.
        index = torch.where(act_mask, act_ids, self.tokenizer.eos_id)
        chosen = logp.gather(2, index[..., None]).squeeze(2)
        entropy = -(logp.exp() * logp.masked_fill(~self.allowed.cpu(), 0.0)).sum(-1)
        m = act_mask.to(chosen.dtype)
        return EvalOutput(logprobs=chosen * m, entropy=entropy * m, values=values, mask=m)

    def evaluate_sequences(self, sequences: Sequence[Sequence[int]],
                           decisions: Sequence[Sequence[tuple[int, int]]]) -> EvalOutput:
        """:meth:`evaluate` of many steps, read off one forward pass per sequence, with grad.

        ``sequences[b]`` is a segment's whole token sequence (every step's context and
        action: each context a prefix of the next); ``decisions[b]`` lists its steps as
        (context length, action length), the action's tokens being the sequence's next
        ones. Rows come out in that order (sequence by sequence, step by step). A step's
        value is read at its last context token, its action's log-probs at the positions
        that predict them: what :meth:`evaluate` gives for the step's context and action
        (to float32 rounding: other shapes, other summation order)."""
        if len(sequences) != len(decisions) or not sequences:
            raise ValueError("evaluate_sequences: one list of decisions per sequence")
        self._check(sequences, 0)
        seq_of, ctx_len, act_len = [], [], []
        for b, (sequence, steps) in enumerate(zip(sequences, decisions)):
            for n_ctx, n_act in steps:
                if n_ctx < 1 or n_ctx + n_act > len(sequence):
                    raise ValueError(f"decision ({n_ctx}, {n_act}) lies outside its sequence "
                                     f"of {len(sequence)} tokens")
                seq_of.append(b)
                ctx_len.append(n_ctx)
                act_len.append(n_act)
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.bool)
        for b, sequence in enumerate(sequences):  # right padding: one sequence per row
            ids[b, :len(sequence)] = torch.as_tensor(list(sequence), dtype=torch.long)
            mask[b, :len(sequence)] = True
        n_act = max(max(act_len), 1)
        rows = torch.tensor(seq_of)
        first = torch.tensor(ctx_len) - 1  # the last context token: value, first action logit
        columns = (first[:, None] + torch.arange(n_act)[None, :]).clamp(max=width - 1)
        act_mask = torch.arange(n_act)[None, :] < torch.tensor(act_len)[:, None]
        targets = ids[rows[:, None], (columns + 1).clamp(max=width - 1)]
        with self._lock:
            hidden = self._forward_right_padded(ids.to(self.device), mask.to(self.device))
            rows_d, first_d = rows.to(self.device), first.to(self.device)
            values = self._critic(hidden[rows_d, first_d]).float().cpu()
            picked = hidden[rows_d[:, None], columns.to(self.device)]
            logp = self._logp(self._logits(picked)).cpu()
        index = torch.where(act_mask, targets, self.tokenizer.eos_id)
        chosen = logp.gather(2, index[..., None]).squeeze(2)
        entropy = -(logp.exp() * logp.masked_fill(~self.allowed.cpu(), 0.0)).sum(-1)
        m = act_mask.to(chosen.dtype)
        return EvalOutput(logprobs=chosen * m, entropy=entropy * m, values=values, mask=m)

    def next_token_logprobs(self, contexts: list[list[int]]) -> torch.Tensor:
        """Log-probs [B, V] of the first action token after each context (raw policy:
        temperature 1, action vocabulary applied; disallowed tokens are -inf).

        What the keeper and parameter-space noise measure KL divergences on.
        """
        with self._lock, torch.inference_mode():
            return self._logp(self._logits(self._last_hidden(contexts))).float().cpu().clone()

    def values(self, contexts: list[list[int]]) -> torch.Tensor:
        with self._lock, torch.inference_mode():
            return self._value(self._last_hidden(contexts)).float().cpu().clone()

    #: a prefix every context shares is computed once when it is at least this long
    shared_prefix_min = 16
    #: rows per pass over the contexts after a shared prefix (each holds a copy of its keys)
    shared_prefix_rows = 16

    def _last_hidden(self, contexts: list[list[int]]) -> torch.Tensor:
        """Hidden states [B, D] at each context's last token (inference mode). A prefix
        every context shares (a probe set's prompt: the system text and worked example) is
        computed once and its keys/values reused, as acting reuses a session's; the same
        positions and visibility, so the same results to float32 rounding (tested)."""
        width = self._check(contexts, 0)
        shared = min(_common_prefix(contexts), min(len(c) for c in contexts) - 1)
        if len(contexts) < 2 or shared < self.shared_prefix_min:
            ids, mask = _left_pad(contexts, width, self.tokenizer.pad_id)
            hidden, _ = self._forward(ids.to(self.device), mask.to(self.device))
            return hidden[:, -1]
        prefix = torch.tensor([contexts[0][:shared]], device=self.device)
        _, cache = self._forward(prefix, torch.ones_like(prefix, dtype=torch.bool),
                                 self._empty_cache(shared))
        kept = _Session(contexts[0][:shared], [(k[0], v[0])
                                               for k, v in self._cache_layers(cache)])
        out = []
        for at in range(0, len(contexts), self.shared_prefix_rows):
            chunk = contexts[at:at + self.shared_prefix_rows]
            ids, mask = self._layout(chunk, [shared] * len(chunk), 0)
            hidden, _ = self._forward(ids[:, shared:], mask,
                                      self._past_cache([(kept, shared)] * len(chunk),
                                                       ids.shape[1] - shared))
            out.append(hidden[:, -1])
        return torch.cat(out)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            self.forget_sessions()
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
