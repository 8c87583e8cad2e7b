"""Bus URLs select the backend."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from gyre_async.bus.base import Bus
from gyre_async.bus.secrets import expand_query, redact
from gyre_async.errors import ConfigError


class BusURLError(ConfigError, ValueError):
    """A bus URL that can never work (unknown scheme or option, an unset ``${NAME}``); the
    message names what to fix and never holds a secret. ``gyre`` reports it as a config
    error (exit status 2)."""


class NoEventLog(ConfigError, FileNotFoundError):
    """A reader named an embedded event log that does not exist. Readers never make one: an
    empty ``events.db`` left where a run is about to start makes that run refuse its
    directory (it would otherwise append to another run's log)."""


def open_bus(url: str, *, reader: bool = False, **options: object) -> Bus:
    """Build (not start) the bus a URL names.

    ``sqlite:///rel/path.db``, ``sqlite:////abs/path.db`` or a plain path ending in ``.db``
    give the embedded bus; ``kafka://h1:9092,h2:9092?security_protocol=SASL_SSL&...`` gives
    the Kafka bus (query parameters are passed to aiokafka: TLS and SASL settings).
    ``${NAME}`` in a query value (``sasl_plain_password=${GYRE_KAFKA_PASSWORD}``) is the
    environment variable ``NAME``, read here, when the bus is built, and nowhere else (see
    :mod:`gyre_async.bus.secrets`).

    ``reader=True``: the caller only reads a run's log (``gyre inspect``, ``replay``,
    ``topics``, ``archive``, ``export-model``, the benches' judges): an embedded log that does
    not exist raises :class:`NoEventLog` here, before anything is created on disk. A Kafka
    bus is the broker's; there is nothing to create on the reader's side.
    """
    try:
        bus = _open_bus(url, **options)
    except BusURLError:
        raise
    except ValueError as exc:  # the backends' own option checks: as wrong as a bad URL
        raise BusURLError(redact(str(exc))) from None
    if reader:
        from gyre_async.bus.embedded import EmbeddedBus

        if isinstance(bus, EmbeddedBus) and not os.path.isfile(bus.path):
            raise NoEventLog(f"no event log at {bus.path}: check the run directory (or --bus); "
                             "a reader never creates one")
    return bus


def _open_bus(url: str, **options: object) -> Bus:
    parsed = urlparse(url)
    scheme = parsed.scheme or ("sqlite" if url.endswith(".db") else "")
    if scheme == "sqlite":
        from gyre_async.bus.embedded import EmbeddedBus

        if url.startswith("sqlite:///"):
            path = url[len("sqlite:///"):]  # sqlite:///rel/x.db -> rel/x.db; //// -> /abs
        elif url.startswith("sqlite://"):
            path = url[len("sqlite://"):]
        else:
            path = url
        return EmbeddedBus(path, **options)  # type: ignore[arg-type]
    if scheme == "kafka":
        from gyre_async.bus.kafka import KafkaBus

        if "@" in parsed.netloc:  # never echo the URL: it holds a secret
            raise BusURLError("kafka:// URL with user:password@ in it: pass credentials as "
                              "sasl_plain_username=...&sasl_plain_password=... query parameters")
        params = expand_query(parsed.query)
        return KafkaBus(parsed.netloc, **params, **options)  # type: ignore[arg-type]
    raise BusURLError(
        f"unknown bus URL {redact(url)!r}: use sqlite:///path/events.db (embedded, the "
        "default) or kafka://host:port"
    )
