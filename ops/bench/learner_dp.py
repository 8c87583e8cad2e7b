"""Data-parallel learner: updates/s with 1 and 2 learner processes on the same batch.

The quickstart's model and learner settings (``ops/configs/quickstart.toml``: d_model 64,
2 layers, 1,024-step batches, 4 epochs of 256-step minibatches), on one synthetic batch
of scored segments (workshop words as contexts, actions sampled by the initial policy,
rewards from a seeded generator): the same data for both runs. Each run makes one warm-up
update, then ``--updates`` timed ones through the learner's own path (admit, update,
publish; checkpoints are not written: the leader saves them, as one learner does).

The 2-process run is a real ``torch.distributed`` group on gloo (leader + follower, see
``gyre_async.core.learner_dp``). Each process runs ``--threads`` torch threads (default
1): a learner process is one worker, and the question is whether a second worker adds
throughput. That needs a free core for it: on a shared machine the processes compete with
everything else running there.

Equality: ``max_abs_weight_diff`` is the largest weight difference between the two runs
after the warm-up update (the same batch from the same initial weights): float32
tolerance. ``max_abs_weight_diff_per_update`` follows it through the timed updates.

Last line: {"bench": "learner_dp", "updates_per_s": {"1": x, "2": x},
"max_abs_weight_diff": x, ...}
"""

from __future__ import annotations

import argparse
import os
import random
import time

import msgspec
import torch
import torch.multiprocessing as mp
from _common import QUICKSTART, make_config, print_result, scratch_dir

from gyre_async.compose import build_policy, run_vocabulary
from gyre_async.core.learner import LearnerCore, TrainResult
from gyre_async.core.learner_dp import LearnerGroup, Membership, run_follower
from gyre_async.core.segmenter import ClosedSegment, segment_arrays
from gyre_async.policy.base import SamplingParams
from gyre_async.storage.checkpoints import CheckpointRef
from gyre_async.storage.segments import SegmentStore
from schemas import event_id
from schemas.events import Scored, TrajectoryStep

REF = CheckpointRef(address="file:///bench/v.safetensors", sha256="0" * 64, version=0)
SEGMENT_STEPS = 32


def configure(args, run_dir: str, world_size: int):
    return make_config(args.config, run={"run_dir": run_dir, "run_id": "learner-dp"},
                       learner={"max_versions": 0, "batch_steps": args.batch_steps,
                                "world_size": world_size,
                                "rendezvous": f"file://{run_dir}/rendezvous-{world_size}"},
                       elite={"capacity": 0})


def synthetic_batch(cfg, store: SegmentStore, steps: int, seed: int) -> list[Scored]:
    """``steps`` steps of two-segment trajectories: workshop words as contexts, actions
    sampled by the initial policy, a few milestone rewards and outcomes for half of them."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    policy = build_policy(cfg)
    words = list(run_vocabulary(cfg).words)
    tok = policy.tokenizer
    n_ctx = steps + steps // SEGMENT_STEPS // 2
    budget = cfg.policy.context_tokens - cfg.policy.max_action_tokens - 2
    contexts = [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))))
                [-budget:] for _ in range(n_ctx)]
    acts = policy.act_batch(contexts,
                            SamplingParams(max_action_tokens=cfg.policy.max_action_tokens))
    segments, events, used = [], [], 0
    for k in range(steps // (2 * SEGMENT_STEPS)):
        tid = f"t{k}"
        for s in range(2):
            done = s == 1
            span = range(s * SEGMENT_STEPS, (s + 1) * SEGMENT_STEPS)
            rows = [used + i for i in span]
            trajectory_steps = tuple(TrajectoryStep(
                event_id=f"{tid}-{i}", run_id="learner-dp", producer="bench", trajectory_id=tid,
                task_id=f"task-{k // 4}", step_index=i, policy_version=0,
                context_tokens=contexts[row], action_tokens=acts[row].tokens,
                action_logprobs=acts[row].logprobs, next_context_tokens=contexts[row + 1],
                done=done and i == span[-1]) for i, row in zip(span, rows))
            seg_id = f"{tid}-s{s}"
            segments.append((seg_id, segment_arrays(ClosedSegment(
                tid, trajectory_steps, "trajectory-end" if done else "max-length", terminal=done))))
            rewards = [0.1 if rng.random() < 0.05 else 0.0 for _ in span]
            if done and rng.random() < 0.5:
                rewards[-1] += 1.0
            events.append((tid, k, seg_id, span, done, rewards))
        used += 2 * SEGMENT_STEPS + 1
    out = []
    for (tid, k, seg_id, span, done, rewards), ref in zip(events, store.write_many(segments)):
        out.append(Scored(
            event_id=event_id("scored", seg_id), run_id="learner-dp", producer="bench",
            key=tid, segment_id=seg_id, trajectory_id=tid, task_id=f"task-{k // 4}",
            address=ref.address, content_hash=ref.content_hash, step_start=span[0],
            step_end=span[-1] + 1, min_policy_version=0, trajectory_done=done,
            success=done and rewards[-1] >= 1.0, components={}, step_rewards=rewards,
            total=sum(rewards), decided_by="outcome"))
    return out


def one_update(core: LearnerCore, store: SegmentStore, batch: list[Scored], group) -> None:
    """The learner's path for one batch: admit (fresh, at the learner's version), read the
    arrays, update, publish."""
    for offset, scored in enumerate(batch):
        fresh = msgspec.structs.replace(scored, min_policy_version=max(core.version, 0))
        if core.add(fresh, (0, offset)) is not None:
            raise RuntimeError("bench batch refused")
    core.attach_arrays(store.read_many(core.buffered_addresses()))
    result = group.update(core)
    if not isinstance(result, TrainResult) or result.skipped:
        raise RuntimeError(f"bench update did not train: {result}")
    core.publish("update", REF, "learner", result.metrics, result)


def weights(core: LearnerCore) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in core.policy.model.named_parameters()}


def rank_main(rank: int, cfg, batch, updates: int, threads: int, out: str) -> None:
    """One learner process: rank 0 leads (the single learner when world_size is 1)."""
    torch.set_num_threads(threads)
    member = Membership(rank, cfg.learner.world_size, cfg.learner.rendezvous)
    if rank > 0:
        run_follower(cfg, member)
        return
    group = LearnerGroup(member)
    torch.manual_seed(cfg.run.seed)
    policy = build_policy(cfg)
    core = LearnerCore(cfg, policy, None, group.attach(policy))
    store = SegmentStore(f"{cfg.run.run_dir}/segments.zarr", read_only=True)
    core.publish("init", REF, "learner", {})
    group.started(core, resumed=False)
    one_update(core, store, batch, group)  # warm-up, and the equality check
    after = [weights(core)]
    elapsed = 0.0
    for _ in range(updates):
        started = time.perf_counter()
        one_update(core, store, batch, group)
        elapsed += time.perf_counter() - started
        after.append(weights(core))
    group.stop()
    torch.save({"after": after, "seconds": elapsed, "metrics": core.last_metrics}, out)


def run(world_size: int, args, run_dir: str, batch) -> dict:
    cfg = configure(args, run_dir, world_size)
    out = f"{run_dir}/result-{world_size}.pt"
    threads = args.threads
    if world_size == 1:
        rank_main(0, cfg, batch, args.updates, threads, out)
    else:
        mp.spawn(rank_main, args=(cfg, batch, args.updates, threads, out),
                 nprocs=world_size, join=True)
    return torch.load(out, weights_only=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(QUICKSTART))
    p.add_argument("--batch-steps", type=int, default=1024)
    p.add_argument("--updates", type=int, default=4, help="timed updates per run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with scratch_dir("gyre-learner-dp-") as run_dir:
        cfg = configure(args, run_dir, 1)
        store = SegmentStore(f"{run_dir}/segments.zarr", durable=False)
        batch = synthetic_batch(cfg, store, args.batch_steps, args.seed)
        results = {k: run(k, args, run_dir, batch) for k in (1, 2)}
    rates = {str(k): round(args.updates / r["seconds"], 4) for k, r in results.items()}

    def diffs(update: int) -> dict[str, float]:
        theirs = results[2]["after"][update]
        return {name: float((one - theirs[name]).abs().max())
                for name, one in results[1]["after"][update].items()}

    first = diffs(0)

    print_result({"bench": "learner_dp", "updates_per_s": rates,
                  "max_abs_weight_diff": max(first.values()),
                  "max_abs_weight_diff_at": max(first, key=first.__getitem__),
                  "max_abs_weight_diff_per_update": [
                      max(diffs(u).values()) for u in range(args.updates + 1)],
                  "speedup_2": round(rates["2"] / rates["1"], 3),
                  "batch_steps": args.batch_steps, "updates": args.updates,
                  "threads_per_process": args.threads, "cpus": os.cpu_count(),
                  "backend": "gloo"})


if __name__ == "__main__":
    main()
