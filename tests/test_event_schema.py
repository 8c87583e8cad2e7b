"""Readers outside Gyre: `gyre schema` describes what is on the wire, and a client that is not
Gyre's reads a live run with it.

- docs/events.md is what `gyre schema --markdown` prints (so the page cannot drift);
- every topic's schema is a valid JSON Schema, and events Gyre encodes, decoded by the
  plain ``msgpack`` package, validate against it (raw bytes base64-encoded, as it says);
- a short run on a Kafka-protocol broker, read back with ``kcat`` (librdkafka, not aiokafka)
  and decoded with ``msgpack``: every ``scored`` event of the run validates against
  `gyre schema scored`, and kcat sees exactly the events Gyre's own reader sees.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import msgpack
import pytest

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.cli.main import main
from gyre_async.cli.schema import render_markdown
from gyre_async.runtime.loop import run_loop
from schemas import encode, event_id
from schemas.events import DeadLetter, Milestone, RewardFailed, Scored, TrajectoryStep
from schemas.json_schema import topic_schema
from schemas.topics import ALL_TOPICS, DEAD_LETTER, SCORED, TRAJECTORY_STEP

EVENTS_MD = Path(__file__).resolve().parents[1] / "docs" / "events.md"


def test_docs_events_md_is_what_gyre_schema_prints():
    assert EVENTS_MD.read_text() == render_markdown(), (
        "docs/events.md differs from the event structs: regenerate it with "
        "`gyre schema --markdown > docs/events.md`")


def test_gyre_schema_prints_one_topic_or_every_topic(capsys):
    assert main(["schema", SCORED]) == 0
    assert json.loads(capsys.readouterr().out) == topic_schema(SCORED)
    assert main(["schema"]) == 0
    assert list(json.loads(capsys.readouterr().out)) == list(ALL_TOPICS)


def _plain(data: bytes) -> object:
    """What a reader outside Gyre holds: msgpack decoded by the msgpack package, with raw
    bytes base64-encoded as the schema's wire notes say."""
    value = msgpack.unpackb(data, raw=False)
    return {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
            for k, v in value.items()}


def test_events_gyre_encodes_validate_against_their_topic_schema():
    for topic in ALL_TOPICS:
        jsonschema.Draft202012Validator.check_schema(topic_schema(topic))
    common = {"run_id": "r", "producer": "p"}
    samples = [
        (SCORED, Scored(event_id=event_id("s"), segment_id="s", trajectory_id="t", task_id="k",
                        address="a", content_hash="h", step_start=0, step_end=2,
                        min_policy_version=0, trajectory_done=True, success=False,
                        components={"outcome": 1, "rule": -0.5}, step_rewards=[0.0, 1],
                        total=0.5, decided_by="outcome", **common)),
        (SCORED, RewardFailed(event_id=event_id("f"), segment_id="s", component="prm",
                              reason="timeout", **common)),
        (TRAJECTORY_STEP, TrajectoryStep(
            event_id=event_id("t"), trajectory_id="t", task_id="k", step_index=0,
            policy_version=0, context_tokens=[1, 2], action_tokens=[3], action_logprobs=[-0.1],
            milestones=[Milestone(name="m", proof="inventory.axe=1")], **common)),
        (DEAD_LETTER, DeadLetter(event_id=event_id("d"), actor="a", source_topic=SCORED,
                                 source_partition=0, source_offset=7, reason="malformed",
                                 original=b"\xff\x00not msgpack", **common)),
    ]
    for topic, event in samples:
        validator = jsonschema.Draft202012Validator(topic_schema(topic))
        validator.validate(_plain(encode(event)))
        wrong = {**_plain(encode(event)), "run_id": 3}  # a field of the wrong type
        assert not validator.is_valid(wrong), (topic, event)


def _kcat_values(bootstrap: str, topic: str) -> list[bytes]:
    """Every record value of ``topic``, as kcat (librdkafka) reads it from the beginning.

    Each record is printed as its length, a newline, then the value's bytes, so a binary
    value comes through intact whatever bytes it holds.
    """
    kcat = shutil.which("kcat")
    if kcat is None:
        pytest.fail("kcat (a Kafka client that is not Gyre's) is not installed: run "
                    "`bash ops/install_kcat.sh` (Debian's package: apt-get install kcat); "
                    "ops/test.sh installs it")
    out = subprocess.run([kcat, "-C", "-q", "-b", bootstrap, "-t", topic, "-o", "beginning",
                          "-e", "-f", "%S\n%s"], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    values, pos, data = [], 0, out.stdout
    while pos < len(data):
        newline = data.index(b"\n", pos)
        size = int(data[pos:newline])
        pos = newline + 1 + max(size, 0)
        if size >= 0:  # -1: a null value (a tombstone): none is an event
            values.append(data[newline + 1:pos])
    return values


@pytest.mark.kafka
@pytest.mark.slow
def test_a_client_outside_gyre_reads_a_live_runs_scored_events(tiny, tmp_path, noida):
    run_id = f"schema-{tmp_path.name[-12:]}"
    cfg = tiny.config(run={"run_id": run_id}, evaluator={"episodes": 1},
                      learner={"max_versions": 1, "batch_steps": 64, "minibatch_steps": 64})
    url = f"kafka://{noida}"
    asyncio.run(run_loop(cfg, bus_override=url))
    printed = subprocess.run([sys.executable, "-m", "gyre_async.cli", "schema", SCORED],
                             capture_output=True, check=True, timeout=120)
    validator = jsonschema.Draft202012Validator(json.loads(printed.stdout))

    ours = []
    for value in _kcat_values(noida, SCORED):
        try:  # the topic is shared by every test on this broker, bad records included
            event = msgpack.unpackb(value, raw=False)
        except (ValueError, msgpack.UnpackException):
            continue
        if isinstance(event, dict) and event.get("run_id") == run_id:
            ours.append(event)
    for event in ours:
        validator.validate(event)  # a failure names the field and the rule
    assert sum(event["type"] == "scored" for event in ours) > 0

    async def seen_by_gyre() -> list[str]:
        async with open_bus(url) as bus:
            return [event.event_id async for _, event in
                    read_events(bus, [SCORED], run_id=run_id)]

    assert sorted(event["event_id"] for event in ours) == sorted(asyncio.run(seen_by_gyre()))
