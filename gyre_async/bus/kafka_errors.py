"""aiokafka errors as :class:`BusError`, marked retriable where a retry can help."""

from __future__ import annotations

import asyncio

from aiokafka.errors import (
    CommitFailedError,
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
    for_code,
)

from gyre_async.bus.base import BusError

RETRIABLE = (KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, RequestTimedOutError,
              CommitFailedError, asyncio.TimeoutError, ConnectionError)


def bus_error(exc: BaseException, what: str) -> BusError:
    """Wrap an aiokafka (or socket) error, keeping whether a retry can help."""
    if isinstance(exc, BusError):
        return exc
    retriable = isinstance(exc, RETRIABLE) or bool(getattr(exc, "retriable", False))
    return BusError(f"{what}: {type(exc).__name__}: {exc}", retriable=retriable)


def raise_for_code(code: int, what: str) -> None:
    if code:
        err = for_code(code)
        raise BusError(f"{what}: error {code} {err.__name__}",
                       retriable=bool(getattr(err, "retriable", False)))
