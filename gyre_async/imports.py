"""Importing a configured ``package.module:function`` target, with errors that say the fix.

Reward rules, safety guards and macro scripts are all named in config this way; resolving
them once, at start-up, turns a typo into a clear error before any event is handled.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_callable(target: str, kind: str, error: type[Exception] = ValueError) -> Callable[..., Any]:
    """The callable that ``target`` (``package.module:function``) names, or ``error``."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise error(f"{kind} {target!r}: write it as 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise error(f"{kind} {target!r} cannot be loaded ({exc}); check that the module is "
                    "importable (on PYTHONPATH) and defines that function") from None
    if not callable(fn):
        raise error(f"{kind} {target!r} is not callable")
    return fn
