"""Errors that say whether trying again can help (callers branch on ``retriable``)."""


class GyreError(Exception):
    retriable = False


class RetriableError(GyreError):
    """A transient failure (I/O, a busy store): the runtime retries with backoff."""

    retriable = True


class OutOfSpace(RetriableError):
    """A volume is full (or a size limit was hit); the message names the path and the fix."""


class ConfigError(GyreError):
    """Invalid configuration; the message names the field and the fix."""


def is_retriable(exc: BaseException) -> bool:
    return bool(getattr(exc, "retriable", False))
