"""The keeper's core: its state, folded from events, and its decisions (no bus).

One idiom serves a restart and live work (event sourcing): :meth:`KeeperCore.apply` folds
one event into the state, whichever of the keeper's topics it comes from: the inputs
(``policy-version``, ``eval``) and the keeper's own outputs (``kept-checkpoint``,
``rollback``, ``checkpoint-fault``). A restart applies every recorded event of those topics;
live, :meth:`KeeperCore.handle` applies the input, decides, and applies each output it
emits, so the state after a restart is the state the live keeper had.

``apply`` does not depend on the order *between* topics (a read-back interleaves them
arbitrarily): the best validation is the evaluation of the version in the ``best`` slot
(the latest one when the slot was kept), whichever of the two is read first, and a rollback order is
pending until a ``policy-version`` says
the learner followed it (``keeper/rollbacks_applied``, carried in every version).

What the decisions are (slots, the large-update measures, the regression rule, the
rollback order and who publishes the rollback version) is told in ``actors/keeper.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import structlog
import torch

from gyre_async.core.keeper_best import BestVersion, kept_best
from gyre_async.core.keeper_rules import is_better, judge
from gyre_async.core.keeper_slots import Fault, Kept, KeptSlots
from gyre_async.rl.policy_distance import mean_kl, probe_logprobs, relative_param_change
from gyre_async.storage.checkpoints import load_checkpoint
from gyre_async.storage.errors import CheckpointError, UntrustedAddress
from gyre_async.storage.roots import is_role
from schemas import Event, event_id
from schemas.config import Config
from schemas.events import (
    MAX_READING,
    CheckpointFault,
    EvalResult,
    KeptCheckpoint,
    KeptSlot,
    PolicyVersion,
    Rollback,
    finite_reading,
)

log = structlog.get_logger(__name__)

APPLIED_KEY = "keeper/rollbacks_applied"  # the learner's count of orders it followed


@dataclass(frozen=True)
class VersionInfo:
    version: int
    checkpoint: str
    checkpoint_hash: str
    parent: int | None
    reason: str


#: Header fields that say which model a checkpoint fits; a kept copy carries them over, so a
#: rollback load checks the model config exactly as the live load path does.
IDENTITY_FIELDS = ("format", "model_config", "tokenizer")


def _load(address: str, sha256: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors, metadata = load_checkpoint(address, sha256)  # opens no store: creates nothing
    return tensors, {k: metadata[k] for k in IDENTITY_FIELDS if k in metadata}


class KeeperCore:
    """The keeper's state and decisions; returns events, touches no bus."""

    def __init__(self, cfg: Config, slots: KeptSlots, policy, probe: list[list[int]],
                 producer: str = "keeper",
                 on_best: Callable[[BestVersion], None] | None = None):
        self.cfg, self.slots, self.policy, self.probe = cfg, slots, policy, probe
        self.producer = producer
        self.on_best = on_best  # told of each new best copy (the actor writes the pointer)
        # -- state folded by apply ----------------------------------------------------------
        self.versions: dict[int, VersionInfo] = {}
        self.evaluations: dict[int, EvalResult] = {}  # the latest per version (small)
        self.best: EvalResult | None = None  # the evaluation of the ``best`` slot's version
        self.learning_rate = cfg.learner.learning_rate
        self.sequence = 0  # rollback orders given
        self.applied = 0.0  # orders the learner followed
        self.pending: Rollback | None = None
        self.floor = 0  # evaluations of older versions belong to an abandoned lineage
        self.faults = 0
        self.untrusted = 0  # folded events refused: another producer, an address elsewhere
        # -- live only: decisions in progress, caches, measures for the heartbeat ----------
        self.waiting_evals: dict[int, EvalResult] = {}
        self._weights: OrderedDict[int, tuple[dict[str, torch.Tensor], dict[str, str]]] = \
            OrderedDict()
        self.last_measures: dict[str, float] = {}
        #: the probe log-probs of the version measured last: the next update's parent, so
        #: each update costs one pass over the probe set, not two (a version's weights are
        #: immutable: its checkpoint is addressed by hash)
        self._probed: tuple[int, torch.Tensor] | None = None

    def stats(self) -> dict[str, float]:
        return {"rollbacks": float(self.sequence), "faults": float(self.faults),
                "untrusted": float(self.untrusted),
                "best_version": float(self.best.policy_version if self.best else -1),
                **{f"update_{k}": v for k, v in self.last_measures.items()}}

    # -- the fold ---------------------------------------------------------------------------------
    def apply(self, event: Event) -> None:
        """Fold one input or output event into the state (a restart and live work alike)."""
        match event:
            case KeptCheckpoint() | Rollback() | CheckpointFault() if not self._ours(event):
                return
            case PolicyVersion():
                self.versions[event.version] = VersionInfo(
                    event.version, event.checkpoint, event.checkpoint_hash, event.parent,
                    event.reason)
                self.learning_rate = event.learning_rate or self.learning_rate
                self.applied = max(self.applied, event.metrics.get(APPLIED_KEY, 0.0))
                if event.reason == "rollback":
                    self.floor = max(self.floor, event.version)
                if self.pending is not None and self.applied >= self.pending.sequence:
                    self.pending = None
            case EvalResult():
                self.evaluations[event.policy_version] = event
                best = self.slots.slots.get("best")
                if best is not None and best.version == event.policy_version and \
                        (self.best is None or self.best.policy_version != best.version):
                    self.best = event  # the slot was read back before its evaluation
            case KeptCheckpoint():
                try:
                    self.slots.remember(Kept(event.slot, event.version, event.address,
                                             event.sha256))
                except UntrustedAddress as exc:
                    self._untrusted(event, str(exc))
                    return
                if event.slot == "best":
                    self.best = self.evaluations.get(event.version)
            case Rollback():
                self.sequence = max(self.sequence, event.sequence)
                if event.sequence > self.applied and \
                        (self.pending is None or event.sequence > self.pending.sequence):
                    self.pending = event
            case CheckpointFault():
                self.faults += 1

    def _ours(self, event: KeptCheckpoint | Rollback | CheckpointFault) -> bool:
        """An event of the keeper topic is folded only if this run's keeper wrote it."""
        if event.run_id == self.cfg.run.run_id and is_role(event.producer, "keeper"):
            return True
        self._untrusted(event, f"untrusted producer: {event.producer!r} of run "
                               f"{event.run_id!r} (only this run's keeper writes its topic)")
        return False

    def _untrusted(self, event: Event, why: str) -> None:
        self.untrusted += 1
        log.warning("keeper.untrusted_event", event_id=event.event_id, why=why)

    def handle(self, event: Event) -> list[Event]:
        """Live: apply the input, decide, and apply every output before returning it."""
        match event:
            case PolicyVersion():
                return self._on_policy_version(event)
            case EvalResult():
                self.apply(event)
                return self._on_eval(event)
        return []

    def _emit(self, event: Event) -> list[Event]:
        self.apply(event)
        return [event]

    # -- policy versions ----------------------------------------------------------------------
    def _on_policy_version(self, pv: PolicyVersion) -> list[Event]:
        self.apply(pv)
        out: list[Event] = []
        if pv.reason != "rollback" and pv.parent is not None and pv.parent in self.versions:
            out += self._measure_update(pv, pv.parent)
        if (waiting := self.waiting_evals.pop(pv.version, None)) is not None:
            out += self._on_eval(waiting)
        return out

    def _measure_update(self, pv: PolicyVersion, parent: int) -> list[Event]:
        try:
            new = self._tensors(pv.version)
            old = self._tensors(parent)
        except CheckpointError as exc:
            return self._fault(Fault("source", pv.version, pv.checkpoint, pv.checkpoint_hash,
                                     str(exc)), "")
        keeper = self.cfg.keeper
        measures = {"kl": self._probe_kl(parent, old, pv.version, new) if self.probe else 0.0,
                    "param_change": relative_param_change(old, new)}
        # an infinite KL (the new policy gives 0 to an action) is a reading, and events
        # carry finite floats: capped, it still reads as the largest update there is
        measures = {k: finite_reading(v, fallback=MAX_READING) for k, v in measures.items()}
        self.last_measures = measures
        large = (keeper.large_update_kl > 0 and measures["kl"] > keeper.large_update_kl) or \
                (keeper.large_update_param_change > 0
                 and measures["param_change"] > keeper.large_update_param_change)
        if not large:
            return []
        why = (f"v{pv.version} was a large update (kl {measures['kl']:.4f} > "
               f"{keeper.large_update_kl:g} or param_change {measures['param_change']:.4f} > "
               f"{keeper.large_update_param_change:g}): keeping its parent v{parent}")
        return self._keep("pre-large", parent, why, measures)

    def _probe_kl(self, parent: int, old: dict[str, torch.Tensor], version: int,
                  new: dict[str, torch.Tensor]) -> float:
        """Mean KL(parent || version) on the probe set; the parent's log-probs are reused
        when it was the version measured last."""
        if self._probed is not None and self._probed[0] == parent:
            logp_old = self._probed[1]
        else:
            logp_old = probe_logprobs(self.policy, old, self.probe)
        logp_new = probe_logprobs(self.policy, new, self.probe)
        self._probed = (version, logp_new)
        return mean_kl(logp_old, logp_new)

    # -- evaluations ----------------------------------------------------------------------------
    def _on_eval(self, ev: EvalResult) -> list[Event]:
        v = ev.policy_version
        if v < self.floor or self.pending is not None:
            return []
        if v not in self.versions:  # the eval overtook its policy-version: wait for it
            self.waiting_evals[v] = ev
            return []
        numbers = {"success_rate": ev.success_rate, "mean_score": ev.mean_score,
                   "episodes": float(ev.episodes)}
        if is_better(ev, self.best):
            why = f"best validation so far: success {ev.success_rate:.3f}, score {ev.mean_score:.3f}"
            return self._keep("best", v, why, numbers) + self._keep("stable", v, why, numbers)
        best = self.best
        assert best is not None  # is_better(ev, None) is always true
        keeper = self.cfg.keeper
        verdict = judge(best, ev, keeper.noise_k, keeper.min_regressed_metrics,
                        keeper.require_success_regression, keeper.success_alone_k)
        if not verdict.regressed or v <= best.policy_version:
            stable = self.slots.slots.get("stable")
            if stable is not None and stable.version > v:
                return []  # a late evaluation of an older version: "stable" is the latest
            why = f"validation within noise of best v{best.policy_version}"
            return self._keep("stable", v, why, numbers)
        return self._rollback(ev, verdict.why, verdict.evidence)

    def _rollback(self, ev: EvalResult, why: str, evidence: dict[str, float]) -> list[Event]:
        restored = self.slots.restore(exclude_versions=frozenset({ev.policy_version}))
        used = restored.kept.slot if restored.kept is not None else ""
        out: list[Event] = []
        for fault in restored.faults:
            out += self._fault(fault, used)
        if restored.kept is None:
            log.error("keeper.no_checkpoint", why=why)
            return out
        kept = restored.kept
        new_lr = self.learning_rate * self.cfg.keeper.lr_cut
        sequence = self.sequence + 1
        order = Rollback(
            event_id=event_id("rollback", self.cfg.run.run_id, sequence),
            run_id=self.cfg.run.run_id, producer=self.producer, key="keeper",
            sequence=sequence, regressed_version=ev.policy_version,
            restore_version=kept.version, slot=cast(KeptSlot, kept.slot),
            checkpoint=kept.address, checkpoint_hash=kept.sha256, learning_rate=new_lr,
            previous_learning_rate=self.learning_rate,
            why=(f"{why}. Rolling back to {kept.slot} v{kept.version}; learning rate "
                 f"{self.learning_rate:g} -> {new_lr:g}"),
            evidence=evidence)
        log.warning("keeper.rollback", why=order.why)
        return out + self._emit(order)

    # -- slots ------------------------------------------------------------------------------------
    def _keep(self, slot: KeptSlot, version: int, why: str, measures: dict[str, float]
              ) -> list[Event]:
        info = self.versions[version]
        try:
            tensors, identity = self._checkpoint(version)
            kept = self.slots.keep(slot, version, tensors, {
                **identity, "run_id": self.cfg.run.run_id, "source_version": str(version),
                "source_checkpoint": info.checkpoint, "source_sha256": info.checkpoint_hash,
                "why": why, **{f"measure.{k}": repr(v) for k, v in measures.items()}},
                on_saved=self._tell_best if slot == "best" else None)
        except CheckpointError as exc:
            return self._fault(Fault(slot, version, info.checkpoint, info.checkpoint_hash,
                                     str(exc)), "")
        return self._emit(KeptCheckpoint(
            event_id=event_id("kept", self.cfg.run.run_id, slot, version, kept.sha256),
            run_id=self.cfg.run.run_id, producer=self.producer, key="keeper", slot=slot,
            version=version, address=kept.address, sha256=kept.sha256, why=why,
            measures=measures))

    def best_pointer(self) -> BestVersion | None:
        """The pointer to the ``best`` slot's copy, with its validation (None: none yet)."""
        kept = self.slots.slots.get("best")
        ev = self.evaluations.get(kept.version) if kept is not None else None
        info = self.versions.get(kept.version) if kept is not None else None
        if kept is None or ev is None or info is None:
            return None
        return kept_best(self.cfg.run.run_id, ev, info.checkpoint, info.checkpoint_hash,
                         kept.address, kept.sha256)

    def _tell_best(self, kept: Kept) -> None:
        if self.on_best is None or (best := self.best_pointer()) is None:
            return
        try:
            self.on_best(best)
        except OSError as exc:  # the pointer is a convenience: the slot and its event stand
            log.error("keeper.best_pointer_failed", version=kept.version, error=str(exc))

    def _tensors(self, version: int) -> dict[str, torch.Tensor]:
        return self._checkpoint(version)[0]

    def _checkpoint(self, version: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        if version not in self._weights:
            info = self.versions[version]
            self._weights[version] = _load(info.checkpoint, info.checkpoint_hash)
            while len(self._weights) > 2:  # a parent and its child: weights can be large
                self._weights.popitem(last=False)
        return self._weights[version]

    def _fault(self, fault: Fault, fell_back_to: str) -> list[Event]:
        log.error("keeper.checkpoint_fault", slot=fault.slot, version=fault.version,
                  error=fault.error, fell_back_to=fell_back_to or None)
        return self._emit(CheckpointFault(
            event_id=event_id("checkpoint-fault", self.cfg.run.run_id, fault.slot,
                              fault.address, self.sequence, self.faults + 1),
            run_id=self.cfg.run.run_id, producer=self.producer, key="keeper",
            slot=fault.slot, version=fault.version, address=fault.address,
            expected_sha256=fault.expected_sha256, error=fault.error, fell_back_to=fell_back_to))
