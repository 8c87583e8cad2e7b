"""The elite pool: high-impact segments kept aside (shadow storage) and mixed into batches.

What gets in (decided by the learner at each update, from the batch it just trained on,
with the critic values that batch's advantages were computed with):

- **successes**: the final segment of a trajectory that succeeded (``trajectory_done`` and
  ``success`` in its ``scored`` event);
- **turning points**: a segment whose value estimate jumps: ``max_t |V(s_t+1) - V(s_t)|``
  over consecutive steps *inside* the segment is at least ``elite.jump_threshold``.

Identity and deduplication: an entry's id in the pool is the **content hash** of the
source segment (``Scored.content_hash``), so the same segment content, under any segment id
and offered any number of times, is stored once.

Bound and eviction: at most ``elite.capacity`` segments. When a new entry makes it one too
many, the pool evicts the lowest-ranked entry: turning points rank below successes, and
within a kind the oldest entry (first inserted) goes first. So once successes fill the
pool, a new success replaces the oldest one and turning points only pass through.

Persistence: the pool is its own segment store (``<run_dir>/elite.zarr``, written only by
the learner). Each entry is the source segment's arrays plus ``elite_rewards`` (the scored
per-step rewards) and ``elite_meta`` ``[kind, insertion seq, jump]``, so a restarted learner
reopens the same pool (same ids) and can train on it without the bus. Because entries are
copies, retention may delete the ordinary originals (gyre_async.experience.retention).

Mixing and weights: each update adds elite segments worth about ``elite.mix_share`` of the
fresh steps (drawn at random, seeded by run seed and version; entries whose content is in
the fresh batch are skipped). They bypass the staleness gate (they are old by design) and
are trained like the rest of the batch:

- advantages: their **stored scored rewards** with **current values** (segment GAE,
  bootstrapped at the stored boundary context, exactly as for fresh segments);
- importance weight: their action log-probs are the behaviour policy's, recorded when they
  were sampled, so the decoupled PPO loss (gyre_async.rl.ppo) applies unchanged: ratio to
  the proximal (current) policy, times the truncated weight
  ``min(pi_prox / pi_behaviour, learner.is_cap)``.

Audit: ``policy-version.trained_segments`` lists the fresh segments only (the elite ones
are not consumed from the bus) and ``policy-version.elite_segments`` the content hashes of
the elite ones mixed in after them; the recorded advantage digest covers the whole batch,
so ``gyre replay learner`` rebuilds each elite segment as the learner trained it
(:func:`elite_scored`): from the pool's copy, or, once evicted, from its source segment
(:func:`entry_arrays`).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from gyre_async.storage.segments import SegmentStore
from schemas.events import Scored

KIND_TURNING, KIND_SUCCESS = 0, 1
ELITE_PREFIX = "elite:"


@dataclass(frozen=True)
class EliteEntry:
    content_hash: str  # of the source segment: the entry's id in the pool
    kind: int
    seq: int
    jump: float
    steps: int

    @property
    def rank(self) -> tuple[int, int]:
        """Eviction order: lowest first (turning points before successes, oldest first)."""
        return (self.kind, self.seq)


def value_jump(values: Sequence[float]) -> float:
    """Largest change of the value estimate between consecutive steps (0 for one step)."""
    v = np.asarray(values, dtype=np.float64)
    return float(np.abs(np.diff(v)).max()) if v.size > 1 else 0.0


def classify(scored: Scored, values: Sequence[float], jump_threshold: float
             ) -> tuple[int, float] | None:
    """``(kind, jump)`` if the segment belongs in the pool, else None."""
    jump = value_jump(values)
    if scored.trajectory_done and scored.success:
        return KIND_SUCCESS, jump
    if jump >= jump_threshold:
        return KIND_TURNING, jump
    return None


def evictions(entries: Sequence[EliteEntry], capacity: int) -> list[EliteEntry]:
    """Which entries to evict so that at most ``capacity`` remain (the documented rule)."""
    excess = len(entries) - capacity
    return sorted(entries, key=lambda e: e.rank)[:excess] if excess > 0 else []


class ElitePool:
    """The pool over its own :class:`SegmentStore`; one writer (the learner)."""

    def __init__(self, url: str, capacity: int, jump_threshold: float = 0.1,
                 mix_share: float = 0.1, seed: int = 0, durable: bool = False):
        if capacity < 1:
            raise ValueError("elite.capacity must be >= 1 to keep a pool (0 turns it off)")
        if not 0.0 <= mix_share <= 1.0:
            raise ValueError("elite.mix_share must be in [0, 1]")
        self.capacity, self.jump_threshold = capacity, jump_threshold
        self.mix_share, self.seed = mix_share, seed
        self.store = SegmentStore(url, chunk_bytes=32 * 1024, durable=durable)
        self.entries: dict[str, EliteEntry] = {}
        self.added = self.evicted = self.mixed_steps = 0
        self._pages = 0
        ids = self.store.list_segments()
        for sid, arrays in zip(ids, self.store.read_many([self.store.address(i) for i in ids])):
            kind, seq, jump = arrays["elite_meta"].tolist()
            self.entries[sid] = EliteEntry(sid, int(kind), int(seq), float(jump),
                                           len(arrays["elite_rewards"]))
        self._next_seq = max((e.seq for e in self.entries.values()), default=-1) + 1

    def hashes(self) -> list[str]:
        return sorted(self.entries)

    # -- admission ----------------------------------------------------------------------
    def offer(self, batch: Sequence[tuple[Scored, dict[str, np.ndarray], Sequence[float]]]
              ) -> list[str]:
        """Consider freshly trained segments ``(scored, arrays, values)``; returns the ids
        added. Elite copies in the batch and known content are skipped (deduplication)."""
        new: list[tuple[str, dict[str, np.ndarray]]] = []
        for scored, arrays, values in batch:
            h = scored.content_hash
            if scored.segment_id.startswith(ELITE_PREFIX) or h in self.entries:
                continue
            verdict = classify(scored, values, self.jump_threshold)
            if verdict is None:
                continue
            kind, jump = verdict
            entry = EliteEntry(h, kind, self._next_seq, jump, len(scored.step_rewards))
            self._next_seq += 1
            self.entries[h] = entry
            new.append((h, entry_arrays(scored, arrays, kind, entry.seq, jump)))
        gone = evictions(list(self.entries.values()), self.capacity)
        for e in gone:
            del self.entries[e.content_hash]
        new = [(h, a) for h, a in new if h in self.entries]  # in and out in one batch
        if new:
            self.store.write_many(new)
            self._pages += 1
        stored_gone = [e.content_hash for e in gone if self.store.contains(e.content_hash)]
        if stored_gone:
            self.store.delete(stored_gone)
            self._pages += 1
        if self._pages >= 16:  # keep the index to one snapshot plus a few pages
            self.store.compact_index()
            self._pages = 0
        self.added += len(new)
        self.evicted += len(gone)
        return [h for h, _ in new]

    # -- mixing -------------------------------------------------------------------------
    def sample(self, fresh_steps: int, version: int, exclude: Collection[str] = frozenset()
               ) -> list[tuple[Scored, dict[str, np.ndarray]]]:
        """Elite segments worth about ``mix_share * fresh_steps`` steps, as ``(scored,
        arrays)`` pairs the learner can train on (see the module docstring)."""
        target = int(round(self.mix_share * fresh_steps))
        if target <= 0 or not self.entries:
            return []
        rng = random.Random(f"elite|{self.seed}|{version}")
        order = [h for h in sorted(self.entries) if h not in exclude]
        rng.shuffle(order)
        chosen, steps = [], 0
        for h in order:
            if steps >= target:
                break
            chosen.append(h)
            steps += self.entries[h].steps
        if not chosen:
            return []
        arrays = self.store.read_many([self.store.address(h) for h in chosen])
        self.mixed_steps += steps
        return [(self._scored(h, a), a) for h, a in zip(chosen, arrays)]

    def _scored(self, h: str, arrays: dict[str, np.ndarray]) -> Scored:
        return elite_scored(self.store.address(h), h, arrays)

    def stats(self) -> dict[str, float]:
        return {"elite/size": float(len(self.entries)), "elite/added": float(self.added),
                "elite/evicted": float(self.evicted), "elite/mixed_steps": float(self.mixed_steps)}


def entry_arrays(scored: Scored, arrays: dict[str, np.ndarray], kind: int = KIND_TURNING,
                 seq: int = 0, jump: float = 0.0) -> dict[str, np.ndarray]:
    """A pool entry's arrays: the source segment's, its scored rewards (as float32) and
    ``[kind, insertion seq, jump]``."""
    return {**arrays, "elite_rewards": np.asarray(scored.step_rewards, np.float32),
            "elite_meta": np.array([kind, seq, jump], np.float64)}


def elite_scored(address: str, h: str, arrays: dict[str, np.ndarray]) -> Scored:
    """The ``scored`` event an entry (content hash ``h``, its :func:`entry_arrays`) is
    trained under: its own trajectory (no outcome advantage), its stored rewards."""
    rewards = [float(r) for r in arrays["elite_rewards"]]
    return Scored(
        event_id=f"elite-{h}", run_id="", producer="elite-pool", key=h,
        segment_id=f"{ELITE_PREFIX}{h}", trajectory_id=f"{ELITE_PREFIX}{h}", task_id="",
        address=address, content_hash=h, step_start=0, step_end=len(rewards),
        min_policy_version=int(arrays["policy_version"].min()),
        trajectory_done=bool(arrays["terminal"][0]),
        success=int(arrays["elite_meta"][0]) == KIND_SUCCESS,
        components={"elite": 1.0}, step_rewards=rewards, total=float(sum(rewards)),
        decided_by="elite-pool")


def open_elite_pool(cfg) -> ElitePool | None:
    """The run's pool (None when ``elite.capacity`` is 0)."""
    E = cfg.elite
    if E.capacity <= 0:
        return None
    return ElitePool(E.store or f"{cfg.run.run_dir}/elite.zarr", E.capacity, E.jump_threshold,
                     E.mix_share, cfg.run.seed, durable=cfg.segmenter.fsync)


def sample_for(pool: ElitePool, fresh: Sequence, version: int
               ) -> list[tuple[Scored, dict[str, np.ndarray]]]:
    """Elite ``(scored, arrays)`` to add to a batch of fresh items (``.scored``/``.steps``)."""
    return pool.sample(sum(b.steps for b in fresh), version,
                       {b.scored.content_hash for b in fresh})


def offer_trained(pool: ElitePool, items: Sequence, values) -> list[str]:
    """Offer a trained batch: ``items`` (``.scored``/``.arrays``/``.steps``) in the order the
    learner flattened them, ``values`` the critic's per-step values of that batch."""
    flat = [float(v) for v in values]
    batch, pos = [], 0
    for item in items:
        batch.append((item.scored, item.arrays, flat[pos:pos + item.steps]))
        pos += item.steps
    return pool.offer(batch)
