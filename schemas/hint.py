"""The admissible-actions hint: one text convention shared by environments and policies.

A text game with ``admissible = "hint"`` puts its valid commands in front of the game's
text, ``valid actions : a | b | c . <text>``: word-level policies read it as words (and a
short context window drops the hint first). A chat language model reads better with the
text first and the commands as a list at the end, next to where it answers; its tokenizer
re-presents the same observation that way (:func:`split_hint`). Environments and
policies both import this module, so neither imports the other.
"""

from __future__ import annotations

HINT_PREFIX = "valid actions :"
HINT_SEPARATOR = " | "


def present_hint(valid: list[str], text: str) -> str:
    """``text`` with the valid commands in front (no-op without any)."""
    if not valid:
        return text
    return f"{HINT_PREFIX} {HINT_SEPARATOR.join(valid)} . {text}"


def split_hint(observation: str) -> tuple[list[str], str]:
    """(valid commands, the game's text) of an observation made by :func:`present_hint`;
    ``([], observation)`` when it carries no hint."""
    if not observation.startswith(HINT_PREFIX + " "):
        return [], observation
    body = observation[len(HINT_PREFIX) + 1:]
    hint, sep, text = body.partition(" . ")
    if not sep:
        return [], observation
    return hint.split(HINT_SEPARATOR), text


#: A hint re-stated as what changed since the step before (segment contexts, see
#: :func:`hint_changes`): ``valid actions changed : + a | - b . <text>``.
CHANGES_PREFIX = "valid actions changed :"
NO_CHANGE = "none"


def hint_changes(previous: str, observation: str) -> str:
    """``observation`` with its hint re-stated as the commands that became valid (``+ c``)
    and those no longer valid (``- c``) since ``previous``'s hint (``none``: the same list).

    For a reader that saw ``previous``'s list earlier in the same sequence (a segment
    context): the list it holds then is the one it would be shown. Where the changes would
    be longer than the list (a new room: most commands change), the whole list is stated
    instead, as it is for an observation without a hint or after one without a hint."""
    before, _ = split_hint(previous)
    now, text = split_hint(observation)
    if not now or not before:
        return observation
    had, has = set(before), set(now)
    items = [f"+ {c}" for c in now if c not in had] + [f"- {c}" for c in before if c not in has]
    stated = HINT_SEPARATOR.join(items) or NO_CHANGE
    if len(stated) >= len(HINT_SEPARATOR.join(now)):
        return observation
    return f"{CHANGES_PREFIX} {stated} . {text}"


def split_hint_changes(observation: str) -> tuple[list[str], list[str], str] | None:
    """(commands now valid, commands no longer valid, the game's text) of an observation
    made by :func:`hint_changes`; None when it carries no such hint."""
    if not observation.startswith(CHANGES_PREFIX + " "):
        return None
    body, sep, text = observation[len(CHANGES_PREFIX) + 1:].partition(" . ")
    if not sep:
        return None
    items = [] if body == NO_CHANGE else body.split(HINT_SEPARATOR)
    return ([i[2:] for i in items if i.startswith("+ ")],
            [i[2:] for i in items if i.startswith("- ")], text)
