"""Loading and validating configuration files into ``schemas.config.Config``.

Two formats, one schema: TOML (what people write, ``ops/configs/*.toml``) and JSON, because
every run records the exact config it ran with as ``<run_dir>/config.json``. Accepting that
file makes a finished run's config directly reusable (``gyre replay ... --config
runs/q/config.json``) without a second, hand-kept copy. The format follows the file's suffix
(``.json``: JSON, anything else: TOML); both go through the same decoding and validation.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from gyre_async.bus.secrets import redact
from gyre_async.config_fields import explain
from gyre_async.errors import ConfigError
from schemas.config import Config
from schemas.events import MAX_STEPS_PER_SEGMENT


def load_config(path: str | os.PathLike | None) -> Config:
    """Read and validate a config (TOML, or a run's ``config.json``); errors name the file,
    the field and the fix."""
    if path is None:
        return Config()
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} not found (examples live in ops/configs/; a run "
                          "records its own as <run_dir>/config.json)")
    is_json = p.suffix.lower() == ".json"
    codec = msgspec.json if is_json else msgspec.toml
    data = p.read_bytes()
    try:
        cfg = codec.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        bounds = explain(exc, codec.decode(data))  # a size, count or duration out of range
        if bounds:
            raise ConfigError(f"{p}: {bounds}") from None
        raise ConfigError(
            f"{p}: {exc}. Fix that field (every field is documented in schemas/config.py; "
            "unknown fields are refused so typos don't pass silently)."
        ) from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{p}: not valid {'JSON' if is_json else 'TOML'}: {exc}") from None
    validate(cfg, str(p))
    return cfg


def validate(cfg: Config, where: str = "config") -> None:
    """Cross-field checks that types alone cannot express."""
    problems = []
    if cfg.bus.partitions < 1:
        problems.append("bus.partitions must be >= 1")
    if cfg.bus.max_message_bytes < 1024:
        problems.append("bus.max_message_bytes must be >= 1024")
    if cfg.segmenter.max_segment_steps > MAX_STEPS_PER_SEGMENT:
        problems.append(f"segmenter.max_segment_steps must be <= {MAX_STEPS_PER_SEGMENT} "
                        "(a segment's verdict carries one reward per step)")
    if cfg.sampler.group_size < 1:
        problems.append("sampler.group_size must be >= 1 (episodes per task; 1: no groups)")
    if cfg.learner.credit == "anchored" and cfg.sampler.group_size < 2:
        problems.append("learner.credit 'anchored' compares the members of a group: set "
                        "sampler.group_size >= 2 (and run.mode 'sync', so that a batch holds "
                        "whole groups)")
    if not 0.0 <= cfg.learner.fusion_max_weight <= 1.0:
        problems.append("learner.fusion_max_weight must be in [0, 1]")
    if not 0.0 < cfg.learner.divergence_lr_shrink <= 1.0:
        problems.append("learner.divergence_lr_shrink must be in (0, 1]")
    if cfg.learner.kl_to_base < 0:
        problems.append("learner.kl_to_base must be >= 0")
    if cfg.learner.kl_to_base > 0 and (cfg.policy.backend == "tiny" or cfg.policy.lora.rank < 1):
        problems.append("learner.kl_to_base needs policy.backend 'hf' with [policy.lora] rank "
                        ">= 1 (the base model is the policy with its adapters disabled)")
    if not 0.0 <= cfg.task.fail_episode_rate <= 1.0:
        problems.append("task.fail_episode_rate must be in [0, 1] (a share of training "
                        "episodes; 0: the fault drill is off)")
    if cfg.task.fail_within_steps < 0:
        problems.append("task.fail_within_steps must be >= 0 (0: the environment's step cap)")
    for check in _extra_checks:
        problems.extend(check(cfg))
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))


_extra_checks: list = []


def register_check(fn):
    """Let a role's module add validation for its own section."""
    _extra_checks.append(fn)
    return fn


def recorded_config(cfg: Config) -> bytes:
    """``cfg`` as a run records it in ``<run_dir>/config.json``: JSON, with the bus URL's
    secrets redacted (:func:`gyre_async.bus.secrets.redact`; ``${NAME}`` references are
    kept). Reused as a config, a redacted URL refuses to connect and says where the secret
    must come from; a URL that names its secret by variable works as it is."""
    shown = msgspec.structs.replace(cfg, bus=msgspec.structs.replace(
        cfg.bus, url=redact(cfg.bus.url)))
    return msgspec.json.format(msgspec.json.encode(shown), indent=2)


def bus_url(cfg: Config, override: str | None = None) -> str:
    """The bus for this run: --bus, else config, else $GYRE_BUS, else the embedded log."""
    url = override or cfg.bus.url or os.environ.get("GYRE_BUS", "")
    if url:
        return url
    return f"sqlite:///{os.path.abspath(os.path.join(cfg.run.run_dir, 'events.db'))}"
