"""What a restarted learner must not train on again.

On Kafka a policy version and the commit of the inputs it was trained on are two steps: a
learner killed between them has its inputs redelivered after the restart, and without a
guard it would train on those segments a second time (one segment in two batches). The
embedded bus commits both in one transaction, so there this set is always empty of
redelivered ids; the guard is one of the learner's declared folds (read with the others).

Only the last few versions matter: a learner commits right after each publish, so at most
the batch of the last version (or two, with a publish retried) can come back.
"""

from __future__ import annotations

from gyre_async.folds.fold import FoldBase
from schemas import Event
from schemas.events import PolicyVersion
from schemas.topics import POLICY_VERSION


class RecentlyTrained(FoldBase):
    """Segment ids in the batches of the run's last ``last_versions`` policy versions."""

    topics = (POLICY_VERSION,)

    def __init__(self, last_versions: int = 8):
        self.last_versions = last_versions
        self.versions: dict[int, list[str]] = {}

    def apply(self, event: Event) -> None:
        if isinstance(event, PolicyVersion):
            self.versions.setdefault(event.version, []).extend(event.trained_segments)

    def segment_ids(self) -> set[str]:
        recent = sorted(self.versions)[-self.last_versions:]
        return {sid for v in recent for sid in self.versions[v]}
