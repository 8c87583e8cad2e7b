"""aiokafka under uvloop, Gyre's default event loop, when a broker connection drops.

uvloop raises ``RuntimeError`` for a write to a closed transport where the stdlib loop
raises ``OSError``; aiokafka only catches the latter (aio-libs/aiokafka#1038), and after a
broker restart that killed the consumer's metadata task (the role stalled, then hung on
SIGTERM). ``gyre_async.bus.kafka_compat`` turns it into ``KafkaConnectionError``. These tests
drop a real connection to a real broker and write to it.
"""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaConnectionError
from aiokafka.protocol.metadata import MetadataRequest

import gyre_async.bus.kafka  # noqa: F401 - applies the fix, as every Kafka bus user does


async def _write_after_drop(bootstrap: str) -> BaseException | None:
    """Write to a connection whose transport closed before aiokafka noticed.

    That is the race a broker restart opens: the socket is gone, aiokafka's reader has not
    run yet. Here the transport is closed for real and aiokafka's writer put back, so the
    write meets a closed uvloop transport every time instead of now and then.
    """
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        node = next(iter(client.cluster.brokers())).nodeId
        conn = await client._get_conn(node)
        assert conn is not None and conn.connected()
        writer = conn._writer
        writer.transport.abort()
        while not writer.transport.is_closing() or conn._writer is not None:
            await asyncio.sleep(0.01)  # closed, and aiokafka has seen it...
        await asyncio.sleep(0.05)
        conn._writer = writer  # ...but now as if it had not yet
        try:
            await conn.send(MetadataRequest([]))
        except BaseException as exc:  # noqa: BLE001 - the type is what is checked
            return exc
        return None
    finally:
        await client.close()


@pytest.mark.kafka
def test_write_to_a_dropped_connection_is_a_retriable_connection_error(noida):
    err = uvloop.run(_write_after_drop(noida))
    assert isinstance(err, KafkaConnectionError), repr(err)
    assert err.retriable


@pytest.mark.kafka
def test_the_unfixed_error_is_what_uvloop_raises(noida, monkeypatch):
    """Without the fix the same write raises RuntimeError (so the test above can fail)."""
    from aiokafka.conn import AIOKafkaConnection

    monkeypatch.setattr(AIOKafkaConnection, "send", AIOKafkaConnection.send.__wrapped__)
    err = uvloop.run(_write_after_drop(noida))
    assert isinstance(err, RuntimeError) and "handler is closed" in str(err), repr(err)
