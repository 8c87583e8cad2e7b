"""The learner's outcome book, rebuilt from the event log (restart and replay audit).

Which trajectory outcomes the learner knew at each update is a function of the log: every
``scored`` event is recorded on arrival, and an outcome becomes known in the update whose
``trained_segments`` hold the trajectory's final segment (see ``gyre_async.rl.fusion``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from gyre_async.bus import Bus
from gyre_async.bus.reading import read_events
from gyre_async.folds.fold import FoldBase
from gyre_async.rl.fusion import OutcomeBook
from schemas import Event
from schemas.events import PolicyVersion, Scored
from schemas.topics import POLICY_VERSION, SCORED


def batch_keys(segments: list[Scored]) -> list[tuple[str, str, bool]]:
    """What :meth:`OutcomeBook.global_advantages` needs of each segment of a batch."""
    return [(s.trajectory_id, s.task_id, s.trajectory_done) for s in segments]


class CreditLog(FoldBase):
    """Every scored segment (log order) and every update the learner published (in order)."""

    topics = (SCORED, POLICY_VERSION)

    def __init__(self) -> None:
        self.scored: dict[str, Scored] = {}
        self.updates: list[PolicyVersion] = []

    def apply(self, event: Event) -> None:
        if isinstance(event, Scored):
            self.scored[event.segment_id] = event
        elif isinstance(event, PolicyVersion) and event.reason == "update":
            self.updates.append(event)

    def outcome_book(self, group_size: int, mask_failed: bool = True) -> OutcomeBook:
        """The book as the learner left it after its last published update."""
        book = OutcomeBook(group_size, mask_failed)
        for _ in replay_outcome_book(book, self.scored, self.updates):
            pass
        return book


async def read_credit_log(bus: Bus, on_bad: Literal["skip", "raise"] = "raise",
                          run_id: str | None = None,
                          ) -> tuple[dict[str, Scored], list[PolicyVersion]]:
    """Every scored segment (log order) and every update the learner published (in order).

    ``on_bad``: the replay audit raises on an undecodable record (no report on a partial
    log); the learner's restart skips it, as the live learner dead-lettered it. ``run_id``:
    only that run's events (a cluster's topics hold every run's).
    """
    log = CreditLog()
    async for _, event in read_events(bus, log.topics, on_bad=on_bad, run_id=run_id):
        log.apply(event)
    return log.scored, log.updates


def replay_outcome_book(book: OutcomeBook, scored: dict[str, Scored],
                        updates: list[PolicyVersion]) -> Iterator[tuple[PolicyVersion, list[float]]]:
    """Feed ``book`` the log; yield each update with the global advantages it used."""
    for event in scored.values():
        book.record(event.trajectory_id, event.segment_id, event.total,
                    failed=bool(event.failure))
    for update in updates:
        batch = [scored[sid] for sid in update.trained_segments if sid in scored]
        yield update, book.global_advantages(batch_keys(batch))
