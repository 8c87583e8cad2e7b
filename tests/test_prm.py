"""The process reward model: trains on labelled workshop segments and separates the labels."""

from __future__ import annotations

import json
import random

import pytest
import torch

from gyre_async.envs.workshop import FARMING_ACTIONS, WorkshopEnv, oracle_action
from gyre_async.rewards.prm import (
    PrmLoadError,
    labelled_segment,
    load_prm,
    read_labels,
    save_prm,
    train_prm,
)


def run_sync(coroutine):
    """Result of a coroutine that never awaits (the workshop's reset), without a loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the coroutine awaited something")


def workshop_segments(seed: int, n: int, farm_share: float, length: int = 8) -> list[list[str]]:
    """Action texts of real workshop play: the oracle, with a share of farming mixed in."""
    rng = random.Random(seed)
    farm = sorted(FARMING_ACTIONS)
    env = WorkshopEnv()
    out: list[list[str]] = []
    obs = None
    while len(out) < n:
        if obs is None:
            obs = run_sync(env.reset("task", rng.randrange(10_000)))
        actions = []
        for _ in range(length):
            action = rng.choice(farm) if rng.random() < farm_share else oracle_action(obs)
            result = env.step_sync(action)
            actions.append(action)
            obs = None if result.done or result.truncated else result.observation
            if obs is None:
                break
        if len(actions) == length:
            out.append(actions)
    return out


def write_labels(path, good, bad):
    with open(path, "w") as f:
        for actions, label in [(a, 1.0) for a in good] + [(a, 0.0) for a in bad]:
            f.write(json.dumps({"actions": actions, "label": label}) + "\n")


def pairwise_accuracy(model, good, bad) -> float:
    g = [model.segment_score(a) for a in good]
    b = [model.segment_score(a) for a in bad]
    return sum(x > y for x in g for y in b) / (len(g) * len(b))


def test_prm_trains_from_a_labels_file_and_separates_unseen_segments(tmp_path):
    labels = tmp_path / "labels.jsonl"
    write_labels(labels, workshop_segments(1, 24, 0.0), workshop_segments(2, 24, 0.6))
    examples = read_labels(str(labels))
    assert len(examples) == 48
    untrained = train_prm(examples, epochs=0)
    model = train_prm(examples)
    good, bad = workshop_segments(3, 20, 0.0), workshop_segments(4, 20, 0.6)
    # unseen seeds: the trained model ranks every good segment above every bad one
    assert pairwise_accuracy(model, good, bad) >= 0.95
    assert pairwise_accuracy(untrained, good, bad) < 0.9  # the separation was learned
    path = tmp_path / "prm.safetensors"
    save_prm(model, str(path))
    loaded = load_prm(str(path))
    assert loaded.step_scores(good[0]) == model.step_scores(good[0])
    assert all(-1 <= s <= 1 for s in loaded.step_scores(bad[0]))


def test_prm_files_are_validated(tmp_path):
    with pytest.raises(PrmLoadError, match="not found"):
        load_prm(str(tmp_path / "missing.safetensors"))
    pickled = tmp_path / "pickled.safetensors"
    torch.save({"embed.weight": torch.zeros(2, 2)}, pickled)  # pickle: refused, never loaded
    with pytest.raises(PrmLoadError, match="not a readable safetensors"):
        load_prm(str(pickled))
    from safetensors.torch import save_file
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(1)}, str(other), metadata={"format": "something-else"})
    with pytest.raises(PrmLoadError, match="not a gyre-prm v1 file"):
        load_prm(str(other))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"actions": ["a"], "label": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: actions must be a non-empty list"):
        read_labels(str(bad))


def test_labelled_segment_line_round_trips(tmp_path):
    from tests.test_arbitration import seg

    line = labelled_segment(seg(["chop tree", "craft"], sid="s1"), 1.0)
    path = tmp_path / "l.jsonl"
    path.write_text(json.dumps(line) + "\n")
    [example] = read_labels(str(path))
    assert example.actions == ("chop tree", "craft") and example.label == 1.0
