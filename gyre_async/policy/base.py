"""The policy interface the sampler and the learner program against, and checkpoint files.

Log-probabilities, decided once for every backend:

- ``Action.logprobs`` are the **behaviour** log-probs: of each sampled token under the
  distribution it was actually drawn from (after temperature and top-p, renormalised). PPO's
  importance ratio needs exactly these for the "old" policy. Greedy decoding draws from a
  point mass, so its behaviour log-probs are 0.
- ``Action.policy_logprobs`` are the same tokens under the raw policy (temperature 1, no
  top-p): what :meth:`Policy.evaluate` returns for them with the same weights (the tests
  check equality to 1e-5). With temperature 1 and top-p 1 both lists are equal.

Generation stops at ``<eos>`` or after ``max_action_tokens``; an emitted ``<eos>`` is part
of ``Action.tokens`` (and has a log-prob), so the learner also trains the decision to stop.

Checkpoints are safetensors files written atomically (temporary file, fsync, rename, fsync
of the directory): a reader sees the old file or the new one, never half of one. ``save``
returns the file's sha256, which the ``policy-version`` event carries; ``load`` checks it
and raises :class:`CheckpointMismatch` when the bytes are not the published ones.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import struct
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


class CheckpointMismatch(Exception):
    """A checkpoint file is not the one expected (hash, format or shapes differ)."""


@dataclass(frozen=True)
class SamplingParams:
    """How actions are drawn. ``greedy`` overrides temperature and top-p."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_action_tokens: int = 4
    greedy: bool = False

    def __post_init__(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError("SamplingParams: temperature must be > 0 (or set greedy=True)")
        if not 0 < self.top_p <= 1:
            raise ValueError("SamplingParams: top_p must be in (0, 1]")
        if self.max_action_tokens < 1:
            raise ValueError("SamplingParams: max_action_tokens must be >= 1")


@dataclass(frozen=True)
class Action:
    """One generated action. ``tokens`` include ``<eos>`` when it was emitted."""

    tokens: list[int]
    logprobs: list[float]          # behaviour log-probs (as sampled), see module docstring
    policy_logprobs: list[float]   # raw policy log-probs (temperature 1)
    text: str                      # decoded without special tokens
    policy_version: int = 0


@dataclass
class EvalOutput:
    """Learner-side evaluation of given actions; tensors carry grad.

    ``logprobs`` and ``entropy`` are [B, A] (A = longest action), zero where ``mask`` is 0;
    ``values`` [B] is the value of each context (the state before acting).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


class Policy(abc.ABC):
    """A text policy with a value head. Pure library: no bus, no asyncio.

    ``act_batch`` is called from a worker thread (``asyncio.to_thread``); implementations
    serialise it against weight loading, so a new version never lands mid-batch.
    """

    version: int = 0

    @abc.abstractmethod
    def act_batch(self, contexts: list[list[int]], params: SamplingParams,
                  seed: int | None = None) -> list[Action]:
        """Generate one action per context (token ids, e.g. from ContextBuilder)."""

    @abc.abstractmethod
    def evaluate(self, contexts: list[list[int]], actions: list[list[int]]) -> EvalOutput:
        """Log-probs, entropies and values for given actions, with grad (for PPO)."""

    @abc.abstractmethod
    def values(self, contexts: list[list[int]]) -> torch.Tensor:
        """Values of contexts, [B], without grad (bootstrapping at segment boundaries)."""

    @abc.abstractmethod
    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]: ...

    @abc.abstractmethod
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None: ...

    def checkpoint_metadata(self) -> dict[str, str]:
        """Strings stored in the checkpoint header (config, tokenizer, version)."""
        return {"version": str(self.version)}

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write weights atomically to ``path``; return the file's sha256 hex digest."""
        from safetensors.torch import save

        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        return write_atomic(path, save(tensors, metadata=self.checkpoint_metadata()))

    def load(self, path: str | os.PathLike[str], expected_sha256: str | None = None) -> None:
        """Load weights from ``path``, verifying its sha256 first when one is given."""
        tensors, metadata = read_checkpoint(path, expected_sha256)
        try:
            self.load_state_dict(tensors)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointMismatch(f"checkpoint {path} does not fit this policy: {exc}") from exc
        self.version = int(metadata.get("version", self.version))


def write_atomic(path: str | os.PathLike[str], data: bytes) -> str:
    """Write ``data`` to ``path`` so readers see all of it or none; return its sha256."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return hashlib.sha256(data).hexdigest()


def read_checkpoint(path: str | os.PathLike[str], expected_sha256: str | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and header metadata of a safetensors checkpoint, hash-checked."""
    from safetensors.torch import load

    with open(path, "rb") as f:
        data = f.read()
    actual = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and actual != expected_sha256.lower():
        raise CheckpointMismatch(
            f"checkpoint {path} has sha256 {actual} but {expected_sha256} was expected: the "
            "file is corrupt, partly written, or not the published version; refusing to load")
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        header: dict[str, Any] = json.loads(data[8:8 + header_len])
        tensors = load(data)
    except Exception as exc:  # noqa: BLE001 - any parse failure means "not a checkpoint"
        raise CheckpointMismatch(f"checkpoint {path} is not a readable safetensors file: "
                                 f"{type(exc).__name__}: {exc}") from exc
    return tensors, dict(header.get("__metadata__") or {})
