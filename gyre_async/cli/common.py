"""What several commands share: the config a command names, with ``--run-dir`` applied."""

from __future__ import annotations

import argparse

import msgspec

from gyre_async.config import load_config
from schemas.config import Config


def config_of(args: argparse.Namespace) -> Config:
    """The config of ``--config``/``CONFIG`` (the defaults without one), ``--run-dir`` applied."""
    cfg = load_config(getattr(args, "config", None))
    if getattr(args, "run_dir", None):
        cfg = msgspec.structs.replace(
            cfg, run=msgspec.structs.replace(cfg.run, run_dir=args.run_dir)
        )
    return cfg
