"""Structured JSON logs (structlog) carrying run id, actor and event id."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "INFO", *, json: bool = True, stream=None) -> None:
    """Route structlog (and stdlib logging) to one stream as JSON lines.

    Bind ``run_id``/``actor`` with ``structlog.contextvars.bind_contextvars`` so every line
    an actor writes says who wrote it.
    """
    stream = stream or sys.stderr
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(stream=stream, level=logging.WARNING)
