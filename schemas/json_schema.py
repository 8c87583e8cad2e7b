"""JSON Schema of each topic's events, for readers that are not Gyre's own Python.

Generated from the msgspec structs (``msgspec.json.schema``), so it cannot drift from what
the actors encode; ``gyre schema`` prints it and docs/events.md is rendered from it. Events
travel as msgpack, not JSON: :data:`WIRE_FORMAT` says how a msgpack value maps onto the
JSON value the schema describes (the one type JSON lacks, raw bytes, is marked where it
occurs).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .events import SCHEMA_VERSION
from .topics import TOPIC_UNIONS

DIALECT = "https://json-schema.org/draft/2020-12/schema"

def _bytes_fields() -> list[str]:
    """``event-type.field`` of every field that holds raw bytes (msgspec: a base64 string)."""
    found = []
    for union in TOPIC_UNIONS.values():
        for struct in msgspec.json.schema(union)["$defs"].values():
            tag = struct["properties"].get("type", {}).get("enum", [struct["title"]])[0]
            found += [f"`{tag}.{name}`" for name, node in struct["properties"].items()
                      if node.get("contentEncoding") == "base64"]
    return sorted(set(found))


#: How one record of a Gyre topic reads with a plain Kafka client and a plain msgpack decoder.
WIRE_FORMAT = f"""\
Each record's value is one event: a msgpack map with string keys, which the schema
describes as the JSON value it decodes to. The field `type` names the event (its tag);
`schema_version` is {SCHEMA_VERSION} in this build (Gyre's own decoder refuses a newer one).
The record key is the event's `key` (UTF-8), which chooses the partition.

msgpack types map onto JSON as follows:

- str -> string; bool -> boolean; nil -> null; array -> array; map -> object (string keys);
- int (any width) -> integer;
- float (64-bit) -> number, never NaN or infinity; a field of type number may also arrive
  as a msgpack int when the producer's value was a whole number;
- bin (raw bytes) -> the one type JSON lacks: the schema gives it as a base64 string
  (`contentEncoding: base64`, marked `x-msgpack: bin`), while a msgpack decoder returns the
  bytes, so base64-encode them before validating. Fields of this type:
  {", ".join(_bytes_fields()) or "none"}.

A field with a default may be absent (events written before it existed); a field the schema
does not name may be present (events evolve by adding defaulted fields) and is to be
ignored. Checks beyond types (finite floats, lengths that agree, non-negative indices) are
made by Gyre's decoder (schemas/events.py), not by the schema."""


def topic_schema(topic: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the events on ``topic``: its event union.

    Raises ``KeyError`` for a topic that ``schemas/topics.py`` does not list.
    """
    generated = _mark_bytes(msgspec.json.schema(TOPIC_UNIONS[topic]))
    return {"$schema": DIALECT, "title": f"Gyre events on topic {topic!r}",
            "description": WIRE_FORMAT, **generated}


def all_topic_schemas() -> dict[str, dict[str, Any]]:
    """Every topic's schema, by topic name (each one self-contained)."""
    return {topic: topic_schema(topic) for topic in TOPIC_UNIONS}


def _mark_bytes(node: Any) -> Any:
    """Mark every ``bytes`` field (msgspec writes it as a base64 string) as msgpack ``bin``."""
    if isinstance(node, dict):
        out = {key: _mark_bytes(value) for key, value in node.items()}
        if out.get("contentEncoding") == "base64":
            out["x-msgpack"] = "bin"
            out["description"] = ("raw bytes: msgpack bin on the wire, base64 in JSON "
                                  "(as `gyre tail` prints it)")
        return out
    if isinstance(node, list):
        return [_mark_bytes(value) for value in node]
    return node
