"""Refuse non-finite numbers before they reach the optimizer.

One NaN in a reward, a behaviour log-prob, a value or an advantage turns the PPO loss into
NaN, ``optimizer.step`` writes NaN into every weight it touches, and the next policy version
(and every one after it) is garbage, silently. The bus already refuses NaN/inf in events at
decode (``schemas.events``); what can still be non-finite is what the learner computes or
reads outside the bus: segment arrays read from the store, the policy's values and log-probs
(a diverged or corrupted policy), the advantages and returns, the loss.

:func:`check_batch_finite` runs on a prepared batch before any optimizer step and raises
:class:`NonFiniteBatch`, whose ``reason`` names each field, how many of its numbers are
non-finite and which segments hold them. The learner turns it into a ``segment-dropped``
event per segment of the batch (reason included) instead of training on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gyre_async.errors import GyreError

FIX_HINT = ("fix: check the segment store for corrupt data and the policy for diverged "
            "weights (roll back to the last good checkpoint, lower learner.learning_rate)")


class NonFiniteBatch(GyreError):
    """A training batch holds NaN/inf; ``reason`` says where. Not retriable."""

    def __init__(self, reason: str, segment_ids: Sequence[str] = ()):
        super().__init__(reason)
        self.reason = reason
        self.segment_ids = list(segment_ids)


def count_non_finite(values) -> int:
    """How many entries of a tensor, array or (nested) list are NaN or +-inf."""
    if isinstance(values, torch.Tensor):
        return int((~torch.isfinite(values.detach())).sum())
    arr = np.asarray(values, dtype=np.float64) if not isinstance(values, np.ndarray) else values
    if arr.dtype.kind not in "fc":
        return 0
    return int((~np.isfinite(arr)).sum())


def non_finite_fields(fields: dict[str, object]) -> dict[str, int]:
    """``{name: count}`` of the fields that hold any NaN/inf (empty: all finite)."""
    counts = {name: count_non_finite(v) for name, v in fields.items()}
    return {name: c for name, c in counts.items() if c}


def check_batch_finite(per_segment: dict[str, dict[str, object]],
                       batch: dict[str, object], batch_ids: Sequence[str] = ()) -> None:
    """Raise :class:`NonFiniteBatch` if any per-segment input or batch-level tensor is
    non-finite.

    ``per_segment``: ``{segment_id: {field: numbers}}`` for what each segment brings
    (rewards, behaviour log-probs); ``batch``: tensors computed over the whole batch
    (values, advantages, returns, proximal log-probs); ``batch_ids``: the batch's segment
    ids, reported when only a batch-level tensor is bad.
    """
    problems: list[str] = []
    bad_segments: list[str] = []
    by_field: dict[str, list[str]] = {}
    for segment_id, fields in per_segment.items():
        for name in non_finite_fields(fields):
            by_field.setdefault(name, []).append(segment_id)
            if segment_id not in bad_segments:
                bad_segments.append(segment_id)
    for name, ids in by_field.items():
        problems.append(f"{name} in segments {ids[:5]}{' ...' if len(ids) > 5 else ''}")
    for name, count in non_finite_fields(batch).items():
        value = batch[name]
        total = value.numel() if isinstance(value, torch.Tensor) else "?"
        problems.append(f"{name} ({count} of {total} numbers)")
    if problems:
        ids = bad_segments or list(batch_ids) or list(per_segment)
        raise NonFiniteBatch(f"non-finite numbers refused before the optimizer: "
                             f"{'; '.join(problems)}; {FIX_HINT}", ids)


def check_loss_finite(loss: torch.Tensor, segment_ids: Sequence[str]) -> None:
    """Raise :class:`NonFiniteBatch` if the loss about to be back-propagated is NaN/inf."""
    if not bool(torch.isfinite(loss.detach()).all()):
        raise NonFiniteBatch(f"non-finite loss ({float(loss.detach())}) refused before the "
                             f"optimizer step; {FIX_HINT}", segment_ids)
