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


class OutputTooLarge(GyreError):
    """An output an input would make is larger than the bus carries: the input is refused
    (dead-lettered with this reason) rather than the output crashing the publish."""

    def __init__(self, what: str, size: int, limit: int):
        super().__init__(f"output too large: {what} of {size} bytes > bus limit {limit} bytes")
        self.size, self.limit = size, limit
