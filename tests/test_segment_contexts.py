"""Segment contexts (``policy.context = "segment"``): one append-only token sequence per
training segment, with the tiny word policy on real workshop episodes.

- the sampler closes a context exactly where the segmenter closes the segment (one rule,
  the segmenter's; a token budget cut is a boundary both read from the step), and within a
  segment every context is an exact prefix of the next;
- a step event carries only the new tokens, the segmenter puts the contexts back together
  and stores the segment as one sequence (each token once);
- acting reuses each episode's cached keys/values and acts as it would without them;
- the learner reads a segment in one forward pass, which agrees with reading each step's
  context apart, and its micro-batches by tokens give the minibatch's update.
SmolLM2's side of the same checks: tests/test_hf_policy.py.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from gyre_async.bus.reading import read_events
from gyre_async.core.learner import LearnerCore, TrainResult
from gyre_async.core.learner_batch import BatchItem, prepare_batch
from gyre_async.core.rollout import ActionBatcher, PolicyHolder, StepRecord, run_episode
from gyre_async.core.sampler import step_event
from gyre_async.core.segment_context import UnresolvedContext, resolve_trajectory
from gyre_async.core.segmenter import (
    SegmenterCore,
    segment_arrays,
    segment_contexts,
    segment_sequence,
)
from gyre_async.envs import ACTION_WORDS, VOCAB, WorkshopConfig, WorkshopEnv
from gyre_async.policy import (
    ContextBuilder,
    ModelConfig,
    SamplingParams,
    TorchPolicy,
    tokenizer_for_vocabulary,
)
from gyre_async.storage.checkpoints import CheckpointRef
from gyre_async.storage.segments import SegmentStore
from schemas.config import (
    Config,
    LearnerConfig,
    PolicySection,
    RunSection,
    SegmenterConfig,
)
from schemas.events import Scored
from schemas.topics import TRAJECTORY_STEP

TOK = tokenizer_for_vocabulary(VOCAB)
BUDGET = 240  # tokens a segment context may hold (policy.context_tokens)
SEGMENTS = SegmenterConfig(max_segment_steps=6)
replace = msgspec.structs.replace


def tiny_policy(seed: int = 0) -> TorchPolicy:
    ids = tuple(TOK.token_id(w) for w in ACTION_WORDS)
    return TorchPolicy(ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2,
                                   max_len=BUDGET + 5, action_token_ids=ids), TOK, seed=seed)


def play(policy, *, episodes: int = 3, budget: int = BUDGET, segments=SEGMENTS,
         sessions: bool = True, max_steps: int = 40) -> dict[str, list[StepRecord]]:
    """Workshop episodes played concurrently with segment contexts; each one's records."""
    builder = ContextBuilder(TOK, budget, 0, mode="segment")
    records: dict[str, list[StepRecord]] = {}

    async def go():
        batcher = ActionBatcher(PolicyHolder(policy, 0), SamplingParams(max_action_tokens=4),
                                seed=5)
        batcher.active = episodes

        async def one(k: int):
            tid = f"t{k}"
            records[tid] = []

            async def on_step(record: StepRecord) -> None:
                records[tid].append(record)

            async def act(context):
                return await batcher.act(context, session=tid if sessions else None)

            env = WorkshopEnv(WorkshopConfig(n_orders=3, max_steps=max_steps))
            await run_episode(env, tid, k, act, builder, step_timeout_s=10, on_step=on_step,
                              segments=segments)
        await asyncio.gather(*(one(k) for k in range(episodes)))
        batcher.close()

    asyncio.run(go())
    return records


def events(records: dict[str, list[StepRecord]]):
    return {tid: [step_event("r", "sampler", tid, "task", r) for r in recs]
            for tid, recs in records.items()}


def test_contexts_grow_by_appending_and_close_where_the_segmenter_cuts():
    records = play(tiny_policy(), budget=150, segments=SegmenterConfig(max_segment_steps=20))
    segmenter = SegmenterCore(SegmenterConfig(max_segment_steps=20))
    opened, full = [], 0
    for tid, recs in records.items():
        for a, b in zip(recs, recs[1:]):
            assert a.next_context == b.context  # the context acted on is the one announced
            if a.boundary is None:  # the same segment: an exact prefix, then more
                assert b.context[:len(a.context) + len(a.acted.action.tokens)] \
                    == a.context + a.acted.action.tokens
                assert b.context_prefix == len(a.context) + len(a.acted.action.tokens)
            else:  # a new segment opens a new context
                assert b.context_prefix == 0 and len(b.context) < len(a.context)
            full += a.context_full
            assert len(b.context) <= 150
        opened += [(tid, 0)] + [(tid, b.step_index) for a, b in zip(recs, recs[1:])
                                if a.boundary is not None]
    closed = [seg for tid, steps in events(records).items()
              for i, step in enumerate(steps) for seg in segmenter.add(step, (0, i))]
    assert full >= 2, "the budget never cut: make it smaller"
    assert sorted(opened) == sorted((s.trajectory_id, s.steps[0].step_index) for s in closed)
    assert {s.boundary for s in closed} >= {"max-length"}


def test_events_carry_only_new_tokens_and_the_segmenter_stores_each_token_once():
    records = play(tiny_policy())
    steps = events(records)
    segmenter = SegmenterCore(SEGMENTS)
    closed = [seg for tid, ev in steps.items() for i, e in enumerate(ev)
              for seg in segmenter.add(e, (0, i))]
    whole = sum(len(r.context) for recs in records.values() for r in recs)
    carried = sum(len(e.context_tokens) for ev in steps.values() for e in ev)
    assert carried < whole / 2  # each event: the continuation (or an opening), not the past
    for tid, ev in steps.items():  # gyre inspect's view: every step's exact context
        resolved = resolve_trajectory(ev)
        assert [s.context_tokens for s in resolved] == [r.context for r in records[tid]]
        assert [s.next_context_tokens for s in resolved] == [r.next_context
                                                            for r in records[tid]]
    multi = [seg for seg in closed if len(seg.steps) > 1]
    assert multi
    for seg in multi:
        arrays = segment_arrays(seg)
        sequence = segment_sequence(arrays)
        assert "context_tokens" not in arrays and sequence is not None
        last = seg.steps[-1]
        assert len(sequence) == len(last.context_tokens) + len(last.action_tokens)
        assert segment_contexts(arrays) == [s.context_tokens for s in seg.steps]
        # the next segment's opening is its bootstrap context, as the sampler acted on it
        assert arrays["bootstrap_len"][0] == len(last.next_context_tokens or [])


def test_a_step_whose_context_is_not_at_hand_is_refused_before_anything_changes():
    steps = events(play(tiny_policy(), episodes=1))["t0"]
    inside = next(i for i, s in enumerate(steps) if s.context_prefix)
    segmenter = SegmenterCore(SEGMENTS)
    for i, step in enumerate(steps[:inside - 1]):
        segmenter.add(step, (0, i))
    before = (dict(segmenter.next_step), {t: list(s.steps) for t, s in segmenter.open.items()})
    with pytest.raises(UnresolvedContext, match=f"step {inside} of t0"):
        segmenter.add(steps[inside], (0, inside))  # its predecessor was lost upstream
    assert before == (dict(segmenter.next_step),
                      {t: list(s.steps) for t, s in segmenter.open.items()})


def test_acting_reuses_each_episodes_prefix_and_acts_as_without_it():
    cached, fresh = tiny_policy(), tiny_policy()
    with_cache = play(cached, episodes=2)
    without = play(fresh, episodes=2, sessions=False)
    for tid in with_cache:
        a, b = with_cache[tid], without[tid]
        assert [r.acted.action.tokens for r in a] == [r.acted.action.tokens for r in b]
        for x, y in zip(a, b):
            assert x.acted.action.logprobs == pytest.approx(y.acted.action.logprobs, abs=1e-5)
    steps = sum(len(r) for r in with_cache.values())
    assert cached.prefill_reused > 2 * cached.prefill_computed  # most of each context reused
    assert fresh.prefill_reused == 0
    assert cached.prefill_computed + cached.prefill_reused == fresh.prefill_computed
    assert cached.prefill_computed / steps < fresh.prefill_computed / steps / 2
    assert cached._sessions  # kept between steps ...
    cached.load_state_dict(cached.state_dict())
    assert not cached._sessions  # ... and dropped with every new version


def test_a_new_episode_starts_from_the_prompt_another_episode_cached():
    policy, fresh = tiny_policy(), tiny_policy()
    builder = ContextBuilder(TOK, BUDGET, 0, mode="segment")
    first = builder.opening("order 1 of 3 : axe x 1 . need wood 1 . ready no .", "done none")
    second = builder.opening("order 1 of 3 : saw x 2 . need ore 2 . ready no .", "done none")
    params = SamplingParams(greedy=True, max_action_tokens=4)
    policy.act_batch([first], params, sessions=["a"])
    before = policy.prefill_reused
    [act] = policy.act_batch([second], params, sessions=["b"])  # b has no cache of its own
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert shared > 5 and policy.prefill_reused - before == shared
    [plain] = fresh.act_batch([second], params)
    assert act.tokens == plain.tokens
    assert act.policy_logprobs == pytest.approx(plain.policy_logprobs, abs=1e-5)


def test_one_pass_over_a_segment_equals_evaluating_each_step_apart():
    policy = tiny_policy(seed=2)
    segmenter = SegmenterCore(SEGMENTS)
    closed = [seg for tid, ev in events(play(tiny_policy())).items()
              for i, e in enumerate(ev) for seg in segmenter.add(e, (0, i))]
    multi = [seg for seg in closed if len(seg.steps) > 2][:4]
    sequences = [segment_sequence(segment_arrays(seg)) for seg in multi]
    decisions = [[(len(s.context_tokens), len(s.action_tokens)) for s in seg.steps]
                 for seg in multi]
    steps = [s for seg in multi for s in seg.steps]
    one = policy.evaluate_sequences(sequences, decisions)
    apart = policy.evaluate([s.context_tokens for s in steps], [s.action_tokens for s in steps])
    for name in ("logprobs", "values", "entropy", "mask"):
        assert torch.allclose(getattr(one, name), getattr(apart, name), atol=1e-5), name
    one.logprobs.sum().backward()  # with grad, as the PPO loss needs
    assert policy.model.tok_emb.weight.grad is not None


def learner_config(tmp_path, **learner) -> Config:
    return Config(run=RunSection(run_id="seg", run_dir=str(tmp_path), seed=3),
                  policy=PolicySection(d_model=32, n_layers=1, n_heads=2, context_tokens=BUDGET,
                                       history_turns=0, context="segment"),
                  segmenter=SEGMENTS,
                  learner=LearnerConfig(batch_steps=1, epochs=1, learning_rate=0.05,
                                        value_refit_every=1, max_versions=0, **learner))


def scored_batch(tmp_path) -> tuple[SegmentStore, list[Scored], list]:
    """The closed segments of real episodes, stored, with made-up rewards."""
    segmenter = SegmenterCore(SEGMENTS)
    closed = [seg for tid, ev in events(play(tiny_policy(seed=4))).items()
              for i, e in enumerate(ev) for seg in segmenter.add(e, (0, i))]
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    refs = store.write_many([(f"s{k}", segment_arrays(seg)) for k, seg in enumerate(closed)])
    scored = [Scored(event_id=f"e{k}", run_id="seg", producer="arbiter", segment_id=f"s{k}",
                     trajectory_id=seg.trajectory_id, task_id="task",
                     step_start=seg.steps[0].step_index, step_end=seg.steps[-1].step_index + 1,
                     address=ref.address, content_hash=ref.content_hash,
                     step_rewards=[0.1 * (i % 3) for i in range(len(seg.steps))],
                     total=0.1, decided_by="rules", min_policy_version=0, components={},
                     trajectory_done=seg.boundary == "trajectory-end", success=False)
              for k, (seg, ref) in enumerate(zip(closed, refs))]
    return store, scored, closed


def test_prepare_batch_reads_sequences_once_with_the_values_of_each_step(tmp_path):
    store, scored, closed = scored_batch(tmp_path)
    policy = tiny_policy(seed=1)
    items = [BatchItem(s, a) for s, a in zip(scored, store.read_many([s.address
                                                                      for s in scored]))]
    one = prepare_batch(policy, items, 0.99, 0.95, with_logprobs=True)
    assert one.sequences and sum(k >= 0 for k in one.sequence_of) > len(one.sequences)
    assert prepare_batch(policy, items, 0.99, 0.95).digest == one.digest  # bit for bit
    # the same steps, each context stored apart (the window layout): the same figures
    apart = [BatchItem(s, {**a, "context_tokens": _rows(segment_contexts(a)),
                           "context_len": a["context_len"]})
             for s, a in zip(scored, (it.arrays for it in items))]
    for item in apart:
        item.arrays.pop("sequence_tokens", None)
    other = prepare_batch(policy, apart, 0.99, 0.95, with_logprobs=True)
    assert not other.sequences and other.contexts == one.contexts
    assert torch.allclose(one.values, other.values, atol=1e-5)
    assert torch.allclose(one.advantages, other.advantages, atol=1e-4)
    assert torch.allclose(one.proximal_logprobs, other.proximal_logprobs, atol=1e-5)


def test_the_values_pass_packs_sequences_of_similar_lengths_within_its_token_budget(
        tmp_path, monkeypatch):
    """Sequences are not padded to the batch's longest: passes of similar lengths, at most
    VALUES_PASS_TOKENS padded tokens each (one longer sequence alone), the same figures."""
    from gyre_async.core import learner_batch

    store, scored, _ = scored_batch(tmp_path)
    policy = tiny_policy(seed=1)
    items = [BatchItem(s, a) for s, a in zip(scored, store.read_many([s.address
                                                                      for s in scored]))]
    whole = prepare_batch(policy, items, 0.99, 0.95, with_logprobs=True)
    passes: list[list[int]] = []
    read = policy.evaluate_sequences

    def spy(sequences, decisions):
        passes.append([len(s) for s in sequences])
        return read(sequences, decisions)

    monkeypatch.setattr(policy, "evaluate_sequences", spy)
    monkeypatch.setattr(learner_batch, "VALUES_PASS_TOKENS", 150)
    packed = prepare_batch(policy, items, 0.99, 0.95, with_logprobs=True)
    assert len(passes) > 1 and sum(map(len, passes)) == len(whole.sequences)
    assert all(len(p) == 1 or max(p) * len(p) <= 150 for p in passes)
    assert all(p == sorted(p, reverse=True) for p in passes)
    assert torch.allclose(packed.values, whole.values, atol=1e-5)
    assert torch.allclose(packed.proximal_logprobs, whole.proximal_logprobs, atol=1e-5)
    assert learner_batch.pack_by_length([5, 9, 2, 9, 4], 18) == [[1, 3], [0, 4, 2]]
    assert learner_batch.pack_by_length([30, 2], 10) == [[0], [1]]


def _rows(contexts: list[list[int]]):
    import numpy as np

    out = np.zeros((len(contexts), max(len(c) for c in contexts)), dtype=np.int32)
    for i, c in enumerate(contexts):
        out[i, :len(c)] = c
    return out


def test_micro_batches_by_tokens_give_the_minibatchs_update(tmp_path):
    store, scored, closed = scored_batch(tmp_path)
    steps = sum(len(seg.steps) for seg in closed)
    moved = {}
    for micro_tokens in (0, 250):  # every segment's sequence fits in 250 tokens
        cfg = learner_config(tmp_path, minibatch_steps=steps, micro_tokens=micro_tokens)
        torch.manual_seed(3)
        core = LearnerCore(cfg, tiny_policy(seed=1))
        core.optimizer = torch.optim.SGD(core.policy.parameters(), lr=0.05)
        passes: list[list[int]] = []
        accumulate = core.policy.evaluate_sequences

        def spy(sequences, decisions, accumulate=accumulate, passes=passes):
            if torch.is_grad_enabled():  # the PPO passes (the values' pass has no grad)
                passes.append([len(s) for s in sequences])
            return accumulate(sequences, decisions)
        core.policy.evaluate_sequences = spy
        core.publish("init", CheckpointRef("x", "0" * 64, 0), "learner", {})
        for offset, segment in enumerate(scored):
            assert core.add(segment, (0, offset)) is None
        core.attach_arrays(store.read_many(core.buffered_addresses()))
        assert isinstance(core.update(), TrainResult)
        moved[micro_tokens] = ({k: v.detach().clone()
                                for k, v in core.policy.model.state_dict().items()}, passes)
    whole, whole_passes = moved[0]
    split, split_passes = moved[250]
    # a pass holds at most 250 tokens counting the padding to its longest sequence
    assert max(max(p) * len(p) for p in split_passes) <= 250 < max(sum(p) for p in whole_passes)
    assert sum(map(len, split_passes)) == sum(map(len, whole_passes))  # every segment, once
    for name, expected in whole.items():
        assert torch.allclose(split[name], expected, rtol=0, atol=1e-6), name


def test_validation_plays_segment_contexts_on_cached_prefixes_and_forgets_them(tiny):
    from gyre_async.compose import build_policy
    from gyre_async.core.evaluation import evaluate

    cfg = tiny.config(policy={"context": "segment", "context_tokens": 160})
    policy = build_policy(cfg)
    builder = ContextBuilder(policy.tokenizer, 160, 0, mode="segment")
    result = asyncio.run(evaluate(cfg, PolicyHolder(policy, 0), builder, 2, greedy=True))
    assert result["episodes"] == 2
    assert policy.prefill_reused > policy.prefill_computed  # each episode's prefix reused
    assert not policy._sessions  # ... and forgotten when it ended



@pytest.mark.parametrize("concurrency, kept, at_most", [(0, 3, 3), (2, 64, 2), (0, 64, 7)])
def test_validation_plays_no_more_episodes_at_once_than_the_policy_keeps_sessions(
        tiny, concurrency, kept, at_most):
    """96 segment-context games played at once by a policy that keeps 64 sessions evicted
    32 a batch (each then prefilled whole again) and held every cache twice: the judge ran
    out of memory. Validation plays at most ``evaluator.concurrency`` episodes at once and,
    with segment contexts, at most the policy's ``max_sessions``; every episode is played."""
    from gyre_async.compose import build_policy
    from gyre_async.core.evaluation import evaluate

    cfg = tiny.config(policy={"context": "segment", "context_tokens": 160},
                      evaluator={"concurrency": concurrency})
    policy = build_policy(cfg)
    policy.max_sessions = kept
    builder = ContextBuilder(policy.tokenizer, 160, 0, mode="segment")
    rows, cached = [], []
    act_batch = policy.act_batch

    def recording(contexts, params, seed=None, sessions=None):
        rows.append(len(contexts))
        out = act_batch(contexts, params, seed, sessions=sessions)
        cached.append(len(policy._sessions))
        return out

    policy.act_batch = recording  # the real policy acts; the wrapper only counts
    result = asyncio.run(evaluate(cfg, PolicyHolder(policy, 0), builder, 7, greedy=True))
    assert result["episodes"] == 7 and sum(rows) == result["env_steps"]
    assert max(rows) == at_most  # batches as full as allowed, never fuller
    assert max(cached) <= min(at_most, kept)
    evicted_or_not = policy.prefill_reused > policy.prefill_computed
    assert evicted_or_not  # no episode lost its cached prefix to an eviction
    assert not policy._sessions


# -- a Hugging Face causal LM (the same code path as SmolLM2's) -----------------------------

OBSERVATIONS = [
    ["You are in the kitchen. A fridge is here.", "The fridge is open. Inside is an apple.",
     "You take the apple.", "You are in the hallway. There is a door to the north."],
    ["You are in the garden. A shed is here.", "The shed is locked.",
     "You see a key under a pot.", "You take the key."],
]


def act_through_segments(policy, builder: ContextBuilder, sessions: bool, steps: int = 4):
    """Two episodes acting through one segment context each (``OBSERVATIONS``), with or
    without sessions; per episode, its (context, action) pairs."""
    params = SamplingParams(temperature=0.8, max_action_tokens=6)
    contexts = [builder.opening(obs[0], "done none") for obs in OBSERVATIONS]
    played: list[list] = [[] for _ in OBSERVATIONS]
    for t in range(steps):
        acts = policy.act_batch(contexts, params, seed=t,
                                sessions=["a", "b"] if sessions else None)
        for k, (context, act) in enumerate(zip(contexts, acts)):
            played[k].append((context, act))
        contexts = [c + a.tokens + builder.continuation(a.tokens, obs[(t + 1) % len(obs)])
                    for c, a, obs in zip(contexts, acts, OBSERVATIONS)]
    return played


def check_segment_path(policy, budget: int, atol: float) -> None:
    """Acting with cached prefixes acts as acting without; one pass over each episode's
    sequence gives every step's log-probs and value as evaluating the steps apart."""
    builder = ContextBuilder(policy.tokenizer, budget, 0, mode="segment")
    before = (policy.prefill_computed, policy.prefill_reused)
    cached = act_through_segments(policy, builder, sessions=True)
    computed, reused = (policy.prefill_computed - before[0], policy.prefill_reused - before[1])
    plain = act_through_segments(policy, builder, sessions=False)
    for ours, theirs in zip(cached, plain):
        for (c1, a1), (c2, a2) in zip(ours, theirs):
            assert c1 == c2 and a1.tokens == a2.tokens
            assert a1.policy_logprobs == pytest.approx(a2.policy_logprobs, abs=atol)
    assert reused > computed  # the later steps computed their continuation only
    sequences = [pairs[-1][0] + pairs[-1][1].tokens for pairs in cached]
    decisions = [[(len(c), len(a.tokens)) for c, a in pairs] for pairs in cached]
    assert len({len(s) for s in sequences}) > 1  # rows of several lengths: padding is read
    pairs = [p for episode in cached for p in episode]
    with torch.no_grad():
        one = policy.evaluate_sequences(sequences, decisions)
        apart = policy.evaluate([c for c, _ in pairs], [a.tokens for _, a in pairs])
    for name in ("logprobs", "values", "entropy"):
        assert torch.allclose(getattr(one, name), getattr(apart, name), atol=atol), name
    behaviour = torch.zeros_like(apart.logprobs)
    for i, (_, a) in enumerate(pairs):
        behaviour[i, :len(a.tokens)] = torch.tensor(a.policy_logprobs)
    assert torch.allclose(behaviour, one.logprobs, atol=atol)  # acting == learning


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_lora import small_llama

    return small_llama(tmp_path_factory.mktemp("llama"), seed=0)


def test_a_hugging_face_model_acts_on_cached_prefixes_and_reads_segments_in_one_pass(
        llama_dir):
    from gyre_async.policy.hf_policy import HFPolicy

    policy = HFPolicy.from_pretrained(llama_dir, seed=1)
    check_segment_path(policy, budget=400, atol=1e-5)
    check_prefill_apart(*(HFPolicy.from_pretrained(llama_dir, seed=1) for _ in "ab"), 400,
                        atol=1e-5)
    check_shared_prefix(policy, 400, atol=1e-5)
    # a chat transcript: an action that ended its turn is not closed twice
    builder = ContextBuilder(policy.tokenizer, 400, 0, mode="segment")
    end = policy.tokenizer.eos_id
    text = policy.tokenizer.decode(
        builder.opening("A room.") + policy.tokenizer.encode("look") + [end]
        + builder.continuation(policy.tokenizer.encode("look") + [end], "Another room."),
        skip_special=False)
    assert text.endswith("assistant\nlook<|im_end|>\n<|im_start|>user\nAnother room."
                         "<|im_end|>\n<|im_start|>assistant\n")


# -- the whole loop ----------------------------------------------------------------------------

@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_a_run_with_segment_contexts_passes_its_audits_and_replays_bit_for_bit(tiny):
    """``gyre run``'s loop with segment contexts: the invariants hold (nothing lost, the
    store's segments match their announcements), the store holds sequences, ``gyre replay
    learner`` re-derives every update's advantages bit for bit, and ``gyre inspect
    --contexts`` shows each step's whole context."""
    from gyre_async.audit.inspect_trajectory import collect, render
    from gyre_async.audit.invariants import check_run, read_run
    from gyre_async.audit.replay import replay, replay_learner
    from gyre_async.bus import open_bus
    from gyre_async.runtime.loop import run_loop

    cfg = tiny.config(policy={"context": "segment", "context_tokens": 160},
                      learner={"max_versions": 2, "batch_steps": 128, "micro_tokens": 600},
                      evaluator={"every_versions": 0})
    asyncio.run(run_loop(cfg))

    async def audit():
        async with open_bus(f"sqlite:///{cfg.run.run_dir}/events.db") as bus:
            report = check_run(await read_run(bus, cfg.run.run_id),
                               segment_store=f"{cfg.run.run_dir}/segments.zarr",
                               checkpoint_dir=None, max_staleness=cfg.loop.max_staleness)
            steps = [e async for _, e in read_events(bus, [TRAJECTORY_STEP], on_bad="raise")]
            tid = steps[0].trajectory_id
            segmenter = await replay(bus, "segmenter", cfg)
            return (report, await replay_learner(bus, cfg), segmenter, tid,
                    await collect(bus, tid))

    invariants, replayed, segmenter, tid, info = asyncio.run(audit())
    # the segmenter, run again over the log's steps (only what is new in each), writes the
    # same segments: every one reproduced, none different, none extra
    assert not segmenter.missing and not segmenter.changed and not segmenter.extra, \
        segmenter.to_dict()
    shown = render(tid, info, 0, contexts=True).splitlines()
    contexts = [line for line in shown if line.startswith("       context (")]
    assert len(contexts) == len(info["steps"])
    whole = {s.step_index: s.context_tokens for s in resolve_trajectory(info["steps"])}
    for step, line in zip(info["steps"], contexts):
        assert line.endswith(repr(" ".join(map(str, whole[step.step_index]))))
    assert any(len(whole[s.step_index]) > len(s.context_tokens) for s in info["steps"])
    assert invariants.ok, invariants.describe()
    assert replayed.replayed_outputs >= 2 and replayed.differences == 0, replayed.to_dict()
    store = SegmentStore(f"{cfg.run.run_dir}/segments.zarr", read_only=True)
    layouts = [segment_sequence(store.read(store.address(sid))) is not None
               for sid in store.list_segments()]
    assert sum(layouts) > len(layouts) / 2  # most segments are one sequence each


def test_the_base_models_log_probs_are_read_in_one_pass_too(llama_dir):
    """LoRA's KL to the base (``learner.kl_to_base``): with the adapters off, one pass over a
    segment gives the base's log-probs of every step, as evaluating each step apart."""
    from test_lora import LORA

    from gyre_async.policy.hf_policy import HFPolicy

    policy = HFPolicy.from_pretrained(llama_dir, seed=1, lora=LORA)
    with torch.no_grad():  # adapters that move the policy away from its base
        for name, weight in policy.model.named_parameters():
            if "lora_B" in name:
                weight.add_(0.05)
    builder = ContextBuilder(policy.tokenizer, 400, 0, mode="segment")
    played = act_through_segments(policy, builder, sessions=True, steps=3)
    sequences = [pairs[-1][0] + pairs[-1][1].tokens for pairs in played]
    decisions = [[(len(c), len(a.tokens)) for c, a in pairs] for pairs in played]
    pairs = [p for episode in played for p in episode]
    with policy.adapters_off():
        one = policy.evaluate_sequences(sequences, decisions).logprobs
    apart = policy.base_logprobs([c for c, _ in pairs], [a.tokens for _, a in pairs])
    with torch.no_grad():
        tuned = policy.evaluate_sequences(sequences, decisions).logprobs
    assert torch.allclose(one, apart, atol=1e-5)
    assert not torch.allclose(one, tuned, atol=1e-3)  # the adapters were really off


def check_prefill_apart(split, whole, budget: int, atol: float) -> None:
    """A batch computes every row as wide as its widest uncached part: an opening among
    continuing contexts is prefilled apart first (fewer padded columns), and every row acts
    as it would in the one batch: the same tokens, log-probs to ``atol``, the same
    counters. ``split`` and ``whole``: two copies of one policy (same weights and seed)."""
    builder = ContextBuilder(split.tokenizer, budget, 0, mode="segment")
    orders = [f"order {k} of 3 : axe x {k} . need wood {k} . ready no ." for k in (1, 2, 3)]
    params = SamplingParams(max_action_tokens=4)
    whole.pass_overhead_tokens = 10**9  # never worth a pass of its own: one batch
    columns = {id(split): 0, id(whole): 0}

    def counting(policy):
        forward = policy._forward

        def wrapped(ids, mask, cache=None):
            if ids.shape[1] > 1:  # prefill (decoding feeds one column)
                columns[id(policy)] += ids.shape[0] * ids.shape[1]
            return forward(ids, mask, cache)
        policy._forward = wrapped

    acted, counted = {}, {}
    for policy in (split, whole):
        counting(policy)
        before = (policy.prefill_computed, policy.prefill_reused)
        first = [builder.opening(o, "done none") for o in orders]
        acts = policy.act_batch(first, params, seed=3, sessions=["a", "b", "c"])
        grown = [c + a.tokens + builder.continuation(a.tokens, "you see wood .", o)
                 for c, a, o in zip(first, acts, orders)]
        opening = builder.opening("order 1 of 3 : saw x 2 . need ore 2 . need wood 1 . "
                                  "need axe 1 . ready no .", "done 1 last wood : take wood")
        columns[id(policy)] = 0
        acted[id(policy)] = policy.act_batch([*grown, opening], params, seed=4,
                                             sessions=["a", "b", "c", "d"])
        counted[id(policy)] = (policy.prefill_computed - before[0],
                               policy.prefill_reused - before[1])
    assert columns[id(split)] < 0.7 * columns[id(whole)]
    for x, y in zip(acted[id(split)], acted[id(whole)]):
        assert x.tokens == y.tokens
        assert x.policy_logprobs == pytest.approx(y.policy_logprobs, abs=atol)
    assert counted[id(split)] == counted[id(whole)]


def check_shared_prefix(policy, budget: int, atol: float) -> None:
    """Next-token log-probs and values (the keeper's probe set, parameter noise): the
    prompt every context shares is computed once, fewer columns than each row whole, and
    the readings are those of each context whole."""
    builder = ContextBuilder(policy.tokenizer, budget, 0, mode="segment")
    opening = builder.opening("order 1 of 3 : axe x 1 . need wood 1 . ready no .", "done none")
    action = policy.tokenizer.encode("take wood")
    contexts = [opening + action + builder.continuation(action, f"you see wood . order {k} .")
                for k in range(1, 6)] + [opening]
    columns = []
    forward = policy._forward

    def counting(ids, mask, cache=None):
        columns.append(ids.shape[0] * ids.shape[1])
        return forward(ids, mask, cache)

    policy._forward = counting
    policy.shared_prefix_rows = 4  # two passes after the prefix
    shared = (policy.next_token_logprobs(contexts), policy.values(contexts))
    saved = sum(columns)
    columns.clear()
    policy.shared_prefix_min = 10**9  # each context whole
    whole = (policy.next_token_logprobs(contexts), policy.values(contexts))
    assert saved < 0.7 * sum(columns)
    finite = torch.isfinite(whole[0])
    assert torch.equal(finite, torch.isfinite(shared[0]))
    assert torch.allclose(shared[0][finite], whole[0][finite], atol=atol)
    assert torch.allclose(shared[1], whole[1], atol=atol)
    del policy._forward, policy.shared_prefix_min, policy.shared_prefix_rows


def test_a_prompt_every_context_shares_is_computed_once():
    check_shared_prefix(tiny_policy(), BUDGET, atol=1e-5)


def test_a_long_opening_is_prefilled_apart_and_acts_as_in_one_batch():
    check_prefill_apart(tiny_policy(), tiny_policy(), BUDGET, atol=1e-5)


def test_an_episode_ending_while_a_batch_acts_waits_for_the_batch_not_the_loop():
    """Episodes end on the event loop while a batch acts on a worker thread (its prefix
    search walks the sessions): forgetting a session then must neither mutate the sessions
    under the batch nor wait for its lock; the next batch drops it."""
    import threading

    policy = tiny_policy()
    params = SamplingParams(max_action_tokens=2)
    policy.act_batch([[1, 2, 3], [1, 2, 4]], params, sessions=["a", "b"])
    assert set(policy._sessions) == {"a", "b"}
    held, release = threading.Event(), threading.Event()

    def batch_in_flight():
        with policy._lock:
            held.set()
            release.wait(10)

    worker = threading.Thread(target=batch_in_flight)
    worker.start()
    held.wait(10)
    policy.forget_session("a")  # returns at once, the lock being held
    assert set(policy._sessions) == {"a", "b"}
    release.set()
    worker.join()
    policy.act_batch([[1, 2, 4, 5]], params, sessions=["b"])
    assert set(policy._sessions) == {"b"}
    policy.forget_session("b")  # the lock free: dropped right away
    assert not policy._sessions


def test_the_roomy_cache_layer_holds_what_transformers_own_layer_holds():
    """Acting appends into spare columns instead of concatenating (a whole-cache copy per
    generated token): prefills and single tokens, within the room and past it, the layer
    holds and returns exactly what ``DynamicLayer`` does."""
    cache_utils = pytest.importorskip("transformers.cache_utils")
    from gyre_async.policy.hf_policy import _roomy_layer

    gen = torch.Generator().manual_seed(0)
    theirs = cache_utils.DynamicLayer()
    start_k, start_v = torch.randn(2, 3, 5, 4, generator=gen), torch.randn(2, 3, 5, 4,
                                                                          generator=gen)
    buffer_k = torch.cat([start_k, torch.full((2, 3, 4, 4), float("nan"))], 2)
    buffer_v = torch.cat([start_v, torch.full((2, 3, 4, 4), float("nan"))], 2)
    held = _roomy_layer().holding(buffer_k, buffer_v, 5)
    fresh = _roomy_layer()(room=2)
    theirs.update(start_k, start_v)
    fresh.update(start_k, start_v)
    in_place = []
    for width in (3, 1, 1, 1, 4):  # the held layer's 4 spare columns run out at the third
        k, v = torch.randn(2, 3, width, 4, generator=gen), torch.randn(2, 3, width, 4,
                                                                       generator=gen)
        expected = theirs.update(k, v)
        for layer in (held, fresh):
            got = layer.update(k, v)
            for a, b in zip(got, expected):
                assert torch.equal(a, b)
            assert layer.get_seq_length() == theirs.get_seq_length()
        in_place.append(held.keys.data_ptr() == buffer_k.data_ptr())
    assert in_place == [True, True, False, False, False]  # then it grew into a new buffer


def test_the_critics_refit_reads_each_segment_once_an_epoch(tmp_path, monkeypatch):
    """The refit's minibatches take whole one-sequence segments. Random steps instead read
    a whole sequence for each step: 8 steps of 8 Simon Says games (~1,100 tokens each) held
    ~15 GB of activations in one pass, where one game's 24 steps need one sequence."""
    from collections import Counter

    from gyre_async.core import learner as learner_module

    store, scored, _ = scored_batch(tmp_path)
    cfg = learner_config(tmp_path, minibatch_steps=2)
    core = LearnerCore(cfg, tiny_policy(seed=1))
    reads: Counter[int] = Counter()
    real = learner_module.evaluate_steps

    def spy(policy, contexts, actions, rows, sequences, sequence_of):  # the refit's passes
        reads.update({sequence_of[r] for r in rows})
        return real(policy, contexts, actions, rows, sequences, sequence_of)

    monkeypatch.setattr(learner_module, "evaluate_steps", spy)
    core.publish("init", CheckpointRef("x", "0" * 64, 0), "learner", {})
    for offset, segment in enumerate(scored):
        assert core.add(segment, (0, offset)) is None
    arrays = store.read_many(core.buffered_addresses())
    for item in arrays:  # episodes cut at the tiny game's cap: read them as ended, so the
        item["terminal"][:] = True  # refit has complete returns to fit
    core.attach_arrays(arrays)
    result = core.update()
    assert isinstance(result, TrainResult) and reads, "the refit did not run"
    assert max(reads.values()) == cfg.learner.value_refit_epochs  # once an epoch, each
