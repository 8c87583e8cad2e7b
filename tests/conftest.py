"""Shared fixtures: real bus backends (the embedded log, and Kafka-protocol brokers).

Brokers are real processes started on loopback through ``ops/brokers.py`` (the same script
``.ci/run`` and the benchmarks use) and stopped by PID at the end of the session. noida-db
serves the general contract; Tansu serves multi-member group tests (noida-db can leave a
group stuck when a commit races a rebalance).
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ops"))


def _broker(kind: str, tmp_path_factory):
    from brokers import start_broker

    env = os.environ.get(f"GYRE_TEST_{kind.upper()}")  # reuse a broker .ci/run started
    if env:
        yield env
        return
    data = tmp_path_factory.mktemp(f"{kind}-data")
    broker = start_broker(kind, data_dir=str(data), log_path=str(data / "broker.log"))
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def noida(tmp_path_factory):
    yield from _broker("noida", tmp_path_factory)


@pytest.fixture(scope="session")
def tansu(tmp_path_factory):
    yield from _broker("tansu", tmp_path_factory)


@pytest.fixture
def unique():
    return uuid.uuid4().hex[:10]


@pytest.fixture(params=["embedded", "kafka"])
def bus_url(request, tmp_path):
    """A bus URL per backend: the embedded log, and noida-db over the Kafka protocol."""
    if request.param == "embedded":
        return f"sqlite:///{tmp_path}/events.db"
    return f"kafka://{request.getfixturevalue('noida')}"


@pytest.fixture(params=["embedded", "kafka-tansu"])
def group_bus_url(request, tmp_path):
    """For multi-member consumer-group tests: the embedded log, and Tansu."""
    if request.param == "embedded":
        return f"sqlite:///{tmp_path}/events.db"
    return f"kafka://{request.getfixturevalue('tansu')}"
