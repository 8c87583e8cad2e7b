"""Gyre's wire contract: msgspec event structs, topic unions and the codec."""

from .codec import MAX_EVENT_BYTES, DecodeError, decode, encode, to_builtins, to_json
from .events import *  # noqa: F401,F403
from .events import SCHEMA_VERSION, Event, event_id
from .topics import ALL_TOPICS, TOPIC_UNIONS

__all__ = [
    "ALL_TOPICS", "DecodeError", "Event", "MAX_EVENT_BYTES", "SCHEMA_VERSION",
    "TOPIC_UNIONS", "decode", "encode", "event_id", "to_builtins", "to_json",
]
