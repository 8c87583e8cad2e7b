"""The one recovery mechanism: an actor declares its folds, the runner restores them.

A :class:`Fold` is state rebuilt from past events: the topics it reads back, a filter
(``accepts``: by producer, by trust; the run is filtered by the reader) and ``apply``.
An actor lists its folds in :meth:`gyre_async.runtime.actor.Actor.folds`; the runner
(:class:`gyre_async.runtime.actor.ActorRunner`) restores every fold with one read of the
union of their topics (:func:`restore`), before ``on_start`` for folds of the actor's
whole history, and before the first records of each newly assigned partition for folds
that declare ``restore_on`` (state per partition: the segmenter's segments, the arbiter's
verdicts), so an actor never writes its own restart reads. Undecodable records are
skipped and counted (their live consumers dead-lettered them), the way every rebuild does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gyre_async.bus import Bus
from gyre_async.bus.reading import ReadCounts, read_events
from schemas import Event


class Fold(Protocol):
    @property
    def topics(self) -> tuple[str, ...]:
        """What the fold reads back (a topic that does not exist yet reads as empty)."""
        ...

    @property
    def restore_on(self) -> tuple[str, ...]:
        """Input topics whose newly assigned partitions restore the fold again (``()``:
        once, before ``on_start``)."""
        ...

    def accepts(self, event: Event) -> bool:
        """Whether ``event`` is the fold's (its producer, its trust); the run is filtered
        before this is asked."""
        ...

    def apply(self, event: Event) -> None:
        """Take one accepted event, in log order (per partition)."""
        ...


class FoldBase:
    """Defaults for a fold: every event of its topics, restored once at start (a subclass
    adds its ``apply``)."""

    topics: tuple[str, ...] = ()
    restore_on: tuple[str, ...] = ()

    def accepts(self, event: Event) -> bool:
        return True


async def restore(bus: Bus, folds: Sequence[Fold], *, run_id: str | None,
                  counts: ReadCounts | None = None) -> ReadCounts:
    """Feed ``folds`` every past event of their topics (of ``run_id``) in one read."""
    seen = counts if counts is not None else ReadCounts()
    topics = sorted({t for fold in folds for t in fold.topics})
    if not topics:
        return seen
    async for record, event in read_events(bus, topics, on_bad="skip", counts=seen,
                                           run_id=run_id, missing="empty"):
        for fold in folds:
            if record.topic in fold.topics and fold.accepts(event):
                fold.apply(event)
    return seen
