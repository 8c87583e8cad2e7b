"""Keeper: three stable checkpoints, and a rollback order when a new version regresses.

consumes: policy-version (PolicyVersion), eval (EvalResult)
emits:    keeper (KeptCheckpoint, Rollback, CheckpointFault)
reads:    keeper, policy-version, eval (its history, a fold, on a restart)

What it keeps (``gyre_async.core.keeper_slots``): ``best`` validation, latest ``stable``
(validated without regression) and ``pre-large``, the version before the last large update.
An update is *large* when, against its parent, the mean KL of next-token distributions on
a fixed probe set exceeds ``keeper.large_update_kl`` or the relative weight change exceeds
``keeper.large_update_param_change`` (``gyre_async.rl.policy_distance``).

When a version's validation regresses beyond noise (``gyre_async.core.keeper_rules``: the
success rate below the best by more than ``noise_k`` binomial standard errors, and either by
more than ``success_alone_k`` or with at least ``min_regressed_metrics`` metrics in all),
the keeper restores the best slot (hash verified; a corrupt slot is reported as
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
abandoned lineage). Restart: the core (:mod:`gyre_async.core.keeper`) folds every event of
the ``keeper``, ``policy-version`` and ``eval`` topics with the same ``apply`` it uses live,
so slots, order count, pending order and best validation come back as they were.

**Trust** (:mod:`gyre_async.storage.roots`): a ``policy-version`` is taken only from this
run's learner with its checkpoint in ``learner.checkpoints`` (live, another is
dead-lettered; on restart, skipped), and the keeper topic's events only from this run's
keeper with their files in its own store; a replaced copy is removed only if its header says
this run's keeper wrote it (:class:`~gyre_async.core.keeper_slots.KeptSlots`).

**The run's best version.** Whenever the ``best`` slot changes, the keeper rewrites
``<run_dir>/best.json`` (:mod:`gyre_async.core.keeper_best`) to point at the new copy,
before the copy it replaces is removed; a restart writes it from the rebuilt slot if the
file is missing. ``gyre run`` settles it at the end against the final evaluation, which
the keeper does not wait for.
"""

from __future__ import annotations

import asyncio

from gyre_async.compose import build_policy, build_tokenizer
from gyre_async.core.keeper import KeeperCore
from gyre_async.core.keeper_best import read_best, write_best
from gyre_async.core.keeper_slots import KeptSlots
from gyre_async.core.probes import probe_contexts
from gyre_async.folds.restart import KeeperHistory
from gyre_async.runtime.actor import Actor, Emit
from gyre_async.storage.roots import StorageRoots
from schemas.config import Config
from schemas.events import EvalResult, PolicyVersion
from schemas.topics import EVAL, KEEPER, POLICY_VERSION


class Keeper(Actor):
    role = "keeper"
    consumes = (POLICY_VERSION, EVAL)
    emits = (KEEPER,)
    reads = (KEEPER,)  # its own orders, on a restart

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg)
        self.policy = build_policy(cfg, self.tokenizer)
        self.roots = StorageRoots.from_config(cfg)
        self.slots = KeptSlots(self.roots.keeper)
        self.core: KeeperCore | None = None
        self.history: KeeperHistory | None = None  # restored on start, applied, dropped

    @classmethod
    def from_config(cls, cfg: Config) -> Keeper:
        return cls(cfg)

    def folds(self):
        self.history = KeeperHistory(self.roots.trusts)
        return (self.history,)

    async def on_start(self) -> None:
        keeper = self.cfg.keeper
        probe = await probe_contexts(self.cfg, self.tokenizer, keeper.probe_contexts,
                                     keeper.probe_seed_start) if keeper.probe_contexts > 0 else []
        run_dir = self.cfg.run.run_dir
        self.core = KeeperCore(self.cfg, self.slots, self.policy, probe, self.runner.name,
                               on_best=lambda best: write_best(run_dir, best))
        assert self.history is not None
        for event in self.history.events:
            self.core.apply(event)
        self.core.untrusted += self.history.untrusted  # their live consumers dead-letter them
        self.history = None
        if (best := self.core.best_pointer()) is not None and \
                read_best(run_dir, self.cfg.run.run_id) is None:
            write_best(run_dir, best)  # a pointer lost (or never written): from the log

    async def handle(self, event, record):
        assert self.core is not None
        match event:
            case PolicyVersion() | EvalResult():
                if isinstance(event, PolicyVersion):
                    self.roots.checkpoint_of(event)  # untrusted: raised, dead-lettered
                out = await asyncio.to_thread(self.core.handle, event)
            case _:
                out = []
        return [Emit(KEEPER, e) for e in out]

    def stats(self):
        if self.core is None:
            return {}
        return self.core.stats()
