"""The keeper on the quickstart's collapse pattern, and on dips that are only noise.

The collapse: validation success 27/32 = 0.84 at its best, then 7/32 = 0.22 and 9/32 =
0.28 (32 episodes each), while the score and the milestone rates (near their ceiling:
a policy that stops finishing still does most sub-tasks) fell by less than 3 standard
errors. The values below are shaped like the quickstart's recorded evaluations (six
crafting milestones). Worked out (``drop_z``, pooled two-proportion binomial):

- success 0.844 -> 0.219: pooled 34/64 = 0.531, se = sqrt(0.531 * 0.469 * 2/32) = 0.125,
  z = 0.625 / 0.125 = 5.01; -> 0.281: pooled 36/64 = 0.5625, se = 0.124, z = 4.54;
- score 0.95 -> 0.72: pooled 0.835, se = sqrt(0.835 * 0.165 * 2/32) = 0.0928, z = 2.48;
- the largest milestone drop, 0.875 -> 0.656: pooled 0.766, se = 0.106, z = 2.07.

The old rule (a second metric beyond ``noise_k`` = 3 required) saw one metric and did not
roll back; the success rate alone beyond ``success_alone_k`` = 4 now decides.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from scratch import wait_until
from test_keeper import _path, _pv, _versions

from actors.keeper import Keeper
from gyre_async.core.keeper import KeeperCore
from gyre_async.core.keeper_best import final_and_best, read_best, settle_best
from gyre_async.core.keeper_rules import drop_z, judge
from gyre_async.core.keeper_slots import KeptSlots
from gyre_async.folds.runlog import load_runlog
from gyre_async.storage.checkpoints import CheckpointStore
from schemas import event_id
from schemas.events import EvalResult, KeptCheckpoint, Rollback
from schemas.topics import EVAL, KEEPER, POLICY_VERSION

CRAFTS = ("axe", "hammer", "lamp", "pick", "saw", "shovel")


def quickstart_eval(version: int, success: float, score: float, milestones: tuple[float, ...],
                    episodes: int = 32) -> EvalResult:
    return EvalResult(event_id=event_id("eval", version, success, score), run_id="tiny",
                      producer="test", key="eval", policy_version=version, episodes=episodes,
                      success_rate=success, mean_score=score, mean_length=60.0,
                      milestone_rates={f"craft:{c}": r for c, r in zip(CRAFTS, milestones)})


START = quickstart_eval(0, 0.0, 0.41, (0.406, 0.625, 0.531, 0.406, 0.531, 0.656))
PEAK = quickstart_eval(1, 27 / 32, 0.95, (0.875, 0.875, 0.75, 0.781, 0.719, 0.906))
COLLAPSE = quickstart_eval(2, 7 / 32, 0.72, (0.656, 0.781, 0.625, 0.594, 0.656, 0.812))
STAYS_DOWN = quickstart_eval(3, 9 / 32, 0.75, (0.688, 0.781, 0.656, 0.625, 0.688, 0.844))


def test_collapse_pattern_numbers_and_verdicts():
    collapse = judge(PEAK, COLLAPSE, noise_k=3.0, min_metrics=2)
    z = collapse.evidence
    assert z["success_rate/z"] == pytest.approx(0.625 / np.sqrt(34 / 64 * 30 / 64 * 2 / 32))
    assert z["success_rate/z"] == pytest.approx(5.01, abs=0.01)
    assert z["mean_score/z"] == pytest.approx(2.48, abs=0.01)
    assert drop_z(0.95, 32, 0.72, 32) == pytest.approx(0.23 / np.sqrt(0.835 * 0.165 * 2 / 32))
    assert drop_z(0.875, 32, 0.656, 32) == pytest.approx(2.07, abs=0.01)
    assert drop_z(27 / 32, 32, 9 / 32, 32) == \
        pytest.approx(0.5625 / np.sqrt(36 / 64 * 28 / 64 * 2 / 32))
    assert max(v for k, v in z.items() if k.startswith("milestone/") and k.endswith("/z")) == \
        pytest.approx(2.07, abs=0.01)
    assert collapse.regressed and collapse.regressed_metrics == ("success_rate",)
    assert "decisive alone" in collapse.why and "0.844->0.219 (z=5.01)" in collapse.why
    later = judge(PEAK, STAYS_DOWN, 3.0, 2)
    assert later.regressed and later.evidence["success_rate/z"] == pytest.approx(4.54, abs=0.01)
    # The old rule (success alone never enough) missed both: no second metric beyond 3.
    for new in (COLLAPSE, STAYS_DOWN):
        assert not judge(PEAK, new, 3.0, 2, success_alone_k=0.0).regressed


@pytest.mark.parametrize("best, new, why", [
    # noise: 27/32 -> 21/32 (z = 1.65), and 27/32 -> 17/32 (pooled 44/64, z = 2.70)
    (PEAK, quickstart_eval(2, 21 / 32, 0.90, (0.844, 0.844, 0.719, 0.75, 0.688, 0.875)),
     "within noise"),
    (PEAK, quickstart_eval(2, 17 / 32, 0.85, (0.75, 0.844, 0.688, 0.688, 0.688, 0.875)),
     "within noise"),
    # between 3 and 4 standard errors without a second metric: the quickstart's v35 -> v40,
    # success 0.75 -> 0.375 (z = 3.02), score 0.934 -> 0.772 (z = 1.83)
    (quickstart_eval(1, 0.75, 0.934, (0.844, 0.844, 0.719, 0.75, 0.688, 0.875)),
     quickstart_eval(2, 0.375, 0.772, (0.688, 0.812, 0.656, 0.625, 0.719, 0.812)),
     "3 < z <= 4, alone"),
    # early training: success still 0 while partial progress narrows (score 0.54 -> 0.23,
    # one milestone 0.781 -> 0.406: z = 3.05)
    (quickstart_eval(1, 0.0, 0.54, (0.594, 0.688, 0.625, 0.531, 0.562, 0.781)),
     quickstart_eval(2, 0.0, 0.23, (0.25, 0.5, 0.375, 0.25, 0.312, 0.406)),
     "partial metrics alone"),
])
def test_noise_sized_and_partial_dips_do_not_regress(best, new, why):
    verdict = judge(best, new, 3.0, 2)
    assert not verdict.regressed, (why, verdict.evidence)
    if why == "3 < z <= 4, alone":
        assert verdict.evidence["success_rate/z"] == pytest.approx(3.02, abs=0.01)
        assert verdict.regressed_metrics == ("success_rate",)  # one metric, not decisive
    if why == "partial metrics alone":
        assert verdict.evidence["success_rate/z"] == 0.0 and verdict.regressed_metrics


@pytest.mark.parametrize("success", [0.3, 0.5, 0.8])
def test_success_alone_rarely_fires_on_a_plateau_against_its_running_best(success):
    """A policy that does not change, evaluated 40 times on 32 episodes, judged each time
    against the best so far (the maximum: the winner's curse inflates every drop). The
    docstring's figures: beyond 3 standard errors in 1.6-2.1% of evaluations, beyond 4 in
    0.02-0.06%. Score and milestones are held flat so that only the success rate can
    regress (the alone rule, isolated)."""
    rng = np.random.default_rng(11)
    judged = fired_at_3 = fired_at_4 = 0
    for _ in range(400):
        rates = rng.binomial(32, success, 40) / 32
        best = quickstart_eval(0, rates[0], 0.9, (0.9,) * 6)
        for version, rate in enumerate(rates[1:], start=1):
            new = quickstart_eval(version, rate, 0.9, (0.9,) * 6)
            judged += 1
            fired_at_3 += judge(best, new, 3.0, 2, success_alone_k=3.0).regressed
            fired_at_4 += judge(best, new, 3.0, 2, success_alone_k=4.0).regressed
            if rate > best.success_rate:
                best = new
    assert fired_at_4 / judged < 0.002  # 0.02-0.06% expected
    assert fired_at_3 / judged > 0.008  # 1.6-2.1% expected: why 3 alone would be too eager


def test_noise_dips_through_the_core_keep_stable_and_never_roll_back(tmp_path, tiny):
    """The real core (checkpoints copied into real slots), no bus: a run that rises, dips
    within noise twice and narrows early on is kept, never rolled back."""
    cfg = tiny.config(keeper={"probe_contexts": 0})
    refs, _ = _versions(cfg, tmp_path / "run" / "checkpoints", [0.01] * 4)
    core = KeeperCore(cfg, KeptSlots(str(tmp_path / "kept")), None, [])
    evals = [START, quickstart_eval(1, 0.0, 0.30, (0.3, 0.6, 0.5, 0.3, 0.4, 0.5)),
             msgspec.structs.replace(PEAK, policy_version=2),
             quickstart_eval(3, 21 / 32, 0.90, (0.844,) * 6),
             quickstart_eval(4, 17 / 32, 0.85, (0.75,) * 6)]
    out = []
    for ref, ev in zip(refs, evals):
        out += core.handle(_pv(ref, ref.version - 1 if ref.version else None))
        out += core.handle(ev)
    assert not any(isinstance(e, Rollback) for e in out)
    assert core.best is not None and core.best.policy_version == 2
    assert core.slots.slots["stable"].version == 4


async def _run_keeper_on(scratch_bus, cfg, evals):
    """Run the keeper actor until it has handled ``evals``; its ``keeper`` topic after."""
    async with scratch_bus.running(Keeper(cfg), name="keeper") as keeper:
        await scratch_bus.publish(EVAL, *evals)

        async def rolled_back() -> bool:
            return any(isinstance(e, Rollback) for e in await scratch_bus.events(KEEPER))

        assert await wait_until(rolled_back, 60, keeper), \
            f"timed out waiting on {[KEEPER]}: {await scratch_bus.events(KEEPER)}"
        # then every input handled (v3's evaluation too)
        assert await wait_until(keeper.caught_up, 30, keeper), \
            f"keeper never caught up: {await keeper.unconsumed()}"
    return await scratch_bus.events(KEEPER)


async def test_keeper_rolls_back_the_quickstart_collapse_and_points_at_the_peak(tmp_path, tiny,
                                                                                scratch_bus):
    """The keeper actor on a real embedded bus: v0 start, v1 peak, v2 collapse, v3 stays
    down. It orders one rollback (to the best slot, v1) at v2's evaluation and judges
    nothing while the order is pending; ``best.json`` names the keeper's copy of v1. The
    run's end (``settle_best`` over the log, as ``gyre run`` does) keeps v1 as the best and
    v3 as the final version."""
    cfg = tiny.config(keeper={"probe_contexts": 0})
    run_dir = tmp_path / "run"
    refs, _ = _versions(cfg, run_dir / "checkpoints", [0.01] * 3)

    scratch_bus.partitions = 2  # its topics and runner
    await scratch_bus.publish(POLICY_VERSION, *[_pv(r, r.version - 1 if r.version else None)
                                                for r in refs])
    out = await _run_keeper_on(scratch_bus, cfg, [START, PEAK, COLLAPSE, STAYS_DOWN])
    log = await load_runlog(scratch_bus.bus, with_steps=False)
    orders = [e for e in out if isinstance(e, Rollback)]
    assert len(orders) == 1, orders
    order = orders[0]
    assert (order.regressed_version, order.restore_version, order.slot) == (2, 1, "best")
    assert order.evidence["success_rate/z"] == pytest.approx(5.01, abs=0.01)
    assert "decisive alone" in order.why
    best_kept = [e for e in out if isinstance(e, KeptCheckpoint) and e.slot == "best"][-1]
    pointer = read_best(str(run_dir), "tiny")
    assert pointer is not None and pointer.version == 1 and pointer.chosen_by == "keeper"
    assert (pointer.checkpoint, pointer.checkpoint_hash) == (best_kept.address, best_kept.sha256)
    assert (pointer.source_checkpoint, pointer.source_checkpoint_hash) == \
        (refs[1].address, refs[1].sha256)
    assert pointer.success_rate == PEAK.success_rate and pointer.episodes == 32
    CheckpointStore(str(_path(pointer.checkpoint).parent)).load(
        pointer.checkpoint, pointer.checkpoint_hash)  # the copy is there and verifies
    assert len(list((run_dir / "keeper").glob("v000000000000-*"))) == 0  # v0's copies gone

    settled = settle_best(str(run_dir), "tiny", log.evals, log.versions)
    assert settled == pointer  # every evaluation of the run is below the keeper's choice
    summary = final_and_best("tiny", log.evals, log.versions, settled)
    assert summary["final"]["version"] == 3 and summary["final"]["success"] == 9 / 32
    assert summary["final"]["checkpoint"] == refs[3].address
    assert summary["best"]["version"] == 1 and summary["best"]["success"] == 27 / 32
    assert summary["best"]["checkpoint_hash"] == best_kept.sha256
