"""Event bus: one interface (``Bus``), two real backends chosen by URL.

- ``sqlite:///path/to/events.db`` (or a bare path): the embedded default, no server.
- ``kafka://host:port[,host:port]?security_protocol=SSL&...``: aiokafka on a Kafka cluster.
"""

from gyre_async.bus.base import (
    Bus,
    BusError,
    BusUnreachable,
    Consumer,
    MessageTooLarge,
    Record,
    TopicInfo,
    partition_for,
)
from gyre_async.bus.url import BusURLError, NoEventLog, open_bus

__all__ = [
    "Bus", "BusError", "BusURLError", "BusUnreachable", "NoEventLog", "Consumer", "MessageTooLarge", "Record",
    "TopicInfo", "open_bus", "partition_for",
]
