"""Segment contexts as the log carries them: what is new at each step, put back together.

With ``policy.context = "segment"`` a step's context is its predecessor's context, that
step's action tokens and a continuation (the next observation), so a ``trajectory-step``
event carries only the continuation: its first ``context_prefix`` tokens are the previous
step's whole context and action (``TrajectoryStep.context_prefix``; likewise
``next_context_prefix`` for ``next_context_tokens``). Carrying the whole context would make
a segment of n steps weigh O(n^2) tokens on the bus; this keeps it O(n).

A prefix must be exactly the previous step's context and action, whose length it states, so
a step resolves only after that step, of the same trajectory, resolved: the segmenter
resolves each step against the one before it in its open segment (a segment's first step
opens a context: its prefix is 0, by the segmenter's own rule), ``gyre inspect`` a whole
trajectory. A step that does not resolve (its predecessor lost upstream, or a prefix that
does not match) is refused with :class:`UnresolvedContext`, never given a wrong context.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from schemas.events import TrajectoryStep


class UnresolvedContext(ValueError):
    """A step whose context continues one that is not there (or not of that length)."""


def resolve_step(step: TrajectoryStep, previous: TrajectoryStep | None) -> TrajectoryStep:
    """``step`` with its whole context and next context (prefixes 0), given the previous
    step of its trajectory already resolved (None: there is none at hand)."""
    if not step.context_prefix and not step.next_context_prefix:
        return step
    context = list(step.context_tokens)
    if step.context_prefix:
        if (previous is None or previous.trajectory_id != step.trajectory_id
                or previous.step_index != step.step_index - 1):
            raise UnresolvedContext(
                f"step {step.step_index} of {step.trajectory_id} continues the context of step "
                f"{step.step_index - 1}, which is not at hand (lost upstream, or in a segment "
                "closed before it): its context cannot be rebuilt")
        before = [*previous.context_tokens, *previous.action_tokens]
        if len(before) != step.context_prefix:
            raise UnresolvedContext(
                f"step {step.step_index} of {step.trajectory_id} continues {step.context_prefix} "
                f"tokens of context and action, step {previous.step_index} has {len(before)}")
        context = before + context
    next_context = step.next_context_tokens
    if next_context is not None and step.next_context_prefix:
        after = [*context, *step.action_tokens]
        if len(after) != step.next_context_prefix:
            raise UnresolvedContext(
                f"step {step.step_index} of {step.trajectory_id}: its next context continues "
                f"{step.next_context_prefix} tokens, its context and action are {len(after)}")
        next_context = after + list(next_context)
    return msgspec.structs.replace(step, context_tokens=context, context_prefix=0,
                                   next_context_tokens=next_context, next_context_prefix=0)


def resolve_trajectory(steps: Iterable[TrajectoryStep]) -> list[TrajectoryStep]:
    """One trajectory's steps, in step order, each with its whole context (what ``gyre
    inspect`` shows). A step that does not resolve stops the list there."""
    out: list[TrajectoryStep] = []
    for step in sorted(steps, key=lambda s: s.step_index):
        try:
            out.append(resolve_step(step, out[-1] if out else None))
        except UnresolvedContext:
            break
    return out


def continues(previous: TrajectoryStep, step: TrajectoryStep) -> bool:
    """Whether ``step``'s (resolved) context is ``previous``'s context and action followed
    by more: then both are read off one sequence."""
    n = len(previous.context_tokens) + len(previous.action_tokens)
    return (len(step.context_tokens) > n
            and step.context_tokens[:len(previous.context_tokens)] == previous.context_tokens
            and step.context_tokens[len(previous.context_tokens):n] == previous.action_tokens)
