"""The run's product: its best validated version, as a pointer file and in ``summary.json``.

A run that peaked earlier must not be handed over at its worst: its last version can sit
below a version it validated earlier (a collapse the keeper rolled back too late, or one
within the keeper's noise). So the run directory names its best version in
``<run_dir>/best.json`` (:class:`BestVersion`: the version, its validation, and which
weights to load with their sha256), and ``summary.json`` reports ``final`` and ``best``
side by side.

**Who writes the pointer.** The keeper, whenever its ``best`` slot changes, in every kind of
run (``gyre run`` and one process per role alike): it points at the keeper's own verified
copy, written before the copy it replaces is removed, so the pointer never names a deleted
file (``checkpoint_hash`` is that copy's sha256; ``source_checkpoint`` is the learner's
original). The file is replaced atomically (:mod:`gyre_async.storage.atomic`): a reader
sees the old pointer or the new one.

**Settled at the end of ``gyre run``.** The keeper is not waited for when a run ends, and
the run's final evaluation comes after it has stopped, so the loop settles the pointer with
:func:`settle_best`: the best of the keeper's choice and every evaluation of the run, by
the keeper's own order (:func:`~gyre_async.core.keeper_rules.is_better`: success rate,
then mean score; the earlier wins ties, and the keeper's copy wins a tie with the version
it holds). A version chosen there that the keeper never kept points at the learner's
checkpoint (``chosen_by = "run end"``). Any evaluated version counts, whatever its
lineage: the keeper ignores evaluations while a rollback is on its way, but a version that
validated best is still the run's best product.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import msgspec
import structlog

from gyre_async.storage.atomic import atomic_write_bytes
from schemas.events import EvalResult, PolicyVersion

log = structlog.get_logger(__name__)

BEST_FILE = "best.json"


class BestVersion(msgspec.Struct, frozen=True, kw_only=True):
    """``<run_dir>/best.json``: the run's best validated version and the weights to load."""

    run_id: str
    version: int
    success_rate: float
    mean_score: float
    episodes: int
    checkpoint: str  # the weights to hand over (verify against checkpoint_hash)
    checkpoint_hash: str
    source_checkpoint: str  # the learner's checkpoint of that version
    source_checkpoint_hash: str
    chosen_by: str  # "keeper" (its best slot) | "run end" (an evaluation it never judged)


def best_path(run_dir: str) -> str:
    return os.path.join(run_dir, BEST_FILE)


def write_best(run_dir: str, best: BestVersion) -> None:
    atomic_write_bytes(best_path(run_dir),
                       msgspec.json.format(msgspec.json.encode(best), indent=2) + b"\n")


def read_best(run_dir: str, run_id: str) -> BestVersion | None:
    """The pointer of run ``run_id`` (None if absent, unreadable or another run's)."""
    try:
        with open(best_path(run_dir), "rb") as f:
            best = msgspec.json.decode(f.read(), type=BestVersion)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        log.error("best.unreadable", path=best_path(run_dir), error=str(exc))
        return None
    return best if best.run_id == run_id else None


def kept_best(run_id: str, ev: EvalResult, source: str, source_sha256: str, address: str,
              sha256: str) -> BestVersion:
    """The pointer to the keeper's copy (``address``, ``sha256``) of the weights that
    ``ev`` validated (the learner's checkpoint ``source``)."""
    return BestVersion(run_id=run_id, version=ev.policy_version,
                       success_rate=ev.success_rate, mean_score=ev.mean_score,
                       episodes=ev.episodes, checkpoint=address, checkpoint_hash=sha256,
                       source_checkpoint=source, source_checkpoint_hash=source_sha256,
                       chosen_by="keeper")


def _rank(success_rate: float, mean_score: float) -> tuple[float, float]:
    return (success_rate, mean_score)  # the order of keeper_rules.is_better


def best_evaluation(evals: Sequence[EvalResult]) -> EvalResult | None:
    """The best of ``evals`` (ordered by version, then time: the earlier wins ties)."""
    best = None
    for ev in evals:
        if best is None or _rank(ev.success_rate, ev.mean_score) > \
                _rank(best.success_rate, best.mean_score):
            best = ev
    return best


def settle_best(run_dir: str, run_id: str, evals: Sequence[EvalResult],
                versions: Sequence[PolicyVersion]) -> BestVersion | None:
    """The run's best version at its end; rewrites the pointer when that changes it."""
    kept = read_best(run_dir, run_id)
    by_version = {v.version: v for v in versions if v.run_id == run_id}
    top = best_evaluation([e for e in evals
                           if e.run_id == run_id and e.policy_version in by_version])
    if top is None or (kept is not None and _rank(kept.success_rate, kept.mean_score) >=
                       _rank(top.success_rate, top.mean_score)):
        return kept
    pv = by_version[top.policy_version]
    best = BestVersion(run_id=run_id, version=top.policy_version,
                       success_rate=top.success_rate, mean_score=top.mean_score,
                       episodes=top.episodes, checkpoint=pv.checkpoint,
                       checkpoint_hash=pv.checkpoint_hash, source_checkpoint=pv.checkpoint,
                       source_checkpoint_hash=pv.checkpoint_hash, chosen_by="run end")
    write_best(run_dir, best)
    return best


def final_and_best(run_id: str, evals: Sequence[EvalResult],
                   versions: Sequence[PolicyVersion], best: BestVersion | None) -> dict:
    """``summary.json``'s ``final`` (the last version evaluated) and ``best`` entries."""
    by_version = {v.version: v for v in versions if v.run_id == run_id}
    last = next((e for e in reversed(evals) if e.run_id == run_id), None)
    final = None
    if last is not None:
        pv = by_version.get(last.policy_version)
        final = {"version": last.policy_version, "success": last.success_rate,
                 "score": last.mean_score, "episodes": last.episodes,
                 "checkpoint": pv.checkpoint if pv else None,
                 "checkpoint_hash": pv.checkpoint_hash if pv else None}
    chosen = None
    if best is not None:
        chosen = {"version": best.version, "success": best.success_rate,
                  "score": best.mean_score, "episodes": best.episodes,
                  "checkpoint": best.checkpoint, "checkpoint_hash": best.checkpoint_hash,
                  "chosen_by": best.chosen_by, "pointer": BEST_FILE}
    return {"final": final, "best": chosen}
