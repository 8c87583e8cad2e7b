"""Config errors that name the field, the value given and the fix.

msgspec refuses a value outside a field's bounds (``schemas.config.Count`` and friends) with
``Expected `int` >= 1 - at `$.learner.minibatch_steps```. That is exact but terse: an
operator wants to read which value was wrong, what the field is for and what to write
instead. :func:`explain` turns such an error into that, using the field's own docstring
from ``schemas/config.py`` (read once with ``ast``: msgspec keeps no attribute docstrings).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from typing import Any

import msgspec

import schemas.config
from schemas.config import Config

_AT = re.compile(r"(?P<what>.+) - at `\$\.(?P<path>[A-Za-z0-9_.]+)`")
_BOUND = re.compile(r"Expected `(?P<type>\w+)` (?P<op>[<>]=?) (?P<limit>\S+)")
_WORDS = {">=": "at least", ">": "a value above", "<=": "at most", "<": "a value below"}


def explain(exc: msgspec.ValidationError, document: Any) -> str | None:
    """A sentence for an out-of-bounds field (None for any other validation error).

    ``document`` is the config decoded without a schema (to quote the value given).
    """
    at = _AT.fullmatch(str(exc))
    bound = _BOUND.fullmatch(at["what"]) if at else None
    if at is None or bound is None:
        return None
    path = at["path"]
    value = _lookup(document, path.split("."))
    doc = field_doc(path)
    return (f"{path} = {value!r} is out of bounds: it must be {bound['op']} {bound['limit']}. "
            f"Fix: set {path} to {_WORDS[bound['op']]} {bound['limit']}"
            + (f" ({doc})" if doc else "") + ".")


def _lookup(document: Any, parts: list[str]) -> Any:
    for part in parts:
        if not isinstance(document, dict) or part not in document:
            return "?"
        document = document[part]
    return document


def field_doc(path: str) -> str:
    """The first sentence of a config field's docstring (``""`` when there is none)."""
    cls: Any = Config
    *sections, name = path.split(".")
    for section in sections:
        fields = {f.name: f.type for f in msgspec.structs.fields(cls)}
        cls = fields.get(section)
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            return ""
    text = _docstrings().get((cls.__name__, name), "")
    first = " ".join(text.split()).split(". ")[0].rstrip(".")
    return first


@functools.cache
def _docstrings() -> dict[tuple[str, str], str]:
    """(class, field) -> the string literal that follows the field in schemas/config.py."""
    tree = ast.parse(inspect.getsource(schemas.config))
    out: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for field, after in zip(body, body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                out[(node.name, field.target.id)] = after.value.value
    return out
