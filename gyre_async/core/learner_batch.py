"""A learner batch: scored segments flattened to steps, with values and fused advantages.

:func:`prepare_batch` is pure given the policy weights and the segments, so the learner
(before each update) and ``gyre replay learner`` (after the fact, from the parent
checkpoint) derive exactly the same advantages; :attr:`PreparedBatch.digest` is the
fingerprint the audit compares.

A segment stored as one sequence (segment contexts, see
:func:`gyre_async.core.segmenter.segment_arrays`) is read in one forward pass for all its
steps (:func:`evaluate_steps`); a segment stored one context per step is read step by step,
as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gyre_async.core.segmenter import segment_contexts, segment_sequence
from gyre_async.policy.base import EvalOutput
from gyre_async.rl.advantages import segment_gae
from gyre_async.rl.fusion import CreditMode, SilentGroups, anchored_credit, fuse_segments
from schemas.events import Scored


@dataclass
class BatchItem:
    """A scored segment and its arrays (empty until read from the segment store)."""

    scored: Scored
    arrays: dict[str, np.ndarray]

    @property
    def steps(self) -> int:
        return self.scored.step_end - self.scored.step_start

    @property
    def terminal(self) -> bool:
        """The trajectory really ended at this segment's last step (no value bootstrap)."""
        return bool(self.arrays["terminal"][0])

    def bootstrap_context(self, failed_fallback: bool) -> list[int]:
        """The context whose value the segment's GAE bootstraps from ([]: none, value 0).

        The recorded one is the context right after the last step. The last segment of a
        failed episode (env error, timeout, abandonment) may have none recorded (its next
        observation never came); with ``failed_fallback`` it bootstraps from its last
        step's own context instead: ``V(s_T)`` is the critic's estimate of what the episode
        would still have earned from the last state it reached, a one-step shift from the
        missing ``V(s_{T+1})``, while 0 would read the crash as "nothing more to earn", the
        very zero return that masking failures is meant to avoid."""
        arrays = self.arrays
        boot = arrays["bootstrap_context"][0, : int(arrays["bootstrap_len"][0])].tolist()
        if not boot and failed_fallback and self.scored.failure and not self.terminal:
            boot = segment_contexts(arrays)[-1]
        return boot


@dataclass
class PreparedBatch:
    """A batch flattened to steps, with values and segment-level GAE advantages."""

    contexts: list[list[int]]
    actions: list[list[int]]
    behaviour_logprobs: list[list[float]]
    rewards: list[float]
    values: torch.Tensor
    advantages: torch.Tensor  # fused (before batch normalisation), one per step
    returns: torch.Tensor
    local_advantages: torch.Tensor  # raw segment GAE, one per step
    fusion_weights: list[float]  # weight of the global outcome advantage, one per segment
    global_known: int = 0  # segments whose trajectory outcome was known
    failed_segments: int = 0  # last segments of failed episodes (bootstrapped, no outcome)
    #: [n, longest action] log-probs of the actions under the weights that made ``values``
    #: (the decoupled-PPO proximal policy), read off the same forward pass; None: not taken
    proximal_logprobs: torch.Tensor | None = None
    #: the one-sequence segments' sequences, and per step the sequence it is read from
    #: (-1: its own context, ``contexts[i]``); empty: every step reads its own context
    sequences: list[list[int]] = field(default_factory=list)
    sequence_of: list[int] = field(default_factory=list)
    #: ``credit = "anchored"``: steps whose anchor group compared different returns
    anchored_steps: int = 0

    def credit_stats(self) -> dict[str, float]:
        weights = self.fusion_weights or [0.0]
        return {"credit/fusion_weight_mean": float(np.mean(weights)),
                "credit/anchored_steps": float(self.anchored_steps),
                "credit/fusion_weight_max": float(np.max(weights)),
                "credit/segments_with_outcome": float(self.global_known),
                "credit/failed_episode_segments": float(self.failed_segments),
                "credit/max_abs_local_advantage": float(self.local_advantages.abs().max())
                if self.n else 0.0}

    @property
    def n(self) -> int:
        return len(self.contexts)

    @property
    def digest(self) -> str:
        """Fingerprint of the advantages (the replay audit recomputes and compares it)."""
        data = self.advantages.detach().to(torch.float32).numpy().tobytes()
        return hashlib.sha256(data).hexdigest()[:32]


def _rows(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    return [tokens[i, : int(lengths[i])].tolist() for i in range(len(lengths))]


def evaluate_steps(policy, contexts: list[list[int]], actions: list[list[int]],
                   rows: list[int], sequences: Sequence[list[int]] = (),
                   sequence_of: Sequence[int] = ()) -> EvalOutput:
    """:meth:`Policy.evaluate` of steps ``rows`` (with grad), their rows in that order.

    Steps of a one-sequence segment (``sequence_of[i] >= 0``) are read off one forward
    pass over their sequence, cut after the last action asked for
    (:meth:`~gyre_async.policy.torch_policy.CausalLMPolicy.evaluate_sequences`); the others
    from their own contexts. Without sequences this is ``policy.evaluate`` itself."""
    if not sequences or all(sequence_of[i] < 0 for i in rows):
        return policy.evaluate([contexts[i] for i in rows], [actions[i] for i in rows])
    own = [i for i in rows if sequence_of[i] < 0]
    groups: dict[int, list[int]] = {}
    for i in rows:
        if sequence_of[i] >= 0:
            groups.setdefault(sequence_of[i], []).append(i)
    parts: list[EvalOutput] = []
    order: list[int] = []
    if own:
        parts.append(policy.evaluate([contexts[i] for i in own], [actions[i] for i in own]))
        order += own
    cut = [sequences[k][:max(len(contexts[i]) + len(actions[i]) for i in group)]
           for k, group in groups.items()]
    parts.append(policy.evaluate_sequences(
        cut, [[(len(contexts[i]), len(actions[i])) for i in group] for group in groups.values()]))
    order += [i for group in groups.values() for i in group]
    width = max(p.logprobs.shape[1] for p in parts)

    def cat(name: str) -> torch.Tensor:
        tensors = [getattr(p, name) for p in parts]
        if tensors[0].dim() == 2:
            tensors = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
        return torch.cat(tensors)[torch.tensor([order.index(i) for i in rows])]

    return EvalOutput(logprobs=cat("logprobs"), entropy=cat("entropy"), values=cat("values"),
                      mask=cat("mask"))


#: padded tokens one pass without grad reads at most when segments are one sequence each:
#: sequences are packed longest first (:func:`pack_by_length`), so a short one is not padded
#: to the batch's longest (reading a long-task batch whole computed 2.8x its tokens)
VALUES_PASS_TOKENS = 4096


def pack_by_length(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into passes, longest first, each holding at most
    ``budget`` tokens once its rows are padded to its longest (a longer one goes alone).
    Padding is computed like any token, so grouping by length is what keeps it small."""
    passes: list[list[int]] = []
    width = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if passes and width * (len(passes[-1]) + 1) <= budget:
            passes[-1].append(i)
        else:
            passes.append([i])
            width = lengths[i]
    return passes


def read_units(rows: Sequence[int], contexts: list[list[int]], actions: list[list[int]],
               sequence_of: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """``rows`` as they are read together (the steps of one sequence; else one step), in
    their order, and the tokens each unit's pass reads (its sequence up to its last action)."""
    units: list[list[int]] = []
    where: dict[int, int] = {}
    for i in rows:
        k = sequence_of[i] if sequence_of else -1
        if k < 0:
            units.append([i])
        elif k in where:
            units[where[k]].append(i)
        else:
            where[k] = len(units)
            units.append([i])
    return units, [max(len(contexts[i]) + len(actions[i]) for i in unit) for unit in units]


def unit_minibatches(units: Sequence[list[int]], size: int,
                     gen: torch.Generator) -> list[list[int]]:
    """Whole ``units`` (a one-sequence segment's steps, or one step) in a fresh random
    order, until a minibatch holds ``size`` steps. Why whole: a pass reads a step's whole
    sequence up to it, so ``size`` steps drawn at random from a batch of long segments would
    read ``size`` whole sequences for one step each (8 whole Simon Says games, ~15 GB of
    activations in one pass, where one game's 24 steps need one)."""
    out: list[list[int]] = [[]]
    for unit in torch.randperm(len(units), generator=gen).tolist():
        if len(out[-1]) >= size:
            out.append([])
        out[-1] += units[unit]
    return out


def values_and_logprobs(policy, contexts: list[list[int]], actions: list[list[int]],
                        chunk: int = 1024, sequences: Sequence[list[int]] = (),
                        sequence_of: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Values of ``contexts`` and log-probs [n, longest action] of ``actions``, from one
    forward pass without grad (the value is read at the last context token, before the
    action, so it is the value :meth:`values` gives). Steps of one-sequence segments are
    read a segment at a time (:func:`evaluate_steps`), in passes of similar lengths of at
    most :data:`VALUES_PASS_TOKENS` padded tokens; window contexts ``chunk`` rows a pass."""
    n, width = len(contexts), max((len(a) for a in actions), default=1)
    values, logprobs = torch.zeros(n), torch.zeros(n, width)
    if sequences:
        units, lengths = read_units(range(n), contexts, actions, sequence_of)
        passes = [[i for u in group for i in units[u]]
                  for group in pack_by_length(lengths, VALUES_PASS_TOKENS)]
    else:
        passes = [list(range(start, min(n, start + chunk))) for start in range(0, n, chunk)]
    with torch.no_grad():
        for rows in passes:
            out = evaluate_steps(policy, contexts, actions, rows, sequences, sequence_of)
            values[rows] = out.values.float()
            logprobs[rows, : out.logprobs.shape[1]] = out.logprobs.float()
    return values, logprobs


def anchor_key(task_id: str, context: Sequence[int]) -> bytes:
    """A step's anchor (``credit = "anchored"``): its task and its exact context tokens, so
    two steps share one only when their players saw and did the same things so far. A
    digest, not Python's ``hash``: replay in another process derives the same groups."""
    digest = hashlib.blake2b(task_id.encode(), digest_size=16)
    digest.update(np.asarray(context, dtype=np.int64).tobytes())
    return digest.digest()


def prepare_batch(policy, items: Sequence[BatchItem], gamma: float, lam: float,
                  global_adv: list[float] | None = None, credit: CreditMode = "gae",
                  w_max: float = 0.8, bootstrap_failed: bool = True,
                  with_logprobs: bool = False,
                  silent_groups: SilentGroups = "local") -> PreparedBatch:
    """Values under ``policy``, GAE inside each segment bootstrapped at its boundary, fused
    with the per-segment global outcome advantage (``global_adv``, NaN: unknown; see
    ``gyre_async.rl.fusion``). ``bootstrap_failed`` (``learner.mask_failed``): a failed
    episode's last segment always bootstraps (:meth:`BatchItem.bootstrap_context`).
    ``with_logprobs``: keep the actions' log-probs that the values' forward pass yields
    (the learner's proximal policy), so the update needs no second pass over the batch.
    ``silent_groups`` (``learner.fusion_silent_groups``): what fusion does where a group's
    returns were all equal (:func:`gyre_async.rl.fusion.fuse_segments`).

    Pure given the policy weights and the segments: ``gyre replay learner`` calls it with
    the parent checkpoint to re-derive exactly the advantages each update used.
    """
    contexts: list[list[int]] = []
    actions: list[list[int]] = []
    behaviour: list[list[float]] = []
    rewards: list[float] = []
    sequences: list[list[int]] = []
    sequence_of: list[int] = []
    for item in items:
        arrays = item.arrays
        contexts += segment_contexts(arrays)
        sequence = segment_sequence(arrays)
        if sequence is not None:
            sequences.append(sequence)
        sequence_of += [len(sequences) - 1 if sequence is not None else -1] * len(
            arrays["context_len"])
        act_len = arrays["action_mask"].sum(axis=1)
        actions += _rows(arrays["action_tokens"], act_len)
        behaviour += [arrays["action_logprobs"][i, : int(act_len[i])].tolist()
                      for i in range(len(act_len))]
        rewards += list(item.scored.step_rewards)
    # One forward pass for the values whoever asks: a context-only pass (``policy.values``)
    # gives the same values up to the last bits only (other tensor shapes, other summation
    # order), and the digest compares bits.
    if not sequences:
        sequence_of = []
    values, logprobs = values_and_logprobs(policy, contexts, actions, sequences=sequences,
                                           sequence_of=sequence_of)
    proximal = logprobs if with_logprobs else None
    with torch.no_grad():
        boots = [it.bootstrap_context(bootstrap_failed) for it in items]
        need = [i for i, b in enumerate(boots) if b and not items[i].terminal]
        boot_values = torch.zeros(len(items))
        if need:
            boot_values[need] = policy.values([boots[i] for i in need]).float()
    width = max(it.steps for it in items)
    segments = len(items)
    reward2d = torch.zeros(segments, width)
    value2d = torch.zeros(segments, width)
    mask = torch.zeros(segments, width, dtype=torch.bool)
    seg_of_step, step_in_seg = [], []
    pos = 0
    for k, it in enumerate(items):
        reward2d[k, : it.steps] = torch.tensor(it.scored.step_rewards)
        value2d[k, : it.steps] = values[pos : pos + it.steps]
        mask[k, : it.steps] = True
        seg_of_step += [k] * it.steps
        step_in_seg += list(range(it.steps))
        pos += it.steps
    terminal = torch.tensor([it.terminal for it in items])
    adv2d, ret2d = segment_gae(reward2d, value2d, mask, boot_values, terminal, gamma, lam)
    outcome = torch.tensor(global_adv if global_adv is not None else [float("nan")] * segments)
    anchored_steps = 0
    if credit == "anchored":  # returns-to-go (lam = 1) compared within anchor groups
        _, mc2d = segment_gae(reward2d, value2d, mask, boot_values, terminal, gamma, 1.0)
        starts = np.cumsum([0] + [it.steps for it in items])
        anchors = [[anchor_key(it.scored.task_id, contexts[p]) for p in range(a, b)]
                   for it, a, b in zip(items, starts[:-1], starts[1:])]
        fused2d, weights, anchored_steps = anchored_credit(mc2d, mask, anchors, outcome)
    else:
        fused2d, weights = fuse_segments(adv2d, mask, outcome, credit, w_max,
                                         silent=silent_groups)
    k_index, t_index = torch.tensor(seg_of_step), torch.tensor(step_in_seg)
    return PreparedBatch(contexts, actions, behaviour, rewards, values,
                         fused2d[k_index, t_index], ret2d[k_index, t_index],
                         adv2d[k_index, t_index], weights.tolist(),
                         int((~torch.isnan(outcome)).sum()),
                         sum(1 for it in items if it.scored.failure), proximal, sequences,
                         sequence_of, anchored_steps)
