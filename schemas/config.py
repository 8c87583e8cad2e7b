"""Typed configuration: one struct per actor, every field documented.

Config structs forbid unknown fields (a typo is an error that names the field), unlike
events. Files are TOML; ``load_config`` validates at start-up and says how to fix mistakes.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunSection(Strict):
    run_id: str = "run"
    """Names the run; stamped on every event; consumer groups are ``<run_id>.<role>``."""
    run_dir: str = "runs/run"
    """Directory for the event log, segment store, checkpoints, metrics and plots."""
    seed: int = 0
    """Master seed: every random choice of the run derives from it."""
    mode: Literal["async", "sync"] = "async"
    """async: sampling, scoring and learning overlap. sync: sample, then train (baseline)."""


class BusSection(Strict):
    url: str = ""
    """Bus URL. Empty: the embedded log at ``<run_dir>/events.db``. Or kafka://host:port."""
    partitions: int = 4
    """Partitions per topic (trajectory ids are the keys)."""
    max_message_bytes: int = 1_000_000
    """Events larger than this are refused at publish and dead-lettered at consume."""


class EchoConfig(Strict):
    delay_s: float = 0.0
    """Sleep per event (slows the echo to make crash tests hit mid-batch)."""
    fail_on_payload: str = ""
    """Raise a non-retriable error on this payload (exercises the dead-letter path)."""


class Config(Strict):
    run: RunSection = msgspec.field(default_factory=RunSection)
    bus: BusSection = msgspec.field(default_factory=BusSection)
    echo: EchoConfig = msgspec.field(default_factory=EchoConfig)
