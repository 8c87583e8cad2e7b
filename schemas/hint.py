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
