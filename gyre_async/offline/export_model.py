"""``gyre export-model``: a run's product as a Hugging Face model directory.

A run of the ``hf`` backend trains a language model (or LoRA adapters on one); what leaves
the run is a plain model directory that ``transformers`` (and vLLM) load like any model:
``config.json``, ``model.safetensors`` (adapters merged into the base weights), the
tokenizer files, plus ``value_head.safetensors`` (the critic, for anyone continuing RL) and
``gyre_export.json`` (run, version, why that version, checkpoint sha256).

Which version: by default the run's best validated one (``<run_dir>/best.json``, written by
the keeper; see :mod:`gyre_async.core.keeper_best`), so a run that peaked earlier is not
handed over at its worst; ``--version final`` the last published version, ``--version N``
version N. A run without a best pointer exports its final version and says so. The checkpoint is read
only from the run's checkpoint roots (:mod:`gyre_async.storage.roots`), whatever the log
or the pointer names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import msgspec

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.config import bus_url, load_config
from gyre_async.errors import ConfigError
from gyre_async.folds.runlog import current_policy_version
from gyre_async.storage.atomic import atomic_write_text
from gyre_async.storage.errors import UntrustedAddress
from gyre_async.storage.roots import StorageRoots
from schemas.events import PolicyVersion
from schemas.topics import POLICY_VERSION


@dataclass(frozen=True)
class Chosen:
    version: int
    checkpoint: str
    checkpoint_hash: str
    chosen_by: str  # "best.json (keeper)", "final", "requested"


async def choose_version(run_dir: str, wanted: str, bus: str | None = None) -> Chosen:
    """The checkpoint ``wanted`` names: ``best``, ``final`` or a version number."""
    from gyre_async.core.keeper_best import BestVersion, best_path

    cfg = load_config(os.path.join(run_dir, "config.json"))
    roots = StorageRoots.from_config(msgspec.structs.replace(
        cfg, run=msgspec.structs.replace(cfg.run, run_dir=run_dir)))
    pointer = best_path(run_dir)
    if wanted == "best" and os.path.exists(pointer):
        with open(pointer, "rb") as f:
            best = msgspec.json.decode(f.read(), type=BestVersion)
        return Chosen(best.version, _in_roots(roots, best.checkpoint), best.checkpoint_hash,
                      f"best validated ({best.chosen_by}: success {best.success_rate:.3f})")
    async with open_bus(bus_url(cfg, bus), reader=True) as events:
        if wanted in ("best", "final"):
            latest = await current_policy_version(events, cfg.run.run_id, roots.trusts)
            if latest is None:
                raise ConfigError(f"{run_dir}: the run published no policy version")
            why = "final" if wanted == "final" else "final (the run has no best.json)"
            return Chosen(latest.version, roots.checkpoint_of(latest), latest.checkpoint_hash,
                          why)
        try:
            number = int(wanted)
        except ValueError:
            raise ConfigError(f"--version {wanted!r}: give best, final or a number") from None
        found: PolicyVersion | None = None
        async for _, event in read_events(events, [POLICY_VERSION], run_id=cfg.run.run_id):
            if isinstance(event, PolicyVersion) and event.version == number:
                found = event  # the last publication of that number (a rollback republishes)
    if found is None:
        raise ConfigError(f"{run_dir}: no policy version {number} was published")
    return Chosen(number, roots.checkpoint_of(found), found.checkpoint_hash, "requested")


def _in_roots(roots: StorageRoots, address: str) -> str:
    """best.json names the keeper's copy, or (settled at the run's end) the learner's file:
    either root, nothing else."""
    try:
        return roots.checkpoint(address, "keeper")
    except UntrustedAddress:
        return roots.checkpoint(address, "learner")


def save_model_dir(policy: Any, out: str) -> None:
    """``policy`` (an :class:`HFPolicy`) as a Hugging Face model directory: the language model
    with its adapters merged, its tokenizer, and the critic beside them
    (``value_head.safetensors``). The policy is unusable for training afterwards (its
    adapters are folded in)."""
    from safetensors.torch import save_file

    from gyre_async.policy.hf_policy import EXPORTED_VALUE_HEAD, VALUE_HEAD

    head = {k[len(VALUE_HEAD):]: v.detach().contiguous()
            for k, v in policy.state_dict().items() if k.startswith(VALUE_HEAD)}
    lm: Any = policy.merged_lm()
    os.makedirs(out, exist_ok=True)
    lm.save_pretrained(out, safe_serialization=True)
    hf_tokenizer = getattr(policy.tokenizer, "hf", None)
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(out)
    save_file(head, os.path.join(out, EXPORTED_VALUE_HEAD))


def export_model(run_dir: str, out: str, chosen: Chosen) -> dict:
    """Write the model directory for ``chosen``; returns what ``gyre_export.json`` says."""
    from gyre_async.compose import build_policy
    from gyre_async.policy.factory import load_weights
    from gyre_async.policy.hf_policy import HFPolicy

    cfg = load_config(os.path.join(run_dir, "config.json"))
    if cfg.policy.backend == "tiny":
        raise ConfigError("export-model writes Hugging Face models: this run trained the tiny "
                          "built-in transformer (policy.backend = 'tiny'); its checkpoints are "
                          f"under {cfg.run.run_dir}/checkpoints")
    policy = build_policy(msgspec.structs.replace(
        cfg, policy=msgspec.structs.replace(cfg.policy, backend="hf")))
    assert isinstance(policy, HFPolicy)
    load_weights(policy, chosen.checkpoint, chosen.checkpoint_hash)
    save_model_dir(policy, out)
    record = {"run_id": cfg.run.run_id, "version": chosen.version, "chosen_by": chosen.chosen_by,
              "checkpoint": chosen.checkpoint, "checkpoint_sha256": chosen.checkpoint_hash,
              "base_model": policy.model_path, "lora_merged": policy.lora is not None}
    atomic_write_text(os.path.join(out, "gyre_export.json"), json.dumps(record, indent=2))
    return record
