"""Prompt-lookup drafts: what a context says an action will be, before the model is asked.

An agent's actions repeat what its own context already holds: a command from the valid
list, an object named in the room's text, an earlier action. In the long task's segment
sequences 91% of actions stand word for word earlier in their own sequence (docs/llm.md).
A draft is the continuation of the latest earlier occurrence of the sequence's last few
tokens; the policy reads the draft in the same forward pass as the token before it and
keeps what sampling would have chosen anyway (exact speculative sampling, see
:meth:`~gyre_async.policy.torch_policy.CausalLMPolicy.act_batch`), so an action of ten
tokens may take two or three forward passes instead of ten, with the very same
distribution and log-probs. No draft model is needed: the draft costs a list search.
"""

from __future__ import annotations

from collections.abc import Sequence

#: the longest suffix looked up (tokens): three pin a chat turn's opening
#: ("<|im_start|>assistant\n") or a command's first words; shorter ones are the fallback
MAX_NGRAM = 3


def prompt_lookup(sequence: Sequence[int], limit: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``sequence`` (``max_ngram`` tokens at most, one at least) found earlier in
    it; empty when no suffix occurs earlier or ``limit`` is 0. The latest occurrence, not
    the first: recent turns are likelier to be repeated than the prompt's example."""
    if limit <= 0 or len(sequence) < 2:
        return []
    seq = list(sequence)
    end = len(seq)
    for n in range(min(max_ngram, end - 1), 0, -1):
        suffix = seq[end - n:]
        last = suffix[-1]
        for s in range(end - 2, n - 2, -1):  # s: where an earlier occurrence ends
            if seq[s] == last and seq[s - n + 1:s + 1] == suffix:
                return seq[s + 1:s + 1 + limit]
    return []
