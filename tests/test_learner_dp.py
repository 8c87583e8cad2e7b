"""The data-parallel learner (``gyre_async.core.learner_dp``): two gloo processes train on
the same batches as one learner and end with its weights.

Two checks in the same two processes (one spawn keeps the test fast):

- exactness: one update with plain SGD and 3-step minibatches (so a rank often owns no
  row of a minibatch), the critic refit included, equals one learner's to 1e-6; SGD moves
  the weights by the gradient itself, so any error in the loss shares would show.
- the real path: a leader and a follower (the orders, Adam) through two updates, so the
  second starts from Adam moments and the refit (every 2nd update here) runs. Whether a
  difference from the single learner is *real* (a rank trained on other rows) or
  *numerical* (the same rows, summed in another order) is told apart by two checks:
  the rows, compared exactly (every gradient step: the same batch, bit for bit, on every
  rank; the ranks' rows disjoint and together the single learner's minibatch), then the
  weights, within a tolerance for float32 rounding that Adam amplifies (see the test).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
import torch
import torch.multiprocessing as mp
from test_critic import config, make_batch

from gyre_async.compose import build_policy
from gyre_async.core.learner import LearnerCore, TrainResult
from gyre_async.core.learner_dp import LearnerGroup, Membership, membership, run_follower
from gyre_async.core.learner_ppo import PpoEpochs
from gyre_async.errors import ConfigError
from gyre_async.storage.checkpoints import CheckpointRef
from gyre_async.storage.segments import SegmentStore

replace = msgspec.structs.replace
REF = CheckpointRef(address="file:///nowhere/v.safetensors", sha256="0" * 64, version=0)
BATCHES = 2


def train(core: LearnerCore, store: SegmentStore, batches, group: LearnerGroup | None = None):
    """What the learner actor does per batch: admit, read arrays, update, publish."""
    core.publish("init", REF, "learner", {})
    if group is not None:
        group.started(core, resumed=False)
    metrics = []
    for scored in batches:
        for offset, segment in enumerate(scored):
            assert core.add(segment, (0, offset)) is None
        core.attach_arrays(store.read_many(core.buffered_addresses()))
        result = group.update(core) if group is not None else core.update()
        assert isinstance(result, TrainResult) and not result.skipped
        core.publish("update", REF, "learner", result.metrics, result)
        metrics.append(result.metrics)
    return metrics


def weights(core: LearnerCore) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in core.policy._model.state_dict().items()}


def sgd_update(core: LearnerCore, store: SegmentStore, scored) -> dict[str, torch.Tensor]:
    core.optimizer = torch.optim.SGD(core.policy.parameters(), lr=core.learning_rate)
    core.publish("init", REF, "learner", {})
    for offset, segment in enumerate(scored):
        assert core.add(segment, (0, offset)) is None
    core.attach_arrays(store.read_many(core.buffered_addresses()))
    assert isinstance(core.update(), TrainResult)
    return weights(core)


def sgd_config(cfg):
    return replace(cfg, learner=replace(cfg.learner, minibatch_steps=3, epochs=1,
                                        value_refit_every=1))


Rows = list[tuple[list[str], str, list[int]]]


def recording_rows(log: Rows) -> Callable[..., dict[str, float]]:
    """A spy for :meth:`PpoEpochs._accumulate` (which it still runs): per gradient step,
    the batch's segments (in its order), its advantage digest and the rows (indices into
    the batch) this process back-propagates."""
    inner = PpoEpochs._accumulate

    def accumulate(self, rows: list[int], mb_rows: int, mb_tokens: int) -> dict[str, float]:
        log.append((list(self.ids), self.prep.digest, list(rows)))
        return inner(self, rows, mb_rows, mb_tokens)

    return accumulate


def _rank_main(rank: int, cfg, batches, out_dir: str) -> None:
    torch.set_num_threads(1)
    member = Membership(rank, 2, cfg.learner.rendezvous)
    sgd_cfg = sgd_config(cfg)
    torch.manual_seed(cfg.run.seed)
    policy = build_policy(sgd_cfg)
    dp = LearnerGroup(member).attach(policy)  # the group the protocol below reuses
    store = SegmentStore(f"{cfg.run.run_dir}/segments.zarr", read_only=True)
    sgd = sgd_update(LearnerCore(sgd_cfg, policy, None, dp), store, batches[0])
    rows: Rows = []
    PpoEpochs._accumulate = recording_rows(rows)  # type: ignore[method-assign]
    if rank == 0:
        group = LearnerGroup(member)
        torch.manual_seed(cfg.run.seed)
        policy = build_policy(cfg)
        core = LearnerCore(cfg, policy, None, group.attach(policy))
        metrics = train(core, store, batches, group)
        group.stop()
    else:
        core, metrics = run_follower(cfg, member), None
    torch.save({"weights": weights(core), "metrics": metrics, "version": core.version,
                "sgd": sgd, "rows": rows}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_two_gloo_ranks_update_exactly_like_one_learner(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    behaviour = build_policy(cfg)
    batches = [make_batch(cfg, behaviour, store, b) for b in range(1, BATCHES + 1)]

    torch.manual_seed(cfg.run.seed)
    single_sgd = sgd_update(LearnerCore(sgd_config(cfg), build_policy(cfg)), store, batches[0])
    torch.manual_seed(cfg.run.seed)
    single = LearnerCore(cfg, build_policy(cfg))
    start = weights(single)
    single_rows: Rows = []
    monkeypatch.setattr(PpoEpochs, "_accumulate", recording_rows(single_rows))
    single_metrics = train(single, store, batches)
    monkeypatch.undo()

    group_cfg = replace(cfg, learner=replace(cfg.learner, world_size=2,
                                             rendezvous=f"file://{tmp_path}/rendezvous"))
    mp.spawn(_rank_main, args=(group_cfg, batches, str(tmp_path)), nprocs=2, join=True)
    leader, follower = (torch.load(f"{tmp_path}/rank{r}.pt", weights_only=True) for r in (0, 1))

    assert follower["version"] == BATCHES - 1  # it saw every update (the leader publishes)

    # Real differences, checked exactly: in every gradient step both ranks hold the single
    # learner's batch (its segments in its order; the same advantages bit for bit on both
    # ranks), and the rows they back-propagate are disjoint and together the single
    # learner's minibatch.
    assert len(leader["rows"]) == len(follower["rows"]) == len(single_rows) > 0
    for step, ((ids, _, whole), (ids0, digest0, rows0), (ids1, digest1, rows1)) in enumerate(
            zip(single_rows, leader["rows"], follower["rows"])):
        assert ids0 == ids1 == ids and digest0 == digest1, f"step {step}: another batch"
        assert not set(rows0) & set(rows1), f"step {step}: rows computed by both ranks"
        assert sorted(rows0 + rows1) == sorted(whole), f"step {step}: other rows"

    for name, expected in single_sgd.items():
        for rank in (leader, follower):
            assert torch.allclose(rank["sgd"][name], expected, rtol=0, atol=1e-6), name

    # Numerical differences: the same rows summed in another order (each rank's share,
    # then the all-reduce) differ from one pass by float32 rounding, ~1e-7 of the gradient
    # in the first step. Adam divides each gradient element by its own running magnitude,
    # so rounding on elements whose gradient is near zero (the attention's key bias has
    # none at all: softmax ignores it) moves them by up to a learning rate, and later
    # steps start from slightly other weights. Here it stays below 3e-4 of the distance
    # the single learner moved each tensor (the single learner on 1 thread instead of 2
    # differs from itself by as much); a bound of 1e-2 leaves room for other CPUs'
    # kernels. A row trained by the wrong rank shows above, exactly.
    moved = {name: (w - start[name]).norm() for name, w in weights(single).items()}
    assert all(m > 0 for m in moved.values())  # the update moved every tensor
    for name, expected in weights(single).items():
        assert torch.equal(leader["weights"][name], follower["weights"][name]), name
        apart = (leader["weights"][name] - expected).norm()
        assert apart <= 1e-2 * moved[name], f"{name}: {apart / moved[name]:.1e} of its move"
    for mine, theirs in zip(leader["metrics"], single_metrics):  # the same rounding: <2e-5
        assert mine.keys() == theirs.keys()
        for key in ("losses/policy_loss", "losses/value_loss", "losses/entropy",
                    "losses/approx_kl", "losses/clip_fraction", "losses/grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-3, abs=1e-6), key
    assert "losses/value_refit" in leader["metrics"][-1]


def test_membership_follows_torchrun_and_refuses_what_it_cannot_do(tmp_path):
    cfg = config(tmp_path)
    assert membership(cfg, {}) == Membership(0, 1, "tcp://127.0.0.1:29511")
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert membership(cfg, torchrun) == Membership(1, 2, "env://")
    two = replace(cfg, learner=replace(cfg.learner, world_size=2, rendezvous="file:///r"))
    assert membership(two, {"RANK": "1"}) == Membership(1, 2, "file:///r")
    with pytest.raises(ConfigError, match="RANK"):
        membership(two, {"RANK": "2"})
    with pytest.raises(ConfigError, match="elite"):
        membership(replace(two, elite=replace(two.elite, capacity=4)), {})


def test_gyre_run_refuses_a_data_parallel_learner_with_the_fix(tiny):
    import asyncio

    from gyre_async.errors import ConfigError
    from gyre_async.runtime.loop import run_loop

    cfg = tiny.config(learner={"world_size": 2})
    with pytest.raises(ConfigError, match="--replicas learner=N"):
        asyncio.run(run_loop(cfg))
