"""What a restarted learner must not train on again.

On Kafka a policy version and the commit of the inputs it was trained on are two steps: a
learner killed between them has its inputs redelivered after the restart, and without a
guard it would train on those segments a second time (one segment in two batches). The
embedded bus commits both in one transaction, so there this set is always empty of
redelivered ids; the guard costs one read of ``policy-version`` at start-up.

Only the last few versions matter: a learner commits right after each publish, so at most
the batch of the last version (or two, with a publish retried) can come back.
"""

from __future__ import annotations

from gyre_async.bus import Bus
from gyre_async.bus.reading import read_events
from schemas.events import PolicyVersion
from schemas.topics import POLICY_VERSION


async def recently_trained(bus: Bus, run_id: str, last_versions: int = 8) -> set[str]:
    """Segment ids in the batches of the run's last ``last_versions`` policy versions."""
    if POLICY_VERSION not in {t.name for t in await bus.topics()}:
        return set()
    versions: dict[int, list[str]] = {}
    async for _, event in read_events(bus, [POLICY_VERSION], on_bad="skip"):  # a rebuild
        if isinstance(event, PolicyVersion) and event.run_id == run_id:
            versions.setdefault(event.version, []).extend(event.trained_segments)
    recent = sorted(versions)[-last_versions:]
    return {sid for v in recent for sid in versions[v]}
