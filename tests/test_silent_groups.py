"""``learner.fusion_silent_groups = "skip"``: a group whose returns were all equal trains
nothing of the policy, and ``gyre replay learner`` still re-derives the update's digest.

Fusion's local signal is scaled to unit RMS over the batch, so in a batch that is one silent
group (8 plays of one Simon Says game that all won every milestone) the critic's errors
become a full-size policy gradient. ``skip`` gives such segments no advantage, as the
outcome-only baseline does; the default ``local`` keeps today's behaviour.
"""

from __future__ import annotations

import pytest
import torch
from msgspec.structs import replace
from test_critic import config
from test_learner_digest import ragged_batch

from gyre_async.compose import build_policy
from gyre_async.core.learner import LearnerCore
from gyre_async.core.learner_batch import BatchItem, prepare_batch
from gyre_async.storage.segments import SegmentStore


@pytest.mark.parametrize("silent", ["local", "skip"])
def test_a_silent_group_moves_the_policy_only_where_asked(tmp_path, silent):
    cfg = config(tmp_path)
    cfg = replace(cfg, learner=replace(cfg.learner, credit="fusion",
                                       fusion_silent_groups=silent))
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    torch.manual_seed(cfg.run.seed)
    policy = build_policy(cfg)
    parent = {k: v.clone() for k, v in policy.state_dict().items()}
    scored = ragged_batch(policy, store, seed=3)  # four finished trajectories of one task
    core = LearnerCore(cfg, policy)
    for offset, segment in enumerate(scored):
        assert core.add(segment, (0, offset)) is None
    core.attach_arrays(store.read_many(core.buffered_addresses()))
    silent_group = [0.0] * len(scored)  # every outcome known, all equal: g = 0 exactly
    result = core.update(silent_group)
    skipped = result.metrics["losses/policy_step_skipped"]
    assert skipped == (1.0 if silent == "skip" else 0.0), result.metrics

    replayer = build_policy(cfg)
    replayer.load_state_dict(parent)
    items = [BatchItem(s, a) for s, a in zip(scored, store.read_many(
        [s.address for s in scored]))]
    s = cfg.learner
    replayed = prepare_batch(replayer, items, s.gamma, s.lam, silent_group, s.credit,
                             s.fusion_max_weight, s.mask_failed,
                             silent_groups=s.fusion_silent_groups)  # as gyre replay does
    assert replayed.digest == result.advantage_digest
    if silent == "skip":
        assert bool((replayed.advantages == 0).all())
        assert bool((replayed.local_advantages != 0).any())  # the critic had an opinion
    else:
        assert bool((replayed.advantages != 0).any())
