"""The learner's core: which scored segments to train on, the PPO update, rollback, restart.

No bus and no asyncio: ``actors/learner.py`` hands it events, reads the segments' arrays,
saves checkpoints and publishes what it returns, so everything here is testable on plain
objects. A long trajectory does not block training: each scored segment is trainable on
arrival, its value bootstrapped at the segment boundary (V of the context right after it),
and an update runs once ``batch_steps`` steps are buffered (sync mode: once every episode
of the version has ended). Each method is one decision of the learner:

- :meth:`LearnerCore.add` admits a scored segment or refuses it (``budget-spent``,
  ``stale``: more than ``max_staleness`` versions old, ``rolled-back``: sampled before the
  last rollback); the refusals are counted and come back as :class:`Dropped`.
- :meth:`LearnerCore.update` runs once :meth:`batch_ready`: a bounded share of elite
  segments mixed in (they bypass the staleness gate by design and carry no bus offset, so
  :meth:`commit_floor` never sees them), the injected learning-rate fault applied from the
  config, one decoupled-PPO update (:meth:`train`: a truncated importance weight
  pi_prox / pi_behaviour, so moderately stale samples still help; see
  ``gyre_async.rl.ppo``), and the batch offered to the elite pool.
  A non-finite batch is refused whole, before any optimizer step.
- :meth:`LearnerCore.rollback` follows a keeper order (weights already loaded): a fresh
  optimizer at the order's learning rate (the Adam moments belong to the abandoned
  lineage), the buffered segments dropped, later segments of older versions refused.
- :meth:`LearnerCore.restore` resumes after the latest published version; the optimizer
  state restarts (documented limitation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from gyre_async.core.learner_batch import (
    BatchItem,
    PreparedBatch,
    evaluate_steps,
    prepare_batch,
    read_units,
    unit_minibatches,
)
from gyre_async.core.learner_dp import AveragedSteps, DataParallel
from gyre_async.core.learner_ppo import PpoEpochs
from gyre_async.errors import is_retriable
from gyre_async.experience.elite import ElitePool, offer_trained, sample_for
from gyre_async.policy.base import EvalOutput
from gyre_async.rl.critic import CriticGuard, Divergence, complete_returns
from gyre_async.rl.finite import NonFiniteBatch, check_batch_finite
from gyre_async.rl.fusion import CRITIC_FREE_CREDIT, OutcomeBook
from gyre_async.rl.staleness import StalenessGate
from gyre_async.storage.checkpoints import CheckpointRef
from schemas import event_id
from schemas.config import Config
from schemas.events import (
    CriticReset,
    PolicyVersion,
    RewardFailed,
    Rollback,
    Scored,
    SegmentDropped,
    finite_reading,
)

VersionReason = Literal["init", "update", "rollback"]


@dataclass
class Buffered(BatchItem):
    """A fresh segment waiting for an update, with where its ``scored`` event sits."""

    where: tuple[int, int]  # (partition, offset): the runtime commits no further


@dataclass(frozen=True)
class Dropped:
    """A segment refused, visibly: the actor announces it as ``segment-dropped``."""

    scored: Scored
    reason: str
    staleness: int  # versions between the learner and the segment's oldest step
    consumed_steps: int = 0  # the learner's trained + dropped steps, this drop included
    #: the input itself failed later processing (unreadable, arrays that do not match it,
    #: an update that raised): the actor dead-letters it at ``where`` (partition, offset)
    bad_input: bool = False
    where: tuple[int, int] | None = None

    def event(self, producer: str) -> SegmentDropped:
        scored = self.scored
        return SegmentDropped(
            event_id=event_id("dropped", scored.segment_id), run_id=scored.run_id,
            producer=producer, key=scored.trajectory_id, segment_id=scored.segment_id,
            reason=self.reason, staleness=self.staleness,
            steps=scored.step_end - scored.step_start, consumed_steps=self.consumed_steps)


@dataclass(frozen=True)
class TrainResult:
    """What one update produced, for its ``policy-version`` event."""

    metrics: dict[str, float]
    advantage_digest: str  # fingerprint of the advantages (``gyre replay learner``)
    fusion_weights: list[float]  # one per trained segment, in ``trained_segments`` order
    skipped: bool  # the critic's advantage alarm refused the update (weights untouched)
    trained_segments: list[str]  # the fresh segments (elite ones never came from the bus)
    threads: int = 0  # torch's intra-op threads that computed the batch (replay uses as many)
    elite_segments: tuple[str, ...] = ()  # content hashes of the elite segments mixed in


#: what every segment's arrays must hold, one row per step (the rest is per segment)
_PER_STEP = ("context_tokens", "context_len", "action_tokens", "action_logprobs",
             "action_mask")
_PER_SEGMENT = ("bootstrap_context", "bootstrap_len", "terminal")


def _mismatch(item: BatchItem) -> str:
    """Why ``item``'s arrays cannot be trained with its ``scored`` event ("": they can)."""
    arrays, sid = item.arrays, item.scored.segment_id
    # a one-sequence segment holds its contexts in sequence_tokens (core.segmenter)
    sequence = "sequence_tokens" in arrays
    per_step = [k for k in _PER_STEP if not (sequence and k == "context_tokens")]
    missing = [k for k in (*per_step, *_PER_SEGMENT, *(("sequence_len",) if sequence else ()))
               if k not in arrays]
    if missing:
        return f"segment {sid} has no {', '.join(missing)}"
    rows = {k: len(arrays[k]) for k in per_step}
    if set(rows.values()) != {item.steps}:
        return (f"segment {sid}: the scored event spans {item.steps} "
                f"steps, its stored arrays {sorted(set(rows.values()))} rows")
    if any(len(arrays[k]) < 1 for k in _PER_SEGMENT):
        return f"segment {sid}: empty per-segment arrays"
    if sequence:
        ends = arrays["context_len"] + arrays["action_mask"].sum(axis=1)
        if (arrays["context_len"] < 1).any() or int(ends.max()) > int(arrays["sequence_len"][0]):
            return f"segment {sid}: a step lies outside its sequence"
    return ""


class LearnerCore:
    """The learner's state (buffer, optimizer, critic defences, counters) and its update."""

    def __init__(self, cfg: Config, policy, elite: ElitePool | None = None,
                 dp: DataParallel | None = None):
        self.cfg = cfg
        self.policy = policy
        if (not cfg.learner.value_trunk_gradient  # the critic trains its head alone
                or cfg.learner.credit in CRITIC_FREE_CREDIT):
            policy.critic_detached = True
        self.dp = dp  # a data-parallel group (gyre_async.core.learner_dp), None: alone
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learner.learning_rate)
        self.buffer: list[Buffered] = []
        self.outcomes = OutcomeBook(cfg.sampler.group_size,  # global advantage (rl/fusion.py)
                                    cfg.learner.mask_failed)
        self.critic = CriticGuard(cfg.learner, cfg.run.seed)  # critic defences (rl/critic.py)
        self.gate = StalenessGate(cfg.loop.max_staleness, cfg.learner.batch_steps)
        self.elite = elite  # None unless elite.capacity > 0
        self.version = -1  # the last version published
        self.trained_steps = 0
        self.dropped = 0  # stale segments since start
        self.dropped_steps = 0  # steps of every dropped segment: consumed, never trained
        self.done_trajectories: set[str] = set()  # ended since the last update (sync mode)
        self.trained_before: set[str] = set()  # see gyre_async.folds.redelivery
        self.rollbacks_applied = 0  # keeper orders followed (carried in every version)
        self.rollback_floor = 0  # segments sampled before this version are dropped
        self.last_metrics: dict[str, float] = {}
        self._last_batch: tuple[list[BatchItem], torch.Tensor] = ([], torch.zeros(0))

    # -- state ---------------------------------------------------------------------------
    @property
    def buffered_steps(self) -> int:
        return sum(b.steps for b in self.buffer)

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def restore(self, latest: PolicyVersion, outcomes: OutcomeBook,
                trained_before: set[str]) -> None:
        """Resume after ``latest`` (its weights already loaded): its counters and learning
        rate, its critic (not a new prior), the outcome book and the recently trained ids
        rebuilt from the log."""
        self.version = latest.version
        self.trained_steps = latest.env_steps
        self.dropped_steps = max(0, latest.consumed_steps - latest.env_steps)
        self.set_learning_rate(latest.learning_rate or self.learning_rate)
        self.critic.resume()
        self.outcomes = outcomes
        self.rollbacks_applied = int(latest.metrics.get("keeper/rollbacks_applied", 0))
        self.trained_before = trained_before

    def commit_floor(self) -> dict[int, int]:
        """Per partition of ``scored``, the oldest offset still buffered (not yet trained)."""
        floor: dict[int, int] = {}
        for item in self.buffer:
            partition, offset = item.where
            floor[partition] = min(floor.get(partition, offset), offset)
        return floor

    def stats(self) -> dict[str, float]:
        return {"version": float(self.version), "buffered_steps": float(self.buffered_steps),
                "dropped": float(self.dropped), **self.last_metrics}

    # -- inputs --------------------------------------------------------------------------
    def already_trained(self, scored: Scored) -> bool:
        """Trained before a restart and redelivered (at-least-once): not twice."""
        return scored.segment_id in self.trained_before

    def add(self, scored: Scored, where: tuple[int, int]) -> Dropped | None:
        """Buffer a scored segment, or refuse it (returned, counted). Idempotent: a segment
        already buffered (its handler retried after a transient error) is not added twice."""
        if any(b.scored.segment_id == scored.segment_id for b in self.buffer):
            return None
        self.outcomes.record(scored.trajectory_id, scored.segment_id, scored.total,
                             failed=bool(scored.failure))
        max_versions = self.cfg.learner.max_versions
        if max_versions and self.version >= max_versions:
            return self._drop(scored, "budget-spent")  # the run is winding down
        if self.gate.is_stale(scored.min_policy_version, self.version):
            return self._drop(scored, "stale")
        if scored.min_policy_version < self.rollback_floor:
            return self._drop(scored, "rolled-back")
        self.buffer.append(Buffered(scored, {}, where))
        if scored.trajectory_done:
            self.done_trajectories.add(scored.trajectory_id)
        return None

    def withheld(self, failed: RewardFailed) -> bool:
        """A segment the arbiter withheld is never trained, but it still ends its trajectory
        (sync mode counts that episode as over). True if it did."""
        if failed.trajectory_done and failed.trajectory_id:
            self.done_trajectories.add(failed.trajectory_id)
            return True
        return False

    def follows(self, order: Rollback) -> bool:
        return order.sequence > self.rollbacks_applied

    def rollback(self, order: Rollback) -> list[Dropped]:
        """Follow a keeper order whose weights are loaded: a fresh optimizer (no moments of
        the abandoned lineage) at its learning rate, the buffer dropped, and every segment
        sampled before the next version refused from now on."""
        dropped = self.drop_buffer("rolled-back")
        self.optimizer = torch.optim.Adam(self.policy.parameters())
        self.set_learning_rate(order.learning_rate)
        self.done_trajectories.clear()
        self.rollbacks_applied = order.sequence
        self.rollback_floor = self.version + 1
        return dropped

    def drop_buffer(self, reason: str, addresses: dict[str, str] | None = None,
                    bad_input: bool = False) -> list[Dropped]:
        """Refuse buffered segments: all of them, or those at ``addresses`` (address ->
        why, e.g. unreadable), each with ``reason`` followed by that why. ``bad_input``:
        the segments themselves failed (see :attr:`Dropped.bad_input`)."""
        if addresses is None:
            refused, self.buffer = self.buffer, []
            return [self._drop(b.scored, reason, b.where if bad_input else None)
                    for b in refused]
        refused = [b for b in self.buffer if b.scored.address in addresses]
        self.buffer = [b for b in self.buffer if b.scored.address not in addresses]
        return [self._drop(b.scored, f"{reason}: {addresses[b.scored.address]}",
                           b.where if bad_input else None) for b in refused]

    def _drop(self, scored: Scored, reason: str,
              bad_input_at: tuple[int, int] | None = None) -> Dropped:
        if reason == "stale":
            self.dropped += 1
        self.dropped_steps += scored.step_end - scored.step_start
        return Dropped(scored, reason, self.version - scored.min_policy_version,
                       self.trained_steps + self.dropped_steps, bad_input_at is not None,
                       bad_input_at)

    # -- the update ----------------------------------------------------------------------
    def batch_ready(self) -> bool:
        if not self.buffer:
            return False
        if self.cfg.run.mode == "sync":
            return len(self.done_trajectories) >= self.cfg.sampler.num_envs
        return self.buffered_steps >= self.cfg.learner.batch_steps

    def buffered_addresses(self) -> list[str]:
        return [b.scored.address for b in self.buffer]

    def attach_arrays(self, arrays: Sequence[dict[str, np.ndarray]]) -> list[Dropped]:
        """The buffered segments' arrays, read in :meth:`buffered_addresses` order. A segment
        whose arrays do not match its ``scored`` event (another number of steps, a missing
        array) is refused here, alone, instead of failing the whole update: returned."""
        refused: list[Dropped] = []
        kept: list[Buffered] = []
        for item, array in zip(self.buffer, arrays):
            item.arrays = array
            why = _mismatch(item)
            if why:
                refused.append(self._drop(item.scored, f"arrays do not match: {why}",
                                          item.where))
            else:
                kept.append(item)
        self.buffer = kept
        return refused

    def update(self, global_adv: list[float] | None = None) -> TrainResult | list[Dropped]:
        """One update on the buffered segments (arrays attached), elite ones mixed in.

        ``global_adv``: the batch's outcome advantages when a data-parallel leader already
        computed them (:meth:`global_advantages`); None computes them here."""
        fresh = list(self.buffer)  # refused together if non-finite (elite picks aside)
        steps = self.buffered_steps
        staleness = max(self.version - b.scored.min_policy_version for b in fresh)
        elite: list[BatchItem] = []
        if self.elite is not None:  # elite segments bypass the staleness gate (by design)
            elite = [BatchItem(scored, arrays)
                     for scored, arrays in sample_for(self.elite, fresh, self.version + 1)]
        settings = self.cfg.learner
        spike = (settings.fault_lr_spike_factor
                 if self.version + 1 == settings.fault_lr_spike_version else 1.0)
        self.set_learning_rate(self.learning_rate * spike)  # fault injection (config)
        try:
            result = self.train(elite, global_adv)
        except NonFiniteBatch as exc:  # refused before optimizer.step, visibly, per segment
            self.done_trajectories.clear()
            return [self._drop(b.scored, exc.reason) for b in fresh]
        except Exception as exc:  # noqa: BLE001 - a batch that fails is refused, never kept
            if is_retriable(exc):
                self.buffer = fresh  # retried: the same batch again
                raise
            self.done_trajectories.clear()
            self.buffer = []
            return [self._drop(b.scored, f"update failed: {exc!r}"[:2000], b.where)
                    for b in fresh]
        finally:
            self.set_learning_rate(self.learning_rate / spike)
        metrics = dict(result.metrics)
        if self.elite is not None:
            offer_trained(self.elite, *self._last_batch)
            metrics.update(self.elite.stats())
        metrics["charts/max_staleness_seen"] = float(staleness)
        self.last_metrics = metrics
        self.trained_steps += steps
        self.done_trajectories.clear()
        return replace(result, metrics=metrics)

    def global_advantages(self, items: Sequence[BatchItem]) -> list[float]:
        """Per segment, its trajectory's group-relative outcome advantage (NaN: unknown)."""
        return self.outcomes.global_advantages(
            [(b.scored.trajectory_id, b.scored.task_id, b.scored.trajectory_done)
             for b in items])

    def train(self, elite: Sequence[BatchItem] = (),
              global_adv: list[float] | None = None) -> TrainResult:
        """One PPO update on everything buffered (plus ``elite``); empties the buffer."""
        settings = self.cfg.learner
        fresh, self.buffer = self.buffer, []
        items: list[BatchItem] = [*fresh, *elite]
        if global_adv is None:
            global_adv = self.global_advantages(items)
        threads = torch.get_num_threads()  # of the thread this runs on (an executor's)
        prep = prepare_batch(self.policy, items, settings.gamma, settings.lam, global_adv,
                             settings.credit, settings.fusion_max_weight,
                             bootstrap_failed=settings.mask_failed, with_logprobs=True,
                             silent_groups=settings.fusion_silent_groups)
        ids = [it.scored.segment_id for it in items]
        check_batch_finite({sid: {"rewards": it.scored.step_rewards,
                                  "action_logprobs": it.arrays["action_logprobs"]}
                            for sid, it in zip(ids, items)},
                           {"values": prep.values, "advantages": prep.advantages,
                            "returns": prep.returns}, ids)
        self._last_batch = (items, prep.values)  # the elite pool reads the critic's values

        def result(metrics: dict[str, float], skipped: bool) -> TrainResult:
            return TrainResult(metrics, prep.digest, prep.fusion_weights[:len(fresh)],
                               skipped, [b.scored.segment_id for b in fresh], threads,
                               tuple(it.scored.content_hash for it in elite))

        if not self.critic.initialised:
            self.critic.start(self.policy, prep.rewards, [
                r for row in self._complete_returns(items) for r in row if r is not None])
        if self.critic.screen(self.policy, self.optimizer, prep.local_advantages):
            return result({**prep.credit_stats(), "critic/skipped_update": 1.0}, True)
        metrics = PpoEpochs(self.policy, self.optimizer, settings, prep, ids, self.dp).run()
        metrics.update({
            "charts/batch_steps": float(prep.n), "charts/batch_segments": float(len(items)),
            "charts/mean_reward": float(np.mean(prep.rewards)),
            "charts/mean_value": float(prep.values.mean()),
            "charts/mean_return": float(prep.returns.mean()),
        })
        self.critic.after_update(self.policy, self.optimizer, metrics["losses/value_loss"],
                                 float(prep.local_advantages.abs().max()))
        if self.critic.refit_due():  # on a batch without advantage, the critic alone
            metrics["losses/value_refit"] = self._refit(
                items, prep, critic_only=bool(metrics["losses/policy_step_skipped"]))
        metrics.update(prep.credit_stats())
        return result(metrics, False)

    def _complete_returns(self, items: list[BatchItem]) -> list[list[float | None]]:
        """Each step's Monte-Carlo return where its episode ends within ``items``."""
        return complete_returns([it.scored.step_rewards for it in items],
                                [it.scored.trajectory_id for it in items],
                                [it.scored.step_start for it in items],
                                [it.terminal for it in items], self.cfg.learner.gamma)

    def _refit(self, items: list[BatchItem], prep: PreparedBatch, critic_only: bool) -> float:
        """The critic's periodic supervised refit on the batch's complete Monte-Carlo returns."""
        flat = [r for row in self._complete_returns(items) for r in row]
        keep = [i for i, r in enumerate(flat) if r is not None]
        if not keep:
            return 0.0
        optimizer = (self.optimizer if self.dp is None else  # every rank refits on all rows
                     AveragedSteps(self.optimizer, self.dp, list(self.policy.parameters())))
        def evaluate(rows: list[int]) -> EvalOutput:  # one-sequence segments: one pass
            return evaluate_steps(self.policy, prep.contexts, prep.actions,
                                  [keep[i] for i in rows], prep.sequences, prep.sequence_of)

        minibatches = None
        if prep.sequences:  # whole segments a minibatch: each sequence read once, not 8 apart
            position = {row: k for k, row in enumerate(keep)}
            units = [[position[row] for row in unit] for unit in read_units(
                keep, prep.contexts, prep.actions, prep.sequence_of)[0]]
            size = self.cfg.learner.minibatch_steps

            def minibatches(gen: torch.Generator) -> list[list[int]]:
                return unit_minibatches(units, size, gen)

        return self.critic.refit(self.policy, optimizer, [prep.contexts[i] for i in keep],
                                 [prep.actions[i] for i in keep],
                                 torch.tensor([flat[i] for i in keep]),
                                 self.cfg.learner.max_grad_norm, evaluate, critic_only,
                                 minibatches)

    def take_critic_resets(self) -> list[Divergence]:
        """Critic resets since the last call, to announce once each (readings made finite:
        a NaN value loss reads -1, an infinite advantage the largest float an event takes)."""
        return [replace(found, max_abs_advantage=finite_reading(found.max_abs_advantage),
                        value_loss=finite_reading(found.value_loss))
                for found in self.critic.take_resets()]

    def critic_reset_events(self, producer: str, skipped: bool) -> list[CriticReset]:
        """One ``critic-reset`` per reset since the last call (see take_critic_resets)."""
        version, run_id = self.version, self.cfg.run.run_id
        return [CriticReset(
            event_id=event_id("critic-reset", run_id, version, i), run_id=run_id,
            producer=producer, key="policy", version=version, reason=found.reason,
            max_abs_advantage=found.max_abs_advantage, value_loss=found.value_loss,
            learning_rate=self.learning_rate, skipped_update=skipped)
            for i, found in enumerate(self.take_critic_resets())]

    # -- outputs -------------------------------------------------------------------------
    def publish(self, reason: VersionReason, checkpoint: CheckpointRef, producer: str,
                metrics: dict[str, float], update: TrainResult | None = None
                ) -> PolicyVersion:
        """The next ``policy-version`` (its weights saved at ``checkpoint``); the learner is
        the only writer of version numbers."""
        version = self.version + 1
        max_versions = self.cfg.learner.max_versions
        final = bool(max_versions and version >= max_versions)
        run_id = self.cfg.run.run_id
        event = PolicyVersion(
            event_id=event_id("policy-version", run_id, version, reason),
            run_id=run_id, producer=producer, key="policy", version=version,
            checkpoint=checkpoint.address, checkpoint_hash=checkpoint.sha256,
            parent=self.version if self.version >= 0 else None, reason=reason,
            learning_rate=self.learning_rate, env_steps=self.trained_steps,
            consumed_steps=self.trained_steps + self.dropped_steps,
            metrics={**metrics, "charts/dropped_segments": float(self.dropped),
                     "final": 1.0 if final else 0.0,
                     "keeper/rollbacks_applied": float(self.rollbacks_applied)},
            trained_segments=list(update.trained_segments) if update else [],
            advantage_digest=update.advantage_digest if update else "",
            fusion_weights=list(update.fusion_weights) if update else [],
            batch_threads=update.threads if update else 0,
            elite_segments=list(update.elite_segments) if update else [])
        self.version = version
        return event
