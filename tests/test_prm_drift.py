"""Drift monitor: agreement metrics against slow references, and a drifted model's weight
dropping (and coming back) in the arbiter, through the real embedded bus."""

from __future__ import annotations

import itertools
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_async.rewards.drift import pairwise_accuracy, spearman
from gyre_async.rewards.prm import LabelledSegment, save_prm, train_prm
from schemas.config import ArbiterConfig, ProcessRewardConfig
from schemas.events import DriftReport, Scored
from schemas.topics import SCORED, SEGMENT_CLOSED, TELEMETRY
from tests.test_arbitration import seg
from tests.test_prm import workshop_segments


def slow_pairwise(model, reference, margins):
    hits = []
    for i, j in itertools.combinations(range(len(model)), 2):
        if reference[i] == reference[j]:
            continue
        hi, lo = (i, j) if reference[i] > reference[j] else (j, i)
        hits.append(1.0 if model[hi] > model[lo] else 0.5 if model[hi] == model[lo] else 0.0)
    hits += [1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margins]
    return len(hits), (sum(hits) / len(hits) if hits else math.nan)


def slow_spearman(a, b):
    def ranks(x):  # rank = 1 + number below + half the others tied
        return [1 + sum(y < v for y in x) + (sum(y == v for y in x) - 1) / 2 for v in x]
    if len(a) < 2 or len(set(a)) == 1 or len(set(b)) == 1:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


scores = st.lists(st.sampled_from([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0]), min_size=0, max_size=9)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_agreement_metrics_match_slow_references(data):
    model = data.draw(scores)
    reference = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=len(model),
                                   max_size=len(model)))
    margins = data.draw(st.lists(st.sampled_from([-0.3, 0.0, 0.2]), max_size=3))
    n, acc = pairwise_accuracy(model, reference, margins)
    n_slow, acc_slow = slow_pairwise(model, reference, margins)
    assert n == n_slow and (acc == acc_slow or (math.isnan(acc) and math.isnan(acc_slow)))
    rho, rho_slow = spearman(model, reference), slow_spearman(model, reference)
    assert (rho is None) == (rho_slow is None)
    if rho is not None:
        assert math.isclose(rho, rho_slow, abs_tol=1e-9) and -1 - 1e-9 <= rho <= 1 + 1e-9


async def test_a_drifted_model_loses_its_weight_and_regains_it(tmp_path, scratch_bus):
    from actors.arbiter import Arbiter

    good, bad = workshop_segments(1, 20, 0.0), workshop_segments(2, 20, 0.6)
    labels = [LabelledSegment(tuple(a), 1.0) for a in good] + \
        [LabelledSegment(tuple(a), 0.0) for a in bad]
    flipped = [LabelledSegment(e.actions, 1.0 - e.label) for e in labels]
    reference = tmp_path / "reference.jsonl"
    with open(reference, "w") as f:
        for a in workshop_segments(5, 6, 0.0):
            f.write(json.dumps({"actions": a, "score": 1.0}) + "\n")
        for a in workshop_segments(6, 6, 0.6):
            f.write(json.dumps({"actions": a, "score": 0.0}) + "\n")
        f.write(json.dumps({"better": workshop_segments(7, 1, 0.0)[0],
                            "worse": workshop_segments(8, 1, 0.7)[0]}) + "\n")
    path = tmp_path / "prm.safetensors"
    config = ArbiterConfig(prm=ProcessRewardConfig(
        path=str(path), weight=0.1, reference=str(reference), check_every_segments=2,
        min_agreement=0.75, drifted_weight_factor=0.0))
    segments = iter(seg(a, traj=f"t{i}") for i, a in enumerate(workshop_segments(9, 10, 0.2)))

    bus = scratch_bus

    async def score(k: int) -> tuple[list[DriftReport], list[Scored]]:
        """Score k more segments with a fresh arbiter (a restart each time)."""
        batch = [next(segments) for _ in range(k)]
        before = len(await bus.events(SCORED))
        await bus.publish(SEGMENT_CLOSED, *batch)

        async def all_scored() -> bool:
            return len(await bus.events(SCORED)) >= before + k

        await bus.run(Arbiter(config), all_scored, 30, run_id="r")
        ids = {s.segment_id for s in batch}
        scored = [e for e in await bus.events(SCORED)
                  if isinstance(e, Scored) and e.segment_id in ids]
        reports = [e for e in await bus.events(TELEMETRY) if isinstance(e, DriftReport)]
        return sorted(reports, key=lambda r: r.segments_scored), scored

    save_prm(train_prm(labels), str(path))
    reports, scored = await score(4)
    assert [r.segments_scored for r in reports] == [0, 2]
    assert all(r.pairwise_accuracy >= 0.9 and r.rank_correlation > 0.7 for r in reports)
    assert all(r.weight == 0.1 and not r.drifted for r in reports)
    assert [s.components["prm:weight"] for s in scored] == [0.1] * 4

    save_prm(train_prm(flipped), str(path))  # the model drifts: trained on flipped labels
    reports, scored = await score(4)
    drifted = [r for r in reports if r.segments_scored >= 4]
    assert [r.segments_scored for r in drifted] == [4, 6]
    assert all(r.pairwise_accuracy <= 0.25 and r.rank_correlation < 0 for r in drifted)
    assert all(r.drifted and r.weight == 0.0 for r in drifted)
    assert [s.components["prm:weight"] for s in scored] == [0.0] * 4
    assert all(s.components["prm"] == 0.0 for s in scored)

    save_prm(train_prm(labels), str(path))  # fixed: agreement recovers, weight returns
    reports, scored = await score(2)
    assert reports[-1].segments_scored == 8 and not reports[-1].drifted
    assert reports[-1].weight == 0.1
    assert [s.components["prm:weight"] for s in scored] == [0.1] * 2
