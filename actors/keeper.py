"""Keeper: three stable checkpoints, and a rollback order when a new version regresses.

consumes: policy-version (PolicyVersion), eval (EvalResult)
emits:    keeper (KeptCheckpoint, Rollback, CheckpointFault)

What it keeps (``gyre_async.core.keeper_slots``): ``best`` validation, latest ``stable``
(validated without regression) and ``pre-large``, the version before the last large update.
An update is *large* when, against its parent, the mean KL of next-token distributions on
a fixed probe set exceeds ``keeper.large_update_kl`` or the relative weight change exceeds
``keeper.large_update_param_change`` (``gyre_async.rl.policy_distance``).

When a version's validation regresses beyond noise (``gyre_async.core.keeper_rules``: at least
``min_regressed_metrics`` metrics below the best by more than ``noise_k`` binomial standard
errors), the keeper restores the best slot (hash verified; a corrupt slot is reported as
``checkpoint-fault`` and the next slot is used: stable, then pre-large) and publishes a
``rollback`` order with the weights, the learning rate cut by ``keeper.lr_cut``, and why.

**Who publishes the rollback version.** The learner does, on this order: it loads the
order's weights (verifying the hash), takes its learning rate, restarts its optimizer,
drops the segments sampled by the abandoned versions (``segment-dropped``, reason
``rolled-back``) and publishes a ``policy-version`` with reason ``rollback`` under the next
version number. The learner stays the only writer of version numbers: if the keeper
numbered the rollback itself it would race the learner for the next number (both could
publish version N). Samplers and the evaluator follow that ``policy-version`` like any other;
the evaluator always evaluates rollback versions, so the recovery is measured.

Until the learner's rollback version appears, the keeper judges nothing more (one order at
a time), and afterwards it ignores evaluations of versions older than the rollback (the
abandoned lineage). Restart: slots, order count and best validation are rebuilt from the
``keeper``, ``policy-version`` and ``eval`` topics.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

import structlog
import torch

from gyre_async.runtime.actor import Actor, Emit
from gyre_async.bus.reading import iter_topics
from gyre_async.core.keeper_rules import is_better, judge
from gyre_async.core.keeper_slots import Fault, Kept, KeptSlots
from gyre_async.compose import build_policy, build_tokenizer
from gyre_async.rl.policy_distance import (
    policy_kl,
    probe_contexts,
    relative_param_change,
)
from gyre_async.storage.checkpoints import CheckpointStore
from gyre_async.storage.errors import CheckpointError
from schemas import DecodeError, decode, event_id
from schemas.config import Config
from schemas.events import (
    CheckpointFault,
    EvalResult,
    KeptCheckpoint,
    PolicyVersion,
    Rollback,
)
from schemas.topics import EVAL, KEEPER, POLICY_VERSION

log = structlog.get_logger(__name__)

APPLIED_KEY = "keeper/rollbacks_applied"  # the learner's count of orders it followed


@dataclass(frozen=True)
class VersionInfo:
    version: int
    checkpoint: str
    checkpoint_hash: str
    parent: int | None
    reason: str


def _load(address: str, sha256: str) -> dict[str, torch.Tensor]:
    directory = address.rsplit("/", 1)[0]
    return CheckpointStore(directory).load(address, sha256)[0]


class KeeperCore:
    """The keeper's state and decisions; returns events, touches no bus."""

    def __init__(self, cfg: Config, slots: KeptSlots, policy, probe: list[list[int]],
                 producer: str = "keeper"):
        self.cfg, self.slots, self.policy, self.probe = cfg, slots, policy, probe
        self.producer = producer
        self.versions: dict[int, VersionInfo] = {}
        self.waiting_evals: dict[int, EvalResult] = {}
        self.best: EvalResult | None = None
        self.learning_rate = cfg.learner.learning_rate
        self.sequence = 0
        self.pending: Rollback | None = None
        self.floor = 0  # evaluations of older versions belong to an abandoned lineage
        self._weights: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.last_measures: dict[str, float] = {}
        self.faults = 0

    # -- policy versions ----------------------------------------------------------------------
    def on_policy_version(self, pv: PolicyVersion) -> list:
        self.versions[pv.version] = VersionInfo(pv.version, pv.checkpoint, pv.checkpoint_hash,
                                                pv.parent, pv.reason)
        self.learning_rate = pv.learning_rate or self.learning_rate
        out: list = []
        if pv.reason == "rollback":
            if self.pending is not None and \
                    pv.metrics.get(APPLIED_KEY, 0.0) >= self.pending.sequence:
                self.pending = None
            self.floor = pv.version
        elif pv.parent is not None and pv.parent in self.versions:
            out += self._measure_update(pv)
        if (waiting := self.waiting_evals.pop(pv.version, None)) is not None:
            out += self.on_eval(waiting)
        return out

    def _measure_update(self, pv: PolicyVersion) -> list:
        try:
            new = self._tensors(pv.version)
            old = self._tensors(pv.parent)  # type: ignore[arg-type]
        except CheckpointError as exc:
            return [self._fault(Fault("source", pv.version, pv.checkpoint, pv.checkpoint_hash,
                                      str(exc)), "")]
        K = self.cfg.keeper
        measures = {"kl": policy_kl(self.policy, old, new, self.probe) if self.probe else 0.0,
                    "param_change": relative_param_change(old, new)}
        self.last_measures = measures
        large = (K.large_update_kl > 0 and measures["kl"] > K.large_update_kl) or \
                (K.large_update_param_change > 0
                 and measures["param_change"] > K.large_update_param_change)
        if not large:
            return []
        why = (f"v{pv.version} was a large update (kl {measures['kl']:.4f} > "
               f"{K.large_update_kl:g} or param_change {measures['param_change']:.4f} > "
               f"{K.large_update_param_change:g}): keeping its parent v{pv.parent}")
        return self._keep("pre-large", pv.parent, why, measures)  # type: ignore[arg-type]

    # -- evaluations ----------------------------------------------------------------------------
    def on_eval(self, ev: EvalResult) -> list:
        v = ev.policy_version
        if v < self.floor or self.pending is not None:
            return []
        if v not in self.versions:  # the eval overtook its policy-version: wait for it
            self.waiting_evals[v] = ev
            return []
        numbers = {"success_rate": ev.success_rate, "mean_score": ev.mean_score,
                   "episodes": float(ev.episodes)}
        if is_better(ev, self.best):
            self.best = ev
            why = f"best validation so far: success {ev.success_rate:.3f}, score {ev.mean_score:.3f}"
            return self._keep("best", v, why, numbers) + self._keep("stable", v, why, numbers)
        assert self.best is not None
        K = self.cfg.keeper
        verdict = judge(self.best, ev, K.noise_k, K.min_regressed_metrics,
                        K.require_success_regression)
        if not verdict.regressed or v <= self.best.policy_version:
            stable = self.slots.slots.get("stable")
            if stable is not None and stable.version > v:
                return []  # a late evaluation of an older version: "stable" is the latest
            why = f"validation within noise of best v{self.best.policy_version}"
            return self._keep("stable", v, why, numbers)
        return self._rollback(ev, verdict.why, verdict.evidence)

    def _rollback(self, ev: EvalResult, why: str, evidence: dict[str, float]) -> list:
        restored = self.slots.restore(exclude_versions=frozenset({ev.policy_version}))
        used = restored.kept.slot if restored.kept is not None else ""
        out: list = [self._fault(f, used) for f in restored.faults]
        if restored.kept is None:
            log.error("keeper.no_checkpoint", why=why)
            return out
        kept = restored.kept
        new_lr = self.learning_rate * self.cfg.keeper.lr_cut
        self.sequence += 1
        self.pending = Rollback(
            event_id=event_id("rollback", self.cfg.run.run_id, self.sequence),
            run_id=self.cfg.run.run_id, producer=self.producer, key="keeper",
            sequence=self.sequence, regressed_version=ev.policy_version,
            restore_version=kept.version, slot=kept.slot,  # type: ignore[arg-type]
            checkpoint=kept.address, checkpoint_hash=kept.sha256, learning_rate=new_lr,
            previous_learning_rate=self.learning_rate,
            why=(f"{why}. Rolling back to {kept.slot} v{kept.version}; learning rate "
                 f"{self.learning_rate:g} -> {new_lr:g}"),
            evidence=evidence)
        log.warning("keeper.rollback", why=self.pending.why)
        return [*out, self.pending]

    # -- slots ------------------------------------------------------------------------------------
    def _keep(self, slot: str, version: int, why: str, measures: dict[str, float]) -> list:
        info = self.versions[version]
        try:
            tensors = self._tensors(version)
            kept = self.slots.keep(slot, version, tensors, {
                "run_id": self.cfg.run.run_id, "source_version": str(version),
                "source_checkpoint": info.checkpoint, "source_sha256": info.checkpoint_hash,
                "why": why, **{f"measure.{k}": repr(v) for k, v in measures.items()}})
        except CheckpointError as exc:
            return [self._fault(Fault(slot, version, info.checkpoint, info.checkpoint_hash,
                                      str(exc)), "")]
        return [KeptCheckpoint(
            event_id=event_id("kept", self.cfg.run.run_id, slot, version, kept.sha256),
            run_id=self.cfg.run.run_id, producer=self.producer, key="keeper", slot=slot,  # type: ignore[arg-type]
            version=version, address=kept.address, sha256=kept.sha256, why=why,
            measures=measures)]

    def _tensors(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self._weights:
            info = self.versions[version]
            self._weights[version] = _load(info.checkpoint, info.checkpoint_hash)
            while len(self._weights) > 2:  # a parent and its child: weights can be large
                self._weights.popitem(last=False)
        return self._weights[version]

    def _fault(self, fault: Fault, fell_back_to: str) -> CheckpointFault:
        self.faults += 1
        log.error("keeper.checkpoint_fault", slot=fault.slot, version=fault.version,
                  error=fault.error, fell_back_to=fell_back_to or None)
        return CheckpointFault(
            event_id=event_id("checkpoint-fault", self.cfg.run.run_id, fault.slot,
                              fault.address, self.sequence, self.faults),
            run_id=self.cfg.run.run_id, producer=self.producer, key="keeper",
            slot=fault.slot, version=fault.version, address=fault.address,
            expected_sha256=fault.expected_sha256, error=fault.error, fell_back_to=fell_back_to)

    # -- restart ------------------------------------------------------------------------------
    def rebuild(self, kept: list[KeptCheckpoint], orders: list[Rollback],
                versions: list[PolicyVersion], evals: list[EvalResult]) -> None:
        """State from the recorded topics (no outputs): slots, orders, lineage, best."""
        for k in kept:
            self.slots.remember(Kept(k.slot, k.version, k.address, k.sha256))
        for pv in versions:
            self.versions[pv.version] = VersionInfo(pv.version, pv.checkpoint,
                                                    pv.checkpoint_hash, pv.parent, pv.reason)
            self.learning_rate = pv.learning_rate or self.learning_rate
            if pv.reason == "rollback":
                self.floor = pv.version
        applied = max((pv.metrics.get(APPLIED_KEY, 0.0) for pv in versions), default=0.0)
        if orders:
            self.sequence = max(o.sequence for o in orders)
            last = max(orders, key=lambda o: o.sequence)
            self.pending = last if last.sequence > applied else None
        best_slot = self.slots.slots.get("best")
        if best_slot is not None:
            matching = [e for e in evals if e.policy_version == best_slot.version]
            self.best = matching[-1] if matching else None


class Keeper(Actor):
    role = "keeper"
    consumes = (POLICY_VERSION, EVAL)
    emits = (KEEPER,)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg)
        self.policy = build_policy(cfg, self.tokenizer)
        self.slots = KeptSlots(cfg.keeper.store or f"{cfg.run.run_dir}/keeper")
        self.core: KeeperCore | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> Keeper:
        return cls(cfg)

    async def on_start(self) -> None:
        K = self.cfg.keeper
        probe = await probe_contexts(self.cfg, self.tokenizer, K.probe_contexts,
                                     K.probe_seed_start) if K.probe_contexts > 0 else []
        self.core = KeeperCore(self.cfg, self.slots, self.policy, probe, self.runner.name)
        self.core.rebuild(*await self._history())

    async def _history(self):
        kept, orders, versions, evals = [], [], [], []
        known = {t.name for t in await self.runner.bus.topics()}
        topics = [t for t in (KEEPER, POLICY_VERSION, EVAL) if t in known]
        async for record in iter_topics(self.runner.bus, topics):
            try:
                event = decode(record.topic, record.value, 1 << 40)
            except DecodeError:
                continue
            match event:
                case KeptCheckpoint():
                    kept.append(event)
                case Rollback():
                    orders.append(event)
                case PolicyVersion():
                    versions.append(event)
                case EvalResult():
                    evals.append(event)
        return kept, orders, versions, evals

    async def handle(self, event, record):
        assert self.core is not None
        match event:
            case PolicyVersion():
                out = await asyncio.to_thread(self.core.on_policy_version, event)
            case EvalResult():
                out = await asyncio.to_thread(self.core.on_eval, event)
            case _:
                out = []
        return [Emit(KEEPER, e) for e in out]

    def stats(self):
        if self.core is None:
            return {}
        c = self.core
        return {"rollbacks": float(c.sequence), "faults": float(c.faults),
                "best_version": float(c.best.policy_version if c.best else -1),
                **{f"update_{k}": v for k, v in c.last_measures.items()}}
