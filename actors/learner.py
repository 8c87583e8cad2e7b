"""Learner: PPO on scored segments as they come, publishing a policy version per update.

consumes: scored (Scored), keeper (Rollback)
emits:    policy-version (PolicyVersion), telemetry (SegmentDropped)

A long trajectory does not block training: each scored segment is trainable on arrival,
its value bootstrapped at the segment boundary (V of the context right after it). An update
runs once ``batch_steps`` steps are buffered (sync mode: once every episode of the version
has ended). Samples more than ``max_staleness`` versions old are dropped and counted
(``segment-dropped``); the rest get decoupled PPO with a truncated importance weight
pi_prox / pi_behaviour (see ``gyre_async.rl.ppo``), so moderately stale samples still help.

Restart: the learner resumes from its latest ``policy-version`` checkpoint; buffered but
untrained segments are re-delivered because the runtime never commits past them
(``commit_floor``). The optimizer state restarts (documented limitation).

Rollback: the keeper's ``rollback`` order is followed by ``_on_rollback`` (see
``actors/keeper.py``): the order's weights and learning rate, a fresh optimizer, the
buffered segments dropped, and a ``policy-version`` with reason ``rollback`` under the next
version number (the learner is the only writer of version numbers). Segments sampled before
that version are dropped as they arrive (reason ``rolled-back``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from gyre_async import timing
from gyre_async.runtime.actor import Actor, Emit
from gyre_async.audit.credit_log import restore_outcome_book
from gyre_async.experience.elite import offer_trained, open_elite_pool, sample_for
from gyre_async.audit.redelivery import recently_trained
from gyre_async.audit.runlog import current_policy_version
from gyre_async.compose import build_policy, build_tokenizer, load_weights, save_weights
from gyre_async.rl.advantages import segment_gae
from gyre_async.rl.critic import CriticGuard, complete_returns
from gyre_async.rl.finite import NonFiniteBatch, check_batch_finite, check_loss_finite
from gyre_async.rl.fusion import OutcomeBook, fuse_segments
from gyre_async.rl.ppo import broadcast_step_advantages, ppo_policy_loss, value_loss
from gyre_async.rl.staleness import StalenessGate
from gyre_async.storage.checkpoints import CheckpointStore
from gyre_async.storage.errors import SegmentStoreError
from gyre_async.storage.readable import unreadable_segments
from gyre_async.storage.segments import SegmentStore
from schemas import event_id
from schemas.config import Config
from schemas.events import (CriticReset, PolicyVersion, RewardFailed, Rollback, Scored,
                            SegmentDropped)
from schemas.topics import KEEPER, POLICY_VERSION, SCORED, TELEMETRY


@dataclass
class Buffered:
    scored: Scored
    arrays: dict[str, np.ndarray]
    where: tuple[int, int]  # (partition, offset) of the scored event

    @property
    def steps(self) -> int:
        return self.scored.step_end - self.scored.step_start


def _rows(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    return [tokens[i, : int(lengths[i])].tolist() for i in range(len(lengths))]


class LearnerCore:
    """PPO over buffered segments (no bus; the actor feeds it and publishes its versions)."""

    def __init__(self, cfg: Config, policy):
        self.cfg = cfg
        self.policy = policy
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learner.learning_rate)
        self.buffer: list[Buffered] = []
        self.outcomes = OutcomeBook(cfg.sampler.group_size)  # global advantage (rl/fusion.py)
        self.critic = CriticGuard(cfg.learner, cfg.run.seed)  # critic defences (rl/critic.py)

    @property
    def buffered_steps(self) -> int:
        return sum(b.steps for b in self.buffer)

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train(self) -> dict[str, float]:
        """One PPO update on everything buffered; empties the buffer."""
        L = self.cfg.learner
        items, self.buffer = self.buffer, []
        global_adv = self.outcomes.global_advantages(
            [(b.scored.trajectory_id, b.scored.task_id, b.scored.trajectory_done) for b in items])
        prep = prepare_batch(self.policy, items, L.gamma, L.lam, global_adv, L.credit,
                             L.fusion_max_weight)
        ids = [it.scored.segment_id for it in items]
        check_batch_finite({sid: {"rewards": it.scored.step_rewards,
                                  "action_logprobs": it.arrays["action_logprobs"]}
                            for sid, it in zip(ids, items)},
                           {"values": prep.values, "advantages": prep.advantages,
                            "returns": prep.returns}, ids)
        self.last_batch = (items, prep.values)  # the elite pool reads the critic's values
        contexts, actions, behav, n = prep.contexts, prep.actions, prep.behav, prep.n
        self.critic.start(self.policy, prep.rewards)
        if self.critic.screen(self.policy, self.optimizer, prep.local_advantages):
            return {**prep.credit_stats(), "critic/skipped_update": 1.0,
                    "advantage_digest": prep.digest, "fusion_weights": prep.fusion_weights}
        values, adv, ret = prep.values, prep.advantages, prep.returns
        adv_n = (adv - adv.mean()) / (adv.std() + 1e-8) if n > 1 else adv
        A = max(len(a) for a in actions)
        behav_t = torch.zeros(n, A)
        tmask = torch.zeros(n, A, dtype=torch.bool)
        for i, lp in enumerate(behav):
            behav_t[i, : len(lp)] = torch.tensor(lp)
            tmask[i, : len(lp)] = True
        with torch.no_grad():
            prox = torch.zeros(n, A)
            for sl in _slices(n, 1024):
                out = self.policy.evaluate([contexts[i] for i in sl], [actions[i] for i in sl])
                prox[sl, : out.logprobs.shape[1]] = out.logprobs.float()
        check_batch_finite({}, {"proximal_logprobs": prox}, ids)
        stats: dict[str, list[float]] = {}
        gen = torch.Generator().manual_seed(n)
        for _ in range(L.epochs):
            perm = torch.randperm(n, generator=gen).tolist()
            for start in range(0, n, L.minibatch_steps):
                mb = perm[start : start + L.minibatch_steps]
                out = self.policy.evaluate([contexts[i] for i in mb], [actions[i] for i in mb])
                width = out.logprobs.shape[1]
                mask = tmask[mb, :width]
                tok_adv = broadcast_step_advantages(adv_n[mb], mask)
                pl, pstats = ppo_policy_loss(out.logprobs, prox[mb, :width], behav_t[mb, :width],
                                             tok_adv, mask, L.clip_eps, L.is_cap)
                vl = value_loss(out.values.float(), values[mb], ret[mb], clip=L.value_clip or None)
                ent = (out.entropy * mask).sum() / mask.sum().clamp(min=1)
                loss = pl + L.value_coef * vl - L.entropy_coef * ent
                check_loss_finite(loss, ids)
                self.optimizer.zero_grad()
                loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), L.max_grad_norm)
                self.optimizer.step()
                for key, val in {**pstats, "policy_loss": float(pl.detach()), "value_loss": float(vl.detach()),
                                 "entropy": float(ent.detach()), "grad_norm": float(gn)}.items():
                    stats.setdefault(key, []).append(val)
        out_stats = {f"losses/{k}": float(np.mean(vals)) for k, vals in stats.items()}
        out_stats.update({
            "charts/batch_steps": float(n), "charts/batch_segments": float(len(items)),
            "charts/mean_reward": float(np.mean(prep.rewards)),
            "charts/mean_value": float(values.mean()), "charts/mean_return": float(ret.mean()),
        })
        self.critic.after_update(self.policy, self.optimizer, out_stats["losses/value_loss"],
                                 float(prep.local_advantages.abs().max()))
        if self.critic.refit_due():
            out_stats["losses/value_refit"] = refit_on_complete_returns(
                self, items, prep)
        out_stats.update(prep.credit_stats())
        out_stats["advantage_digest"] = prep.digest
        out_stats["fusion_weights"] = prep.fusion_weights  # type: ignore[assignment]
        return out_stats


def refit_on_complete_returns(core: LearnerCore, items: list[Buffered], prep) -> float:
    """The critic's periodic supervised refit on the batch's complete Monte-Carlo returns."""
    mc = complete_returns([it.scored.step_rewards for it in items],
                          [it.scored.trajectory_id for it in items],
                          [it.scored.step_start for it in items],
                          [it_terminal(it) for it in items], core.cfg.learner.gamma)
    flat = [r for row in mc for r in row]
    keep = [i for i, r in enumerate(flat) if r is not None]
    if not keep:
        return 0.0
    return core.critic.refit(core.policy, core.optimizer, [prep.contexts[i] for i in keep],
                             [prep.actions[i] for i in keep],
                             torch.tensor([flat[i] for i in keep]), core.cfg.learner.max_grad_norm)


def timed_save(*args):
    with timing.timed("storage"):
        return save_weights(*args)


@dataclass
class PreparedBatch:
    """A batch flattened to steps, with values and segment-level GAE advantages."""

    contexts: list[list[int]]
    actions: list[list[int]]
    behav: list[list[float]]
    rewards: list[float]
    values: torch.Tensor
    advantages: torch.Tensor  # fused (before batch normalisation), one per step
    returns: torch.Tensor
    local_advantages: torch.Tensor  # raw segment GAE, one per step
    fusion_weights: list[float]  # weight of the global outcome advantage, one per segment
    global_known: int = 0  # segments whose trajectory outcome was known

    def credit_stats(self) -> dict[str, float]:
        w = self.fusion_weights or [0.0]
        return {"credit/fusion_weight_mean": float(np.mean(w)),
                "credit/fusion_weight_max": float(np.max(w)),
                "credit/segments_with_outcome": float(self.global_known),
                "credit/max_abs_local_advantage": float(self.local_advantages.abs().max())
                if self.n else 0.0}

    @property
    def n(self) -> int:
        return len(self.contexts)

    @property
    def digest(self) -> str:
        """Fingerprint of the advantages (the replay audit recomputes and compares it)."""
        data = self.advantages.detach().to(torch.float32).numpy().tobytes()
        return hashlib.sha256(data).hexdigest()[:32]


def prepare_batch(policy, items: list[Buffered], gamma: float, lam: float,
                  global_adv: list[float] | None = None, credit: str = "gae",
                  w_max: float = 0.8) -> PreparedBatch:
    """Values under ``policy``, GAE inside each segment bootstrapped at its boundary, fused
    with the per-segment global outcome advantage (``global_adv``, NaN: unknown; see
    ``gyre_async.rl.fusion``).

    Pure given the policy weights and the segments: ``gyre replay learner`` calls it with
    the parent checkpoint to re-derive exactly the advantages each update used.
    """
    contexts, actions, behav, rewards = [], [], [], []
    for item in items:
        a = item.arrays
        contexts += _rows(a["context_tokens"], a["context_len"])
        act_len = a["action_mask"].sum(axis=1)
        actions += _rows(a["action_tokens"], act_len)
        behav += [a["action_logprobs"][i, : int(act_len[i])].tolist() for i in range(len(act_len))]
        rewards += list(item.scored.step_rewards)
    with torch.no_grad():
        values = policy.values(contexts).float()
        boots = [it.arrays["bootstrap_context"][0, : int(it.arrays["bootstrap_len"][0])].tolist()
                 for it in items]
        need = [i for i, b in enumerate(boots) if b and not it_terminal(items[i])]
        boot_v = torch.zeros(len(items))
        if need:
            boot_v[need] = policy.values([boots[i] for i in need]).float()
    T = max(it.steps for it in items)
    S = len(items)
    r = torch.zeros(S, T)
    v = torch.zeros(S, T)
    m = torch.zeros(S, T, dtype=torch.bool)
    ks, ts = [], []
    pos = 0
    for k, it in enumerate(items):
        r[k, : it.steps] = torch.tensor(it.scored.step_rewards)
        v[k, : it.steps] = values[pos : pos + it.steps]
        m[k, : it.steps] = True
        ks += [k] * it.steps
        ts += list(range(it.steps))
        pos += it.steps
    terminal = torch.tensor([it_terminal(it) for it in items])
    adv2d, ret2d = segment_gae(r, v, m, boot_v, terminal, gamma, lam)
    g = torch.tensor(global_adv if global_adv is not None else [float("nan")] * S)
    fused2d, weights = fuse_segments(adv2d, m, g, credit, w_max)  # type: ignore[arg-type]
    kt, tt = torch.tensor(ks), torch.tensor(ts)
    return PreparedBatch(contexts, actions, behav, rewards, values, fused2d[kt, tt],
                         ret2d[kt, tt], adv2d[kt, tt], weights.tolist(),
                         int((~torch.isnan(g)).sum()))


def _finite_or(x: float, fallback: float = -1.0) -> float:
    """Events carry finite floats: an infinite reading is capped, a NaN becomes ``fallback``."""
    return fallback if x != x else max(min(x, 1e300), -1e300)


def it_terminal(item: Buffered) -> bool:
    return bool(item.arrays["terminal"][0])


def _slices(n: int, size: int) -> list[list[int]]:
    return [list(range(s, min(n, s + size))) for s in range(0, n, size)]


class Learner(Actor):
    role = "learner"
    consumes = (SCORED, KEEPER)
    emits = (POLICY_VERSION, TELEMETRY)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        torch.manual_seed(cfg.run.seed)
        self.tokenizer = build_tokenizer(cfg)
        self.policy = build_policy(cfg, self.tokenizer)
        self.core = LearnerCore(cfg, self.policy)
        self._segments: SegmentStore | None = None
        self.checkpoints = CheckpointStore(cfg.learner.checkpoints
                                           or f"{cfg.run.run_dir}/checkpoints")
        self.gate = StalenessGate(cfg.loop.max_staleness, cfg.learner.batch_steps)
        self.version = -1
        self.trained_steps = 0
        self.dropped = 0
        self.dropped_steps = 0  # steps of every dropped segment: consumed, never trained
        self.learning_rate = cfg.learner.learning_rate
        self.done_trajectories: set[str] = set()
        self.trained_before: set[str] = set()  # see gyre_async.audit.redelivery
        self.train_seconds = 0.0
        self.last_metrics: dict[str, float] = {}
        self._fusion_weights: list[float] = []
        self.elite = open_elite_pool(cfg)  # None unless elite.capacity > 0
        self.rollbacks_applied = 0  # keeper orders followed (carried in every version)
        self.rollback_floor = 0  # segments sampled before this version are dropped

    def segment_store(self) -> SegmentStore:
        """Opened on first use: in one-process-per-role runs the segmenter creates it."""
        if self._segments is None:
            url = self.cfg.segmenter.store or f"{self.cfg.run.run_dir}/segments.zarr"
            self._segments = SegmentStore(url, read_only=True)
        return self._segments

    @classmethod
    def from_config(cls, cfg: Config) -> Learner:
        return cls(cfg)

    async def on_start(self) -> None:
        latest = await current_policy_version(self.runner.bus)
        if latest is not None:
            await asyncio.to_thread(load_weights, self.policy, latest.checkpoint,
                                    latest.checkpoint_hash)
            self.version = latest.version
            self.trained_steps = latest.env_steps
            self.dropped_steps = max(0, latest.consumed_steps - latest.env_steps)
            self.learning_rate = latest.learning_rate or self.learning_rate
            self.core.set_learning_rate(self.learning_rate)
            self.core.critic.initialised = True  # the checkpoint's critic, not a new prior
            self.core.outcomes = await restore_outcome_book(self.runner.bus,
                                                            self.cfg.sampler.group_size)
            self.rollbacks_applied = int(latest.metrics.get("keeper/rollbacks_applied", 0))
            self.trained_before = await recently_trained(self.runner.bus, self.cfg.run.run_id)
        else:
            await self.runner.emit([await self._publish("init", {}, [])])

    async def handle(self, event, record):
        match event:
            case Scored():
                return await self._on_scored(event, record)
            case RewardFailed():
                return await self._on_withheld(event)
            case Rollback() if event.sequence > self.rollbacks_applied:
                return await self._on_rollback(event)
        return []

    async def _on_rollback(self, order: Rollback):
        """Follow the keeper: its weights (hash verified) and learning rate, a fresh
        optimizer, and a new version number with reason ``rollback``."""
        await asyncio.to_thread(load_weights, self.policy, order.checkpoint,
                                order.checkpoint_hash)
        dropped = [self._drop(b.scored, "rolled-back") for b in self.core.buffer]
        self.core.buffer = []
        self.core.optimizer = torch.optim.Adam(self.policy.parameters())  # moments of the
        self.learning_rate = order.learning_rate                          # abandoned lineage
        self.core.set_learning_rate(self.learning_rate)
        self.done_trajectories.clear()
        self.rollbacks_applied = order.sequence
        self.rollback_floor = self.version + 1
        stats = {"keeper/restored_version": float(order.restore_version),
                 "keeper/regressed_version": float(order.regressed_version)}
        return [*dropped, await self._publish("rollback", stats, [])]

    async def _on_scored(self, scored: Scored, record):
        if scored.segment_id in self.trained_before:
            return []  # trained before a restart, redelivered (at-least-once): not twice
        L = self.cfg.learner
        self.core.outcomes.record(scored.trajectory_id, scored.segment_id, scored.total)
        if L.max_versions and self.version >= L.max_versions:
            return [self._drop(scored, "budget-spent")]  # the run is winding down
        if self.gate.is_stale(scored.min_policy_version, self.version):
            return [self._drop(scored, "stale")]
        if scored.min_policy_version < self.rollback_floor:
            return [self._drop(scored, "rolled-back")]
        self.core.buffer.append(Buffered(scored, {}, (record.partition, record.offset)))
        if scored.trajectory_done:
            self.done_trajectories.add(scored.trajectory_id)
        return await self._train_if_ready()

    async def _on_withheld(self, failed: RewardFailed):
        """A segment the arbiter withheld (a reward component failed) is never trained, but
        it still ends its trajectory: sync mode counts that episode as over."""
        if failed.trajectory_done and failed.trajectory_id:
            self.done_trajectories.add(failed.trajectory_id)
            return await self._train_if_ready()
        return []

    async def _train_if_ready(self):
        if not self._batch_ready() or not self.core.buffer:
            return []
        L = self.cfg.learner
        ids = [b.scored.segment_id for b in self.core.buffer]
        steps = self.core.buffered_steps
        staleness = max(self.version - b.scored.min_policy_version for b in self.core.buffer)
        started = time.monotonic()
        try:
            arrays = await asyncio.to_thread(self._read_segments,
                                             [b.scored.address for b in self.core.buffer])
        except (SegmentStoreError, ValueError):  # corrupt, missing, foreign: refuse those
            bad = await asyncio.to_thread(unreadable_segments, self.segment_store(),
                                          [b.scored.address for b in self.core.buffer])
            refused = [b for b in self.core.buffer if b.scored.address in bad]
            self.core.buffer = [b for b in self.core.buffer if b.scored.address not in bad]
            return [self._drop(b.scored, f"unreadable: {bad[b.scored.address]}")
                    for b in refused]
        for item, arr in zip(self.core.buffer, arrays):
            item.arrays = arr
        batch = list(self.core.buffer)  # refused together if non-finite (elite picks aside)
        if self.elite is not None:  # elite segments bypass the staleness gate (by design)
            picks = await asyncio.to_thread(sample_for, self.elite, self.core.buffer, self.version + 1)
            self.core.buffer += [Buffered(s, a, self.core.buffer[0].where) for s, a in picks]
        spike = L.fault_lr_spike_factor if self.version + 1 == L.fault_lr_spike_version else 1.0
        self.core.set_learning_rate(self.core.optimizer.param_groups[0]["lr"] * spike)  # fault
        try:
            stats = await asyncio.to_thread(self._train)
        except NonFiniteBatch as exc:  # refused before optimizer.step, visibly, per segment
            self.done_trajectories.clear()
            return [self._drop(b.scored, exc.reason) for b in batch]
        finally:
            self.core.set_learning_rate(self.core.optimizer.param_groups[0]["lr"] / spike)  # knob
        self._fusion_weights = stats.pop("fusion_weights", [])[:len(ids)]  # fresh ones (elite last)
        if self.elite is not None:
            await asyncio.to_thread(offer_trained, self.elite, *self.core.last_batch)
            stats.update(self.elite.stats())
        self.train_seconds += time.monotonic() - started
        stats["charts/max_staleness_seen"] = float(staleness)
        digest = stats.pop("advantage_digest")
        self.last_metrics = {k: float(v) for k, v in stats.items()}
        self.trained_steps += steps
        self.done_trajectories.clear()
        self.learning_rate = self.core.optimizer.param_groups[0]["lr"]
        update = await self._publish("update", stats, ids, digest, self._fusion_weights)
        return [update, *self._critic_resets(stats)]

    def _critic_resets(self, stats: dict[str, float]) -> list[Emit]:
        found, self.core.critic.resets = self.core.critic.resets, []
        return [Emit(TELEMETRY, CriticReset(
            event_id=event_id("critic-reset", self.cfg.run.run_id, self.version, i),
            run_id=self.cfg.run.run_id, producer=self.runner.name, key="policy",
            version=self.version, reason=d.reason,  # type: ignore[arg-type]
            max_abs_advantage=_finite_or(d.max_abs_advantage),
            value_loss=_finite_or(d.value_loss),
            learning_rate=self.learning_rate,
            skipped_update=bool(stats.get("critic/skipped_update"))))
            for i, d in enumerate(found)]

    def _read_segments(self, addresses: list[str]):
        with timing.timed("storage"):
            return self.segment_store().read_many(addresses)

    def _train(self) -> dict[str, float]:
        with timing.timed("learner"):
            return self.core.train()

    def _drop(self, scored: Scored, reason: str) -> Emit:
        """Refuse a segment, visibly: counted and announced, never silently lost."""
        if reason == "stale":
            self.dropped += 1
        self.dropped_steps += scored.step_end - scored.step_start
        return Emit(TELEMETRY, SegmentDropped(
            event_id=event_id("dropped", scored.segment_id), run_id=scored.run_id,
            producer=self.runner.name, key=scored.trajectory_id,
            segment_id=scored.segment_id, reason=reason,
            staleness=self.version - scored.min_policy_version))

    def _batch_ready(self) -> bool:
        if self.cfg.run.mode == "sync":
            return len(self.done_trajectories) >= self.cfg.sampler.num_envs
        return self.core.buffered_steps >= self.cfg.learner.batch_steps

    async def _publish(self, reason: str, stats: dict[str, float], ids: list[str],
                       digest: str = "", fusion_weights: list[float] | None = None) -> Emit:
        version = self.version + 1
        ref = await asyncio.to_thread(
            timed_save, self.checkpoints, self.policy, version,
            {"run_id": self.cfg.run.run_id, "reason": reason, "parent": str(self.version)})
        final = bool(self.cfg.learner.max_versions and version >= self.cfg.learner.max_versions)
        metrics = {**stats, "charts/dropped_segments": float(self.dropped),
                   "final": 1.0 if final else 0.0,
                   "keeper/rollbacks_applied": float(self.rollbacks_applied)}
        event = PolicyVersion(
            event_id=event_id("policy-version", self.cfg.run.run_id, version, reason),
            run_id=self.cfg.run.run_id, producer=self.runner.name, key="policy",
            version=version, checkpoint=ref.address, checkpoint_hash=ref.sha256,
            parent=self.version if self.version >= 0 else None, reason=reason,  # type: ignore[arg-type]
            learning_rate=self.learning_rate, env_steps=self.trained_steps,
            consumed_steps=self.trained_steps + self.dropped_steps, metrics=metrics,
            trained_segments=ids, advantage_digest=digest,
            fusion_weights=list(fusion_weights or []))
        self.version = version
        return Emit(POLICY_VERSION, event)

    def commit_floor(self):
        floor: dict[tuple[str, int], int] = {}
        for b in self.core.buffer:
            tp = (SCORED, b.where[0])
            floor[tp] = min(floor.get(tp, b.where[1]), b.where[1])
        return floor

    def stats(self):
        return {"version": float(self.version), "buffered_steps": float(self.core.buffered_steps),
                "dropped": float(self.dropped), "train_s": self.train_seconds,
                **self.last_metrics}
