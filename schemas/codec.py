"""Encoding and decoding of events, with typed decoders built once per topic.

The wire format is msgpack (compact and fast); ``to_json`` gives the JSON form used by
``gyre tail``. Decoding failures raise :class:`DecodeError` with a reason fit for a
dead-letter record: which check failed and, for schema errors, the path of the bad field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .events import SCHEMA_VERSION, Event
from .topics import TOPIC_UNIONS

#: Default ceiling for one encoded event (Kafka's default message limit is 1 MB).
MAX_EVENT_BYTES = 1_000_000


class DecodeError(Exception):
    """Input that can never be decoded; ``retriable`` is always False."""

    retriable = False

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Envelope(msgspec.Struct):
    """Just enough of an event to check its schema version before the full decode."""

    schema_version: int = SCHEMA_VERSION
    type: str = ""


_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_decoders: dict[str, msgspec.msgpack.Decoder] = {
    topic: msgspec.msgpack.Decoder(union) for topic, union in TOPIC_UNIONS.items()
}



def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(topic: str, data: bytes, max_bytes: int = MAX_EVENT_BYTES) -> Event:
    """Decode one event of ``topic``; raise DecodeError saying why it is unusable."""
    if len(data) > max_bytes:
        raise DecodeError(f"oversized event: {len(data)} bytes > limit {max_bytes}")
    decoder = _decoders.get(topic)
    if decoder is None:
        raise DecodeError(f"unknown topic {topic!r}: no schema registered in schemas/topics.py")
    try:
        envelope = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"malformed bytes: {exc}") from None
    if envelope.schema_version > SCHEMA_VERSION:
        raise DecodeError(
            f"unknown schema version {envelope.schema_version} for {envelope.type!r} "
            f"(this build reads <= {SCHEMA_VERSION}); upgrade gyre on this consumer"
        )
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid {envelope.type or 'event'}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed bytes: {exc}") from None


def to_builtins(event: Event) -> dict[str, Any]:
    return msgspec.to_builtins(event)


def to_json(event: Event) -> bytes:
    return _json_encoder.encode(event)


def raw_to_builtins(data: bytes) -> Any:
    """Best-effort view of undecodable bytes (for dead-letter inspection)."""
    return msgspec.msgpack.decode(data)
