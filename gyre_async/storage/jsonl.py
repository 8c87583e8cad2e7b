"""Reading small hand-written JSON-lines files (labels, references) with line-numbered errors.

Blank lines are skipped; a line that does not parse, or that ``parse`` refuses (``ValueError``,
``KeyError``, ``TypeError``), raises ``ValueError`` naming ``path:line`` and the expected shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class RowError(ValueError):
    """A row that parsed but says something wrong: reported as ``path:line: <message>``."""


def read_jsonl(path: str, parse: Callable[[Any], T], expected: str) -> list[T]:
    out: list[T] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(parse(json.loads(line)))
            except RowError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: expected {expected}: {exc}") from None
    return out
