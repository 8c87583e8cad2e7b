"""Drift monitor for the process reward model: re-score reference judgments, adjust weight.

A learned reward model can drift (retrained on bad labels, swapped for another file) while
still returning plausible numbers. The arbiter therefore re-scores a fixed **reference
set** of judgments every ``prm.check_every_segments`` segments (and before the first),
publishes the agreement as a ``drift-report`` event (topic ``telemetry``), and while the
pairwise accuracy is below ``prm.min_agreement`` pays the model at
``weight * prm.drifted_weight_factor``; the full weight returns as soon as a check agrees
again.

**Reference file** (JSONL; ``prm.reference``), two kinds of line, freely mixed::

    {"actions": ["chop tree", "craft"], "score": 0.9}          a segment and its score
    {"better": ["mine rock", "smelt ore"], "worse": ["polish tools", "polish tools"]}

Agreement:

- **pairwise accuracy**: over every pair of scored lines with different reference scores
  and every explicit (better, worse) pair, the share the model orders the same way (its
  segment scores; a tie counts one half);
- **rank correlation**: Spearman's rho between the model's and the reference scores of the
  scored lines (average ranks for ties); ``None`` when undefined (fewer than two scored
  lines, or either side constant).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gyre_async.rewards.prm import ProcessReward, ProcessRewardModel
from gyre_async.storage.jsonl import read_jsonl
from schemas import event_id
from schemas.config import ArbiterConfig
from schemas.events import DriftReport


@dataclass(frozen=True)
class Reference:
    scored: list[tuple[tuple[str, ...], float]]
    pairs: list[tuple[tuple[str, ...], tuple[str, ...]]]


@dataclass(frozen=True)
class Agreement:
    pairs: int
    pairwise_accuracy: float
    rank_correlation: float | None


def read_reference(path: str) -> Reference:
    scored, pairs = [], []

    def parse(row) -> None:
        if "better" in row:
            pairs.append((_actions(row["better"]), _actions(row["worse"])))
            return
        score = float(row["score"])
        if not math.isfinite(score):
            raise ValueError("score must be finite")
        scored.append((_actions(row["actions"]), score))

    read_jsonl(path, parse, '{"actions": [...], "score": x} or {"better": [...], "worse": [...]}')
    if len(pairs) + sum(1 for i, (_, a) in enumerate(scored)
                        for _, b in scored[i + 1:] if a != b) == 0:
        raise ValueError(f"{path}: no comparable judgments (need two scored lines with "
                         "different scores, or a better/worse pair)")
    return Reference(scored, pairs)


def _actions(value) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("actions must be a non-empty list of strings")
    return tuple(str(a) for a in value)


def pairwise_accuracy(model_scores: Sequence[float], reference_scores: Sequence[float],
                      preference_margins: Sequence[float] = ()) -> tuple[int, float]:
    """(pairs, accuracy): scored pairs with different reference scores, plus explicit pairs
    given as model margins (score(better) - score(worse)). Ties in the model count 1/2."""
    m = np.asarray(model_scores, dtype=float)
    r = np.asarray(reference_scores, dtype=float)
    dm = np.sign(m[:, None] - m[None, :])
    dr = np.sign(r[:, None] - r[None, :])
    upper = np.triu(np.ones_like(dr, dtype=bool), 1) & (dr != 0)
    hits = np.where(dm[upper] == dr[upper], 1.0, np.where(dm[upper] == 0, 0.5, 0.0))
    margins = np.sign(np.asarray(preference_margins, dtype=float))
    hits = np.concatenate([hits, np.where(margins > 0, 1.0, np.where(margins == 0, 0.5, 0.0))])
    return len(hits), float(hits.mean()) if len(hits) else math.nan


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for value in np.unique(x):  # average ranks over ties
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rho with average ranks; None where it is undefined."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return None
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / math.sqrt((rx * rx).sum() * (ry * ry).sum()))


def agreement(model: ProcessRewardModel, reference: Reference) -> Agreement:
    model_scores = [model.segment_score(a) for a, _ in reference.scored]
    margins = [model.segment_score(b) - model.segment_score(w) for b, w in reference.pairs]
    pairs, accuracy = pairwise_accuracy(model_scores, [s for _, s in reference.scored], margins)
    return Agreement(pairs, accuracy, spearman(model_scores, [s for _, s in reference.scored]))


def weight_in_force(base_weight: float, accuracy: float, min_agreement: float,
                    drifted_factor: float) -> tuple[float, bool]:
    """(weight, drifted): the full weight while the model agrees, lowered while it doesn't."""
    drifted = not accuracy >= min_agreement  # NaN (nothing comparable) counts as drifted
    return (base_weight * drifted_factor if drifted else base_weight), drifted


class DriftWatch:
    """When to re-check the model, and the weight in force (no bus; the arbiter drives it).

    The schedule counts segments the arbiter handled (the caller passes the count, the
    number of segments with a verdict in its log), so a replay of the same inputs checks at
    the same points; the weight in force is the latest ``drift-report``'s, folded by
    :meth:`apply` on a restart and live alike.
    """

    def __init__(self, config: ArbiterConfig, prm: ProcessReward):
        p = config.prm
        if p.check_every_segments < 1:
            raise ValueError("arbiter.prm.check_every_segments must be >= 1")
        self.config, self.prm = p, prm
        # read at start-up: a bad reference file fails when the arbiter starts, by name
        self.reference = read_reference(p.reference) if (p.reference and p.path) else None
        self.weight = p.weight
        self.last_checked = -1  # segments_scored of the report the weight comes from

    def apply(self, report: DriftReport) -> None:
        """Take the weight of a report no older than the one in force (reports are only
        made, and only count, while a reference set is configured)."""
        if self.reference is not None and report.segments_scored >= self.last_checked:
            self.weight, self.last_checked = report.weight, report.segments_scored

    def check(self, run_id: str, producer: str, handled: int) -> DriftReport | None:
        """Call before scoring a segment, with the number of segments handled before it: a
        report when a check is due (else None). The caller applies the report."""
        reference = self.reference
        if reference is None or handled % self.config.check_every_segments != 0:
            return None
        try:
            model = self.prm.model()
        except Exception:  # noqa: BLE001 - the segment's prm component reports it as reward-failed
            return None
        found = agreement(model, reference)
        weight, drifted = weight_in_force(self.config.weight, found.pairwise_accuracy,
                                          self.config.min_agreement,
                                          self.config.drifted_weight_factor)
        return DriftReport(
            event_id=event_id("drift-report", run_id, producer, handled),
            run_id=run_id, producer=producer, key="prm", model=self.config.path,
            reference=self.config.reference, segments_scored=handled,
            pairs=found.pairs, pairwise_accuracy=found.pairwise_accuracy,
            rank_correlation=found.rank_correlation, base_weight=self.config.weight,
            weight=weight, drifted=drifted)
