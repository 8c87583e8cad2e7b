"""Echo: a deterministic diagnostic actor (bus checks, replay audits, crash tests).

consumes: probe-in (Probe)   emits: probe-out (Probe, same seq, payload echoed)

Its output id is derived from its input id, so a redelivered probe yields the same output
event and consumers can drop the duplicate.
"""

from __future__ import annotations

import asyncio

from gyre_async.runtime.actor import Actor, Emit
from schemas import event_id
from schemas.config import EchoConfig
from schemas.events import Probe
from schemas.topics import PROBE_IN, PROBE_OUT


def echo(probe: Probe, producer: str) -> Probe:
    """The pure core: one probe in, its echo out."""
    return Probe(
        event_id=event_id("echo", probe.event_id),
        run_id=probe.run_id,
        producer=producer,
        key=probe.key,
        seq=probe.seq,
        payload=probe.payload,
    )


class EchoActor(Actor):
    role = "echo"
    consumes = (PROBE_IN,)
    emits = (PROBE_OUT,)

    def __init__(self, config: EchoConfig):
        self.config = config

    async def handle(self, event, record):
        match event:
            case Probe():
                if self.config.delay_s:
                    await asyncio.sleep(self.config.delay_s)
                if self.config.fail_on_payload and event.payload == self.config.fail_on_payload:
                    raise ValueError(f"refusing payload {event.payload!r}")
                return [Emit(PROBE_OUT, echo(event, self.runner.name))]
        return []
