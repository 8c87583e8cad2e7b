"""Bounded context windows: what the policy sees at one step of a very long trajectory.

A trajectory may run for thousands of steps; the policy's context must not grow with it.
A context is, in this order::

    <bos> [<sum> milestone summary] [shot] [<obs> o <act> a] * (newest turns that fit) <obs> o_t <act>

``shot`` is the tokenizer's worked example (a chat model is shown one exchange in the
answer format it must keep; word-level models have none), and each observation is put as
the tokenizer reads it best (``format_observation``: a chat model gets the valid commands
as a list after the game's text). It ends with ``<act>``: the policy generates the action
right after it. Only the last ``history_turns`` turns are ever looked at, so building
costs O(history_turns), not O(trajectory length). When the window is too small, the
oldest material goes first:

1. the current observation always stays (if it alone is too long, its oldest words go);
2. the summary gets at most ``summary_max_tokens`` (its newest tokens are kept), when room
   is left after the current observation;
3. the rest is filled with whole turns, newest first (a turn that does not fit whole is
   dropped, never cut in half).

The same inputs always give the same tokens (the sampler records them in ``TrajectoryStep``
and the learner re-evaluates exactly those).

Segment contexts (``mode = "segment"``, ``policy.context``) are one append-only sequence per
training segment instead: :meth:`ContextBuilder.opening` is the context of a segment's
first step (the window above with no past turns, and the task as the environment states it
after the preamble: ``<bos> [<task> task] [<sum> summary] [shot] <obs> o <act>``),
and :meth:`ContextBuilder.continuation` what the next step appends after the action's own
tokens, so every context is an exact prefix of the next one. Where a segment, and so its
context, closes is not decided here (``gyre_async.core.segmenter.segment_boundary``).
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre_async.policy.tokenizer import BaseTokenizer
from schemas.hint import hint_changes


class ContextBuilder:
    """Build bounded token contexts from observations, recent turns and a summary."""

    def __init__(self, tokenizer: BaseTokenizer, max_tokens: int, history_turns: int,
                 summary_max_tokens: int | None = None, mode: str = "window",
                 hint: str = "full"):
        if history_turns < 0:
            raise ValueError("ContextBuilder: history_turns must be >= 0")
        if mode not in ("window", "segment"):
            raise ValueError(f"ContextBuilder: mode {mode!r} is neither 'window' nor 'segment'")
        if hint not in ("full", "changes"):
            raise ValueError(f"ContextBuilder: hint {hint!r} is neither 'full' nor 'changes'")
        self.mode = mode
        self.hint = hint
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.history_turns = history_turns
        self.summary_max_tokens = (max_tokens // 4 if summary_max_tokens is None
                                   else summary_max_tokens)
        self._bos, self._obs, self._act, self._sum, self._shot, self._task = (
            tokenizer.marker(m) for m in ("bos", "obs", "act", "sum", "shot", "task"))
        fixed = len(self._bos) + len(self._shot) + len(self._obs) + len(self._act)
        if max_tokens < fixed + 1:
            raise ValueError(f"ContextBuilder: max_tokens must be >= {fixed + 1} (the markers "
                             "plus one observation token)")

    def turn(self, observation: str, action: str) -> list[int]:
        """Tokens of one past turn: ``<obs> observation <act> action``."""
        t = self.tokenizer
        return [*self._obs, *t.encode(t.format_observation(observation)), *self._act,
                *t.encode(action)]

    def build(self, current_observation: str, history: Sequence[tuple[str, str]] = (),
              milestone_summary: str = "", task: str = "") -> list[int]:
        """The context for choosing the next action; never longer than ``max_tokens``.

        ``history`` holds (observation, action) pairs, oldest first; only its tail is read.
        ``task`` (segment openings only, see :meth:`opening`) goes before the summary, cut
        like it: at most ``summary_max_tokens``, newest tokens kept, after the summary.
        """
        t = self.tokenizer
        room = self.max_tokens - len(self._bos) - len(self._shot)
        obs = t.encode(t.format_observation(current_observation))
        obs = obs[max(0, len(obs) - (room - len(self._obs) - len(self._act))):]
        current = [*self._obs, *obs, *self._act]
        room -= len(current)
        summary = self._headed(self._sum, milestone_summary, room)
        room -= len(summary)
        stated = self._headed(self._task, task, room)
        room -= len(stated)
        turns: list[list[int]] = []
        if self.history_turns:
            n = len(history)  # index from the end: O(1) for lists, tuples and deques
            for i in range(n - 1, max(0, n - self.history_turns) - 1, -1):
                observation, action = history[i]
                tokens = self.turn(observation, action)
                if len(tokens) > room:
                    break
                turns.append(tokens)
                room -= len(tokens)
        out = [*self._bos, *stated, *summary, *self._shot]
        for tokens in reversed(turns):
            out.extend(tokens)
        out.extend(current)
        return out

    def _headed(self, marker: list[int], text: str, room: int) -> list[int]:
        """``marker`` and the newest tokens of ``text``: at most ``summary_max_tokens`` and
        ``room`` in all (nothing when ``text`` is empty or no token fits)."""
        budget = min(room, self.summary_max_tokens) - len(marker)
        if not text or budget <= 0:
            return []
        body = self.tokenizer.encode(text)
        return [*marker, *body[max(0, len(body) - budget):]]

    @property
    def segments(self) -> bool:
        """True when contexts are segment sequences (see the module docstring)."""
        return self.mode == "segment"

    def opening(self, observation: str, milestone_summary: str = "", task: str = "") -> list[int]:
        """The context of a segment's first step: prompt, task, summary, the observation.

        ``task`` is the environment's statement of it (:meth:`gyre_async.envs.base.Env.task`):
        a segment that opens mid-episode has no earlier turn that stated it. It is left out
        when the observation already holds it whole (a game's first observation often does).
        """
        return self.build(observation, (), milestone_summary,
                          "" if task in observation else task)

    def continuation(self, action_tokens: Sequence[int], observation: str,
                     previous: str = "") -> list[int]:
        """What a segment context appends after an action's own tokens to become the next
        step's context: ``<obs> observation <act>``. An end-of-turn token the action ended
        with is not repeated when the observation marker begins with it (a chat model's
        ``<|im_end|>``). The observation is not shortened: a context that would pass
        ``max_tokens`` closes the segment instead (its next context is an opening).
        ``previous`` is the observation this context ended with: with ``hint="changes"``
        the new observation's valid-command hint says only what changed since that one's
        (:func:`schemas.hint.hint_changes`)."""
        t = self.tokenizer
        if self.hint == "changes" and previous:
            observation = hint_changes(previous, observation)
        marker = self._obs
        if marker and action_tokens and action_tokens[-1] == marker[0]:
            marker = marker[1:]
        return [*marker, *t.encode(t.format_observation(observation)), *self._act]


def summarize_milestones(names: Sequence[str], last: int = 4) -> str:
    """A short milestone summary for :meth:`ContextBuilder.build`: the newest ``last`` names.

    ``["craft:axe#1", "craft:saw#2"]`` -> ``"done craft:axe#1 craft:saw#2"`` (every piece of
    workshop milestone names is in the workshop vocabulary). Bounded like the context itself.
    """
    return " ".join(["done", *names[-last:]]) if names else ""
