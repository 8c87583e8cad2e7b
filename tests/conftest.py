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
# as `python ops/bench/x.py` has it: the benches' shared module (_common) and their siblings
sys.path.append(str(ROOT / "ops" / "bench"))


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
async def scratch_bus(tmp_path):
    """An embedded bus in the test's folder, to run one actor on (tests/scratch.py)."""
    from scratch import ScratchBus

    from gyre_async.bus import open_bus

    async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
        yield ScratchBus(bus)


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


def load_script(relative: str):
    """A script of the repository (``ops/bench/*.py``: not a package) as a module, so a test
    can call its functions."""
    import importlib.util

    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    # registered before it runs, as an import would: a dataclass in it looks its module up
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


TINY_TOML = ROOT / "ops" / "configs" / "tiny.toml"


class TinyConfig:
    """The tiny test config (``ops/configs/tiny.toml``) with per-test overrides.

    One builder for every test that runs the loop small: overrides are given per section
    (``tiny.config(run={"run_id": "x"}, learner={"max_versions": 16})``, merged as
    ``ops/bench/_common.py:config_data`` merges a bench's); the run directory
    defaults to the test's own temporary folder. ``config`` gives the validated
    :class:`schemas.config.Config`, ``write`` the same thing as a TOML file (for commands
    that take a path), so no test patches the file's text by hand.
    """

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path

    def sections(self, **overrides: dict) -> dict:
        from _common import config_data  # ops/bench/_common.py: the benches' builder too

        data = config_data(TINY_TOML, run={"run_dir": str(self.tmp_path / "run")})
        return config_data(data, **overrides)

    def write(self, path: Path | None = None, **overrides: dict) -> Path:
        import tomli_w

        path = path or self.tmp_path / "tiny.toml"
        path.write_text(tomli_w.dumps(self.sections(**overrides)))
        return path

    def config(self, **overrides: dict):
        from gyre_async.config import load_config

        return load_config(self.write(**overrides))


@pytest.fixture
def tiny(tmp_path) -> TinyConfig:
    """Builds the tiny test config with overrides (see :class:`TinyConfig`)."""
    return TinyConfig(tmp_path)
