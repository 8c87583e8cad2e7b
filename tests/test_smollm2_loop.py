"""The whole loop with SmolLM2-135M as the policy (``policy.backend = "hf"``) on
TextWorldExpress, a short run:
the sampler acts with the pretrained model, the learner trains it (PPO, value head added),
policy versions advance, and the last published checkpoint loads back identically.

Sized for two CPU cores: short contexts, few tokens per action, two envs, small batches,
two updates.
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

from gyre_async.bus import open_bus  # noqa: E402
from gyre_async.bus.reading import read_events  # noqa: E402
from gyre_async.compose import build_policy, load_weights, save_weights  # noqa: E402
from gyre_async.runtime.loop import run_loop  # noqa: E402
from gyre_async.storage.checkpoints import CheckpointStore  # noqa: E402
from schemas.config import Config  # noqa: E402
from schemas.events import PolicyVersion, TrajectoryStep  # noqa: E402
from schemas.topics import POLICY_VERSION, TRAJECTORY_STEP  # noqa: E402

pytestmark = pytest.mark.slow  # minutes, not seconds: the full tier only

# TextWorldExpress "twc" (put an object where it belongs), the small real text game; the
# policy's free text is snapped to the game's nearest valid action.
TASK = {"env": "twx", "env_config": {"game": "twc", "params": "numLocations=1,"
        "numItemsToPutAway=1,includeDoors=0", "max_steps": 6, "admissible": "snap"}}


def smollm2_config(run_dir) -> Config:
    return msgspec.convert({
        "run": {"run_id": "smollm2", "run_dir": str(run_dir), "seed": 1},
        "loop": {"max_staleness": 1, "max_wall_s": 600},
        "task": TASK,
        "policy": {"backend": "hf", "model": "smollm2", "context_tokens": 96,
                   "history_turns": 0, "max_action_tokens": 4},
        "sampler": {"num_envs": 2},
        "segmenter": {"max_segment_steps": 4},
        "learner": {"batch_steps": 8, "minibatch_steps": 8, "epochs": 1, "max_versions": 2,
                    "learning_rate": 1e-5},
        "evaluator": {"every_versions": 100, "episodes": 1},
    }, Config)


async def _events(url: str):
    async with open_bus(url) as bus:
        return [(r.topic, e) async for r, e in read_events(
            bus, [POLICY_VERSION, TRAJECTORY_STEP], on_bad="raise")]


def test_smollm2_policy_runs_the_loop(tmp_path):
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cfg = smollm2_config(tmp_path / "run")
    asyncio.run(run_loop(cfg))
    events = asyncio.run(_events(f"sqlite:///{tmp_path}/run/events.db"))
    versions = sorted((e for t, e in events if isinstance(e, PolicyVersion)),
                      key=lambda v: v.version)
    steps = [e for t, e in events if isinstance(e, TrajectoryStep)]

    # Policy versions advance one by one: the init checkpoint, then two PPO updates.
    assert [v.version for v in versions] == [0, 1, 2]
    assert [v.reason for v in versions] == ["init", "update", "update"]
    assert all(v.trained_segments for v in versions[1:])

    # Token ids are the model's own end to end (contexts are ChatML transcripts).
    policy = build_policy(cfg)
    tok = policy.tokenizer
    assert steps and all(max(s.context_tokens) < tok.vocab_size for s in steps)
    assert tok.decode(steps[0].context_tokens, skip_special=False).endswith(
        "<|im_start|>assistant\n")
    # the text the game gets is the decoded action, its end-of-line stop trimmed
    assert all(tok.decode(s.action_tokens).strip() == s.action_text for s in steps)

    # The last checkpoint loads back identically, and training moved the weights.
    store = CheckpointStore(f"{tmp_path}/run/checkpoints")
    first, last = versions[0], versions[-1]
    load_weights(policy, last.checkpoint, last.checkpoint_hash)
    tensors, meta = store.load(last.checkpoint, last.checkpoint_hash)
    state = policy.state_dict()
    assert state.keys() == tensors.keys()
    assert all(torch.equal(state[k], tensors[k]) for k in tensors)
    again = save_weights(CheckpointStore(f"{tmp_path}/again"), policy, last.version, meta)
    assert again.sha256 == last.checkpoint_hash
    initial, _ = store.load(first.checkpoint, first.checkpoint_hash)
    assert any(not torch.equal(initial[k], tensors[k]) for k in tensors)
