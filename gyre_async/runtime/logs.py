"""Structured JSON logs (structlog) carrying run id, actor and event id."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from gyre_async.bus.secrets import redact


def configure_logging(level: str = "INFO", *, json: bool = True, stream=None) -> None:
    """Route structlog (and stdlib logging) to one stream as JSON lines.

    Bind ``run_id``/``actor`` with ``structlog.contextvars.bind_contextvars`` so every line
    an actor writes says who wrote it.
    """
    stream = stream or _CurrentStderr()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_secrets,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(stream=stream, level=logging.WARNING)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written, not when logging was configured:
    a caller that swaps it (a test's output capture, a redirect) and closes its stream
    afterwards must not leave every later log line writing to a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def redact_secrets(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]
                   ) -> MutableMapping[str, Any]:
    """structlog processor: no bus URL secret in any string of a log line (the message,
    its fields, a formatted traceback), whoever logged it and however the URL got there."""
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = redact(value)
        elif not isinstance(value, bool | int | float | None):
            text = str(value)
            if redact(text) != text:  # a dict or an object that quotes a URL
                event_dict[key] = redact(text)
    return event_dict


class RedactingFilter(logging.Filter):
    """The same for stdlib logging (aiokafka's own lines): the record's final message."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if redact(message) != message:
            record.msg, record.args = redact(message), None
        return True
