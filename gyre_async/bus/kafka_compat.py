"""A fix to aiokafka that Gyre's Kafka backend applies on import (aio-libs/aiokafka#1038).

aiokafka turns an ``OSError`` from writing to a broker connection into
``KafkaConnectionError``, which its background tasks catch and retry. Under uvloop (Gyre's
default event loop) writing to a transport the broker has closed raises ``RuntimeError:
unable to perform operation on <TCPTransport closed=True ...>; the handler is closed``
instead. Nothing catches that: after a broker restart it killed the consumer's metadata
task, so every later metadata refresh waited forever, the consumer never found its group
coordinator again (the role stalled) and ``stop()`` hung on SIGTERM.

The fix wraps the two methods that write (``send`` and ``_send_sasl_token``) so that this
one error becomes what the stdlib loop's ``OSError`` becomes: the connection is closed and
``KafkaConnectionError`` raised. Any other ``RuntimeError`` passes through unchanged.
"""

from __future__ import annotations

import functools

from aiokafka.conn import AIOKafkaConnection, CloseReason
from aiokafka.errors import KafkaConnectionError

_CLOSED = "handler is closed"


def _closed_transport_is_connection_error(write):
    @functools.wraps(write)
    def wrapper(self, *args, **kwargs):
        try:
            return write(self, *args, **kwargs)
        except RuntimeError as err:
            if _CLOSED not in str(err):
                raise
            self.close(reason=CloseReason.CONNECTION_BROKEN)
            raise KafkaConnectionError(
                f"Connection at {self.host}:{self.port} broken: {err}") from err

    wrapper.gyre_fixed = True
    return wrapper


def apply() -> None:
    """Idempotent: wrap ``AIOKafkaConnection.send`` and ``_send_sasl_token`` once."""
    for name in ("send", "_send_sasl_token"):
        method = getattr(AIOKafkaConnection, name, None)
        if method is not None and not getattr(method, "gyre_fixed", False):
            setattr(AIOKafkaConnection, name, _closed_transport_is_connection_error(method))
