"""The run's storage roots: the only places an address named by an event may point to.

A role trusts its own config and run directory, not the content of events: anything that
can publish on the bus can write any address into a ``segment-closed``, ``scored``,
``policy-version``, ``rollback`` or ``kept-checkpoint`` event, and a content hash that
arrives in the same event proves nothing about who wrote it. So every address a role takes
from an event goes through :class:`StorageRoots` first. It compares strings only: no
file-system or network call happens before an address is accepted, so a foreign protocol
(``ftp://host:port/x#id``) opens no connection and a path outside the roots is never
stat-ed, created, opened or deleted.

What resolves, and nothing else (stores hand out canonical addresses:
:func:`~gyre_async.storage.urls.normalize_store_url`):

- a segment: ``<store>#<segment-id>`` where ``<store>`` is the run's segment store
  (``segmenter.store``, default ``<run_dir>/segments.zarr``) or a segmenter replica's store
  beside it (:func:`~gyre_async.storage.store_set.segment_store_url`), spelled exactly as
  the store spells itself (same protocol, absolute, no ``..``);
- a checkpoint: ``<root>/v<12 digits>-<sha256>.safetensors`` directly in the root of the
  role that owns it: ``learner.checkpoints`` (default ``<run_dir>/checkpoints``) for a
  ``policy-version`` announced by the learner (or ``gyre warmstart``), ``keeper.store``
  (default ``<run_dir>/keeper``) for a ``rollback`` or ``kept-checkpoint`` announced by the
  keeper; the event's run id is the run's.

Refusals raise :class:`UntrustedAddress` / :class:`UntrustedProducer` with a message that
starts with ``untrusted``; a consuming role lets them propagate, so the runtime
dead-letters the event with that reason, and the role goes on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gyre_async.storage.errors import UntrustedAddress, UntrustedProducer
from gyre_async.storage.segment_index import check_segment_id
from gyre_async.storage.urls import normalize_store_url

if TYPE_CHECKING:
    from schemas.config import Config
    from schemas.events import KeptCheckpoint, PolicyVersion, Rollback

__all__ = ["CHECKPOINT_NAME", "StorageRoots", "UntrustedAddress", "UntrustedProducer",
           "checkpoint_in", "is_role"]

#: the name of every checkpoint file (gyre_async.storage.checkpoints): version and sha256
CHECKPOINT_NAME = re.compile(r"^v(\d{12})-([0-9a-f]{64})\.safetensors$")
#: an actor name as the launcher makes them (``segmenter``, ``segmenter-2``)
_ACTOR_NAME = re.compile(r"^[A-Za-z0-9_]+(?:-[A-Za-z0-9_]+)*$")
_SHOWN = 200  # an address is quoted in a refusal up to this many characters

CheckpointOwner = Literal["learner", "keeper"]
#: which producers may announce the checkpoints of each owner's root
OWNER_ROLES: dict[CheckpointOwner, tuple[str, ...]] = {
    "learner": ("learner", "warmstart"), "keeper": ("keeper",)}


def is_role(producer: str, role: str) -> bool:
    """``producer`` is an actor of ``role``: the role's own name or a replica's
    (``learner``, ``learner-0``)."""
    return producer == role or (producer.startswith(f"{role}-")
                                and _ACTOR_NAME.match(producer) is not None)


def _shown(address: str) -> str:
    return repr(address if len(address) <= _SHOWN else address[:_SHOWN] + "...")


def checkpoint_in(root: str, address: str) -> str:
    """``address`` if it names a checkpoint file directly in the store at canonical URL
    ``root`` (same protocol, no sub-folder, a checkpoint's name); else UntrustedAddress.
    String comparison only."""
    parent, sep, name = address.rpartition("/")
    if sep and parent == root and CHECKPOINT_NAME.match(name):
        return address
    raise UntrustedAddress(
        f"untrusted address {_shown(address)}: checkpoints are read only as "
        f"{root}/v<version>-<sha256>.safetensors (the run's configured checkpoint root, "
        "same protocol); refused without opening it")


@dataclass(frozen=True)
class StorageRoots:
    """The run's roots (canonical store URLs) and the run id; see the module docstring."""

    run_id: str
    segments: str  # the segment store; replicas' stores sit beside it
    checkpoints: str  # the learner's checkpoints
    keeper: str  # the keeper's copies

    @classmethod
    def from_config(cls, cfg: Config) -> StorageRoots:
        run_dir = cfg.run.run_dir
        return cls(
            cfg.run.run_id,
            normalize_store_url(cfg.segmenter.store or f"{run_dir}/segments.zarr")[0],
            normalize_store_url(cfg.learner.checkpoints or f"{run_dir}/checkpoints")[0],
            normalize_store_url(cfg.keeper.store or f"{run_dir}/keeper")[0])

    # -- segments ---------------------------------------------------------------------------
    def segment_store(self, url: str) -> bool:
        """``url`` is the run's segment store or a segmenter replica's."""
        if url == self.segments:
            return True
        stem = self.segments[: -len(".zarr")] if self.segments.endswith(".zarr") \
            else self.segments
        name = url[len(stem) + 1: -len(".zarr")] if url.startswith(f"{stem}-") and \
            url.endswith(".zarr") else ""
        return _ACTOR_NAME.match(name) is not None

    def segment(self, address: str) -> str:
        """``address`` (``<store-url>#<segment-id>``) if it names a segment in one of the
        run's segment stores; else UntrustedAddress."""
        url, sep, segment_id = address.rpartition("#")
        try:
            check_segment_id(segment_id)
        except ValueError:
            sep = ""
        if sep and self.segment_store(url):
            return address
        raise UntrustedAddress(
            f"untrusted address {_shown(address)}: segments are read only as "
            f"<store>#<segment-id> from the run's segment store {self.segments} or a "
            "segmenter replica's store beside it (same protocol); refused without opening it")

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint(self, address: str, owner: CheckpointOwner) -> str:
        """``address`` if it names a checkpoint file in ``owner``'s root."""
        return checkpoint_in(self.checkpoints if owner == "learner" else self.keeper, address)

    def announced(self, producer: str, run_id: str, owner: CheckpointOwner, what: str) -> None:
        """UntrustedProducer unless an actor of the owner's role of this run announced it."""
        roles = OWNER_ROLES[owner]
        if run_id != self.run_id:
            raise UntrustedProducer(
                f"untrusted producer: {what} of run {run_id!r}, not of this run "
                f"({self.run_id!r}); refused")
        if not any(is_role(producer, role) for role in roles):
            raise UntrustedProducer(
                f"untrusted producer: {what} announced by {producer!r}; only the "
                f"{' or '.join(roles)} announce{'s' if len(roles) == 1 else ''} these "
                "checkpoints; refused")

    def checkpoint_of(self, event: PolicyVersion | Rollback | KeptCheckpoint) -> str:
        """The checkpoint address an event names, once its producer, run id and address
        are checked: ``policy-version`` -> the learner's root, ``rollback`` and
        ``kept-checkpoint`` -> the keeper's."""
        from schemas.events import KeptCheckpoint, PolicyVersion, Rollback

        match event:
            case PolicyVersion():
                owner: CheckpointOwner = "learner"
                address, what = event.checkpoint, f"policy-version v{event.version}"
            case Rollback():
                owner, address = "keeper", event.checkpoint
                what = f"rollback #{event.sequence}"
            case KeptCheckpoint():
                owner, address = "keeper", event.address
                what = f"kept-checkpoint {event.slot} v{event.version}"
            case _:
                raise TypeError(f"{type(event).__name__} names no checkpoint")
        self.announced(event.producer, event.run_id, owner, what)
        return self.checkpoint(address, owner)

    def trusts(self, event: PolicyVersion | Rollback | KeptCheckpoint) -> bool:
        """For read-backs (restarts): True if :meth:`checkpoint_of` accepts the event."""
        try:
            self.checkpoint_of(event)
        except (UntrustedAddress, UntrustedProducer):
            return False
        return True
