"""Process reward model: a small torch model that scores each step of a segment.

It reads the per-step action text of a segment (``SegmentClosed.actions``), so it needs no
tokenizer file and nothing downloaded: every step becomes a bag of hashed features (the
action's words, the action as a whole, and the pair (previous action, action), which is
what tells a repeated no-op from a step of a plan). An ``EmbeddingBag`` and a two-layer MLP
turn each bag into a step logit; a segment's logit is the mean of its steps' logits.

Scores: step score ``s_t = tanh(logit_t / 2)`` in [-1, 1] (= 2 * sigmoid - 1). The arbiter
pays ``weight * s_t / n`` at each step, so a segment's process reward is ``weight`` times
its mean step score, whatever its length.

**Labels file** (JSONL, one labelled segment per line)::

    {"actions": ["chop tree", "cut stone", "craft"], "label": 1.0}
    {"actions": ["polish tools", "polish tools", "sweep floor"], "label": 0.0, "segment_id": "s9"}

``label`` in [0, 1] is how good the segment's process is (1 good, 0 bad); fractional labels
are soft targets. Extra keys are ignored. :func:`labelled_segment` turns a ``SegmentClosed``
event into such a record.

**Weights file**: safetensors (never pickle), tensors ``embed.weight``, ``hidden.weight``,
``hidden.bias``, ``out.weight``, ``out.bias`` and metadata ``format = gyre-prm``,
``version = 1``, ``buckets``, ``dim``, ``hidden``. Train and save from the command line::

    python -m gyre_async.rewards.prm LABELS.jsonl OUT.safetensors [--epochs 200]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gyre_async.storage.atomic import atomic_write_bytes
from gyre_async.storage.jsonl import RowError, read_jsonl
from schemas.events import SegmentClosed

FORMAT = "gyre-prm"
VERSION = "1"


class PrmLoadError(RuntimeError):
    """The weights file is missing, unreadable or not a Gyre process reward model."""


@dataclass(frozen=True)
class LabelledSegment:
    actions: tuple[str, ...]
    label: float


def labelled_segment(seg: SegmentClosed, label: float) -> dict:
    """One line of a labels file, from a segment event."""
    return {"segment_id": seg.segment_id, "actions": list(seg.actions), "label": float(label)}


def read_labels(path: str) -> list[LabelledSegment]:
    def parse(row) -> LabelledSegment:
        actions, label = row["actions"], float(row["label"])
        if not (isinstance(actions, list) and actions and 0.0 <= label <= 1.0):
            raise RowError("actions must be a non-empty list and label in [0, 1]")
        return LabelledSegment(tuple(str(a) for a in actions), label)

    return read_jsonl(path, parse, '{"actions": [...], "label": 0..1}')


def _bucket(text: str, buckets: int) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % buckets


def step_features(actions: Sequence[str], buckets: int) -> list[list[int]]:
    """Hashed feature ids per step (stable across processes, unlike ``hash``)."""
    out = []
    prev = "<start>"
    for action in actions:
        norm = " ".join(action.lower().split())
        feats = [f"w:{w}" for w in norm.split()] + [f"a:{norm}", f"p:{prev}>{norm}"]
        if norm == prev:
            feats.append("repeat")
        out.append([_bucket(f, buckets) for f in feats])
        prev = norm
    return out


class ProcessRewardModel(nn.Module):
    def __init__(self, buckets: int = 1024, dim: int = 16, hidden: int = 16):
        super().__init__()
        self.buckets, self.dim, self.hidden_size = buckets, dim, hidden
        self.embed = nn.EmbeddingBag(buckets, dim, mode="mean")
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, 1)

    def step_logits(self, actions: Sequence[str]) -> torch.Tensor:
        return self._logits(step_features(actions, self.buckets))

    def _logits(self, feats: list[list[int]]) -> torch.Tensor:
        flat = torch.tensor([i for f in feats for i in f], dtype=torch.long)
        offsets = torch.tensor([0] + [len(f) for f in feats[:-1]], dtype=torch.long).cumsum(0)
        h = torch.tanh(self.hidden(self.embed(flat, offsets)))
        return self.out(h).squeeze(-1)

    @torch.no_grad()
    def step_scores(self, actions: Sequence[str]) -> list[float]:
        """Per-step scores in [-1, 1] (tanh; rounds to +-1 only when saturated)."""
        if not actions:
            return []
        return torch.tanh(self.step_logits(actions) / 2).tolist()

    def segment_score(self, actions: Sequence[str]) -> float:
        scores = self.step_scores(actions)
        return sum(scores) / len(scores) if scores else 0.0


def train_prm(examples: Iterable[LabelledSegment], *, epochs: int = 200, lr: float = 0.02,
              seed: int = 0, buckets: int = 1024, dim: int = 16,
              hidden: int = 16) -> ProcessRewardModel:
    """Fit a model to labelled segments: full-batch Adam, binary cross-entropy on each
    segment's logit (the mean of its step logits)."""
    data = [e for e in examples if e.actions]
    if not data:
        raise ValueError("train_prm needs at least one labelled segment with actions")
    torch.manual_seed(seed)
    model = ProcessRewardModel(buckets, dim, hidden)
    feats = [f for e in data for f in step_features(e.actions, buckets)]
    owner = torch.tensor([i for i, e in enumerate(data) for _ in e.actions])
    counts = torch.tensor([float(len(e.actions)) for e in data])
    labels = torch.tensor([e.label for e in data])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses to thread hand-offs
    try:
        for _ in range(epochs):
            step = model._logits(feats)
            seg_logit = torch.zeros(len(data)).index_add(0, owner, step) / counts
            loss = nn.functional.binary_cross_entropy_with_logits(seg_logit, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return model


def save_prm(model: ProcessRewardModel, path: str) -> None:
    """Write the model atomically: an arbiter loading it never sees half a file."""
    from safetensors.torch import save

    atomic_write_bytes(path, save({k: v.contiguous() for k, v in model.state_dict().items()},
                                  metadata={"format": FORMAT, "version": VERSION,
                                            "buckets": str(model.buckets), "dim": str(model.dim),
                                            "hidden": str(model.hidden_size)}))


def load_prm(path: str) -> ProcessRewardModel:
    """Load weights written by :func:`save_prm`; every failure says what to do."""
    from safetensors import safe_open

    if not os.path.exists(path):
        raise PrmLoadError(f"process reward model {path!r} not found: train one with "
                           "`python -m gyre_async.rewards.prm LABELS OUT` or clear arbiter.prm.path")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types on bad files
        raise PrmLoadError(f"process reward model {path!r} is not a readable safetensors "
                           f"file ({exc}); retrain it or restore the file") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise PrmLoadError(f"{path!r} is not a {FORMAT} v{VERSION} file (metadata {meta})")
    try:
        model = ProcessRewardModel(int(meta["buckets"]), int(meta["dim"]), int(meta["hidden"]))
        model.load_state_dict(tensors)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise PrmLoadError(f"process reward model {path!r} has unexpected tensors: {exc}") from None
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise PrmLoadError(f"process reward model {path!r} has non-finite weights; retrain it")
    model.eval()
    return model


class ProcessReward:
    """The arbiter's handle on the model: loads lazily, reloads when the file changes.

    A load failure is raised to the caller every time (so every segment reports it as
    ``reward-failed``) until the file is fixed; nothing is cached as "score 0".
    """

    def __init__(self, path: str, weight: float):
        self.path, self.weight = path, weight
        self._model: ProcessRewardModel | None = None
        self._stamp: tuple[float, int] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def model(self) -> ProcessRewardModel:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime, st.st_size)
        except OSError:
            stamp = None
        if self._model is None or stamp != self._stamp:
            self._model, self._stamp = None, None
            self._model = load_prm(self.path)
            self._stamp = stamp
        return self._model

    def per_step(self, seg: SegmentClosed, weight: float) -> list[float]:
        """``weight * s_t / n`` per step; raises on any failure (caller reports it)."""
        n = seg.step_end - seg.step_start
        if len(seg.actions) != n:
            raise ValueError(f"segment carries {len(seg.actions)} action texts for {n} steps; "
                             "the process reward model scores action text")
        scores = self.model().step_scores(seg.actions)
        if not all(math.isfinite(s) for s in scores):
            raise ValueError(f"non-finite process score {scores}")
        return [weight * s / n for s in scores]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train a process reward model from labelled "
                                            "segments (JSONL) and save it as safetensors.")
    p.add_argument("labels")
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    examples = read_labels(args.labels)
    model = train_prm(examples, epochs=args.epochs, seed=args.seed)
    save_prm(model, args.out)
    print(json.dumps({"trained_on": len(examples), "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
