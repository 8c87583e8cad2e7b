"""LoRA adapters on a Hugging Face policy, through ``peft`` (no hand-written adapter code).

With ``[policy.lora] rank > 0`` the pretrained weights stay frozen and only the adapters
(and the policy's value head) train: a learner update touches a few hundred thousand
numbers instead of the whole model, and a checkpoint holds only those. An adapter means
nothing without the weights it was trained on, so every adapter checkpoint names its base:
the model directory and a fingerprint of the base weights (:func:`base_fingerprint`), and a
policy refuses an adapter made for another base with the two names in the error.

The adapters start as peft initialises them (``B = 0``): version 0 acts exactly as the base
model. ``peft``'s own state-dict helpers give the adapter tensors (names without the adapter
name, as ``save_pretrained`` writes them), and ``merge_and_unload`` folds them into the base
for export (:mod:`gyre_async.offline.export_model`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from schemas.config import LoraSection


def need_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ImportError("[policy.lora] needs peft: pip install 'gyre[llm]' (or set "
                          "policy.lora.rank = 0 for full fine-tuning)") from exc
    return peft


def base_fingerprint(lm: Any) -> str:
    """A short hash of the base model: its config and its input embedding's bytes (any two
    different bases differ there; hashing every weight would cost seconds per process)."""
    return _fingerprint(lm.config.to_dict(), lm.get_input_embeddings().weight)


def base_fingerprint_of_dir(model_dir: str | Path) -> str:
    """:func:`base_fingerprint` of the model saved in ``model_dir``, without building it
    (a vLLM sampler holds no torch copy of the model): its config through ``transformers``
    and the input embedding read from its safetensors files."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir)).to_dict()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            name = next((k for k in f.keys() if k.endswith("embed_tokens.weight")), None)
            if name is not None:
                return _fingerprint(config, f.get_tensor(name))
    raise ValueError(f"{model_dir}: no safetensors file holds an input embedding "
                     "(*embed_tokens.weight), so the base model cannot be fingerprinted")


def _fingerprint(config: dict[str, Any], embedding: torch.Tensor) -> str:
    config = dict(config)
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    digest = hashlib.sha256()
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(embedding.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def write_adapter_folder(folder: str | Path, tensors: Mapping[str, torch.Tensor],
                         metadata: Mapping[str, str]) -> Path:
    """Write adapter tensors and their LoRA settings (a Gyre LoRA checkpoint's header) as a
    ``peft`` adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), the
    form ``PeftModel.from_pretrained`` and vLLM's LoRA loader read."""
    from safetensors.torch import save_file

    settings = json.loads(metadata["lora"])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    need_peft().LoraConfig(
        r=settings["rank"], lora_alpha=settings["alpha"],
        target_modules=list(settings["target_modules"]), bias="none", task_type="CAUSAL_LM",
        base_model_name_or_path=metadata.get("base_model_path") or None,
    ).save_pretrained(str(folder))
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def apply_lora(lm: nn.Module, settings: LoraSection) -> nn.Module:
    """``lm`` wrapped by peft with adapters on ``settings.target_modules``; base frozen."""
    peft = need_peft()
    if settings.rank < 1:
        raise ValueError(f"policy.lora.rank {settings.rank}: give a rank >= 1 (0 is no LoRA)")
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                             lora_dropout=settings.dropout,
                             target_modules=list(settings.target_modules), bias="none",
                             task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(lm, config)
    except ValueError as exc:  # no module matched target_modules
        names = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules()
                        if isinstance(m, nn.Linear)})
        raise ValueError(f"policy.lora.target_modules {list(settings.target_modules)}: {exc} "
                         f"(this model's linear layers: {names})") from exc


def adapter_state(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only (what a LoRA checkpoint holds besides the value head)."""
    return dict(need_peft().get_peft_model_state_dict(lm))


def load_adapter_state(lm: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load adapter tensors; a missing or foreign tensor is a RuntimeError naming it."""
    expected = set(adapter_state(lm))
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise RuntimeError(f"adapter tensors do not fit this model's adapters: missing "
                           f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]} "
                           "(same policy.lora.rank and target_modules?)")
    need_peft().set_peft_model_state_dict(lm, dict(tensors))


def check_adapter_base(metadata: Mapping[str, str], address: str, fingerprint: str,
                       base_path: str) -> None:
    """Refuse a checkpoint whose header names another base model than ``fingerprint`` (the
    base this policy or engine holds, loaded from ``base_path``)."""
    from gyre_async.policy.base import CheckpointMismatch

    theirs = metadata.get("base_model")
    if theirs and theirs != fingerprint:
        raise CheckpointMismatch(
            f"checkpoint {address} holds LoRA adapters for base model {theirs} "
            f"({metadata.get('base_model_path', '?')}), this policy's base is "
            f"{fingerprint} ({base_path}): set policy.model to the base the "
            "adapters were trained on")


def lora_metadata(settings: LoraSection, fingerprint: str, base_path: str) -> dict[str, str]:
    return {"format": "gyre-hf-lora", "base_model": fingerprint, "base_model_path": base_path,
            "lora": json.dumps({"rank": settings.rank, "alpha": settings.alpha,
                                "target_modules": list(settings.target_modules)})}


def merge_adapter(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
                  scale: float) -> dict[str, torch.Tensor]:
    """``base`` (a Hugging Face state dict) with every adapter pair of ``adapter`` (peft's
    saved names) folded in: ``W + scale * B @ A``, ``scale = alpha / rank`` as peft scales
    it; what ``merge_and_unload`` computes, without building a model. Raises
    :class:`CheckpointMismatch` for an adapter that does not fit ``base``."""
    from gyre_async.policy.base import CheckpointMismatch

    merged = dict(base)
    suffix_a, suffix_b = ".lora_A.weight", ".lora_B.weight"
    stems = [k[:-len(suffix_a)] for k in adapter if k.endswith(suffix_a)]
    if not stems:
        raise CheckpointMismatch("checkpoint holds no adapter tensors")
    for stem in stems:
        name = stem.removeprefix("base_model.model.") + ".weight"
        if name not in base or stem + suffix_b not in adapter:
            raise CheckpointMismatch(f"adapter {stem} has no base weight {name} or no lora_B: "
                                     "not an adapter of this model")
        a = adapter[stem + suffix_a].to(torch.float32)
        b = adapter[stem + suffix_b].to(torch.float32)
        merged[name] = (base[name].to(torch.float32) + scale * (b @ a)).to(base[name].dtype)
    return merged
