"""Tokenizers that need no download, saved beside checkpoints as JSON.

Both share the same special tokens at the same ids (``<pad>`` is 0), so context building and
the model do not care which one is in use:

``<pad>`` padding, ``<bos>`` start of a context, ``<eos>`` end of an action (the policy
learns to stop), ``<unk>`` unknown word, ``<sep>`` separator, and the context markers
``<obs>`` (an observation follows), ``<act>`` (an action follows: the policy generates after
it) and ``<sum>`` (the milestone summary follows).

- :class:`WordTokenizer` over a fixed word list: tiny vocabularies (the workshop has ~70
  words) make tiny models learn fast. Text is lower-cased and split into words, single
  digits and punctuation marks, so ``"order 12."`` -> ``order 1 2 .``.
- :class:`ByteTokenizer`: 256 bytes + specials, for arbitrary text (an environment that
  cannot list its words).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>", "<sep>", "<obs>",
                                   "<act>", "<sum>")
PAD, BOS, EOS, UNK, SEP, OBS, ACT, SUM = range(len(SPECIAL_TOKENS))

_WORDS = re.compile(r"<[a-z]+>|[a-z_']+|\d|[^\sa-z\d]")


class BaseTokenizer:
    """What every tokenizer offers; the special-token ids are the same for all of them."""

    pad_id, bos_id, eos_id, unk_id, sep_id = PAD, BOS, EOS, UNK, SEP
    obs_id, act_id, sum_id = OBS, ACT, SUM
    special_ids: frozenset[int] = frozenset(range(len(SPECIAL_TOKENS)))

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        raise NotImplementedError

    def to_json(self) -> str:
        raise NotImplementedError

    def marker(self, name: str) -> list[int]:
        """Tokens of a context marker: ``"bos"``, ``"obs"``, ``"act"``, ``"sum"``, ``"sep"``,
        ``"task"`` (the task follows, in segment openings: ``<sep>`` for word-level models)
        or ``"shot"`` (a worked example after the preamble: none for word-level models)."""
        if name == "shot":
            return []
        return [{"bos": self.bos_id, "obs": self.obs_id, "act": self.act_id,
                 "sum": self.sum_id, "sep": self.sep_id, "task": self.sep_id}[name]]

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end an action (included in it, as ``<eos>`` is): ``<eos>`` here."""
        return frozenset({self.eos_id})

    def format_observation(self, observation: str) -> str:
        """The observation as this model reads it best (as is, for word-level models)."""
        return observation

    @staticmethod
    def from_json(text: str) -> BaseTokenizer:
        """Rebuild any tokenizer from its :meth:`to_json` output."""
        return tokenizer_from_json(text)


class WordTokenizer(BaseTokenizer):
    """Word-level tokenizer over a fixed vocabulary (specials first, then ``vocab``)."""

    def __init__(self, vocab: Sequence[str]):
        words = [w for w in dict.fromkeys(vocab) if w not in SPECIAL_TOKENS]
        for w in words:
            if _WORDS.fullmatch(w) is None:
                raise ValueError(f"vocabulary entry {w!r} is not one token of the word splitter "
                                 "(split it into words, digits and punctuation)")
        self.words: tuple[str, ...] = SPECIAL_TOKENS + tuple(words)
        self._ids = {w: i for i, w in enumerate(self.words)}
        self.vocab_size = len(self.words)

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(w, UNK) for w in _WORDS.findall(text.lower())]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return " ".join(self.words[i] for i in ids
                        if not (skip_special and i in self.special_ids))

    def token_id(self, word: str) -> int:
        """Id of one word (``<unk>`` if it is not in the vocabulary)."""
        return self._ids.get(word, UNK)

    def to_json(self) -> str:
        return json.dumps({"kind": "word", "vocab": list(self.words[len(SPECIAL_TOKENS):])})


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes shifted past the specials: any text, no unknowns, long sequences."""

    vocab_size = len(SPECIAL_TOKENS) + 256

    def encode(self, text: str) -> list[int]:
        return [b + len(SPECIAL_TOKENS) for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i >= len(SPECIAL_TOKENS):
                out.append(i - len(SPECIAL_TOKENS))
            elif not skip_special:
                out.extend(SPECIAL_TOKENS[i].encode())
        return out.decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"kind": "byte"})


Tokenizer = BaseTokenizer


def tokenizer_from_json(text: str) -> Tokenizer:
    """Rebuild a tokenizer from :meth:`to_json` output (as stored in a checkpoint)."""
    spec = json.loads(text)
    if spec.get("kind") == "word":
        return WordTokenizer(spec["vocab"])
    if spec.get("kind") == "byte":
        return ByteTokenizer()
    if spec.get("kind") == "hf":
        from gyre_async.policy.hf_policy import HFTokenizer

        return HFTokenizer.from_pretrained(spec["path"])
    raise ValueError(f"unknown tokenizer kind {spec.get('kind')!r}")


def tokenizer_for_vocabulary(words: Sequence[str]) -> Tokenizer:
    """The tokenizer for text made of ``words``.

    A :class:`WordTokenizer` over ``words`` (ids in their order, so appending words never
    moves existing ids); with no words (an environment that cannot list them), the
    :class:`ByteTokenizer`. The words come from the environment that owns them, handed
    over by the composition root (:mod:`gyre_async.compose`): this package never imports
    environments.
    """
    return WordTokenizer(words) if words else ByteTokenizer()
