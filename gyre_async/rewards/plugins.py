"""Resolving pluggable reward and safety rules: a registry name or a ``module:function``.

A rule is configured by a :class:`schemas.config.RuleSpec` (``name``, ``weight``, ``args``).
``name`` is looked up in a registry first; a name with a colon is imported as
``module:function``. Either way the target is a *factory*: called once with ``args`` as
keyword arguments, it returns the function the arbiter calls per segment. Building rules
once at start-up means a typo or a bad argument fails when the arbiter starts, with the
name, instead of on the first segment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gyre_async.imports import import_callable


class RuleConfigError(ValueError):
    """A configured rule cannot be built (unknown name, bad import path, bad arguments)."""


class Registry(dict):
    """Factories of one kind of pluggable rule, by name; ``register`` is the decorator."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register a factory under ``name``."""
        def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
            self[name] = factory
            return factory
        return deco

    def factory(self, name: str) -> Callable[..., Any]:
        """The registered factory, or the ``module:function`` one ``name`` points at."""
        if name in self:
            return self[name]
        if ":" not in name:
            raise RuleConfigError(
                f"unknown {self.kind} {name!r}: use one of {', '.join(sorted(self))} "
                "or a 'module:function' path to a factory")
        return import_callable(name, self.kind, RuleConfigError)

    def build(self, name: str, args: dict[str, Any]) -> Callable:
        """Call the factory with ``args`` (once, at start-up)."""
        factory = self.factory(name)
        try:
            return factory(**args)
        except TypeError as exc:
            raise RuleConfigError(f"{self.kind} {name!r}: bad args {args!r}: {exc}") from None
