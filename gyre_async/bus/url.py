"""Bus URLs select the backend."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlparse

from gyre_async.bus.base import Bus


def open_bus(url: str, **options: object) -> Bus:
    """Build (not start) the bus a URL names.

    ``sqlite:///rel/path.db``, ``sqlite:////abs/path.db`` or a plain path ending in ``.db``
    give the embedded bus; ``kafka://h1:9092,h2:9092?security_protocol=SASL_SSL&...`` gives
    the Kafka bus (query parameters are passed to aiokafka: TLS and SASL settings).
    """
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
            raise ValueError("kafka:// URL with user:password@ in it: pass credentials as "
                             "sasl_plain_username=...&sasl_plain_password=... query parameters")
        params = dict(parse_qsl(parsed.query))
        return KafkaBus(parsed.netloc, **params, **options)  # type: ignore[arg-type]
    raise ValueError(
        f"unknown bus URL {url!r}: use sqlite:///path/events.db (embedded, the default) "
        "or kafka://host:port"
    )
