"""A reader of a run's log never makes one: ``gyre inspect``/``replay``/``topics``/``archive``/``tail``
and ``open_bus(..., reader=True)`` on an embedded log that does not exist fail with an error
that names the path, and leave nothing on disk (an empty ``events.db`` left where a run is
about to start makes that run refuse its directory)."""

from __future__ import annotations

import asyncio
import os

import pytest

from gyre_async.bus import NoEventLog, open_bus
from gyre_async.cli.main import main
from gyre_async.errors import ConfigError


def test_open_bus_as_reader_refuses_a_missing_log_and_creates_nothing(tmp_path):
    missing = tmp_path / "not-started" / "events.db"
    with pytest.raises(NoEventLog, match="no event log at"):
        open_bus(f"sqlite:///{missing}", reader=True)
    assert not missing.parent.exists()
    assert issubclass(NoEventLog, ConfigError)  # the CLI's exit status 2 with the message


def test_open_bus_as_reader_reads_an_existing_log(tmp_path):
    path = tmp_path / "events.db"

    async def write_then_read() -> list[bytes]:
        async with open_bus(f"sqlite:///{path}") as bus:  # the run: makes its log
            await bus.create_topics(["t"], 1)
            await bus.publish("t", [(b"k", b"v")])
        async with open_bus(f"sqlite:///{path}", reader=True) as bus:
            return [t.name.encode() for t in await bus.topics()]

    assert asyncio.run(write_then_read()) == [b"t"]


@pytest.mark.parametrize("argv", [
    ["inspect", "traj-1"],
    ["replay", "learner"],
    ["topics"],
    ["archive", "--out", "ARCHIVE"],
    ["tail", "policy-version"],
])
def test_cli_readers_on_a_missing_run_fail_clearly_and_create_nothing(tmp_path, capsys, argv):
    run_dir = tmp_path / "run"
    url = f"sqlite:///{run_dir}/events.db"
    argv = [a.replace("ARCHIVE", str(tmp_path / "archive")) for a in argv]
    assert main([*argv, "--bus", url]) == 2
    err = capsys.readouterr().err
    assert "no event log at" in err and str(run_dir) in err
    assert not os.path.exists(run_dir)


def test_tail_follow_waits_for_the_run_and_creates_nothing(tmp_path, capsys):
    from argparse import Namespace

    from gyre_async.cli.tail import tail

    path = tmp_path / "run" / "events.db"
    args = Namespace(topic="policy-version", start="0", follow=True, max=0)

    async def waited() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(tail(f"sqlite:///{path}", args), 1.5)

    asyncio.run(waited())
    assert "waiting for the run to create" in capsys.readouterr().err
    assert not path.parent.exists()
