"""The keeper's three checkpoints: its own verified copies, and loading with fallback.

Slots (see ``schemas.events.KeptCheckpoint``):

- ``best``: the best validation so far;
- ``stable``: the latest version whose validation did not regress;
- ``pre-large``: the version before the last large update.

Each slot is the keeper's own safetensors file in its store (``keeper.store``, default
``<run_dir>/keeper``), written through :class:`CheckpointStore`: the name carries the
version and the file's sha256, and the header's metadata says which slot, which source
version and checkpoint, and why it was kept. Copies, not references, so that checkpoint
retention elsewhere can never take away the weights a rollback needs.

Only the keeper's own files are trusted: a slot remembered from a ``kept-checkpoint`` event
must name a file directly in this store, and a replaced copy is removed only if its header
says it is a slot copy of this run (:meth:`KeptSlots.wrote`): a crafted event can make the
keeper neither load nor delete anything else.

Loading verifies the sha256 first. :meth:`KeptSlots.restore` walks the slots in order of
preference (best, then stable, then pre-large) and returns the first that loads; every
slot that fails becomes a :class:`Fault` the caller publishes (``checkpoint-fault``), so a
corrupt file is reported and skipped, never loaded and never silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from gyre_async.storage.checkpoints import CheckpointRef, CheckpointStore
from gyre_async.storage.errors import CheckpointError, UntrustedAddress
from gyre_async.storage.roots import checkpoint_in

log = structlog.get_logger(__name__)

#: Order of preference when restoring.
RESTORE_ORDER = ("best", "stable", "pre-large")


@dataclass(frozen=True)
class Kept:
    slot: str
    version: int
    address: str
    sha256: str


@dataclass(frozen=True)
class Fault:
    slot: str
    version: int
    address: str
    expected_sha256: str
    error: str


@dataclass(frozen=True)
class Restored:
    """What a restore found: the slot used (None if none was usable) and the failures."""

    kept: Kept | None
    tensors: dict[str, torch.Tensor] | None
    faults: tuple[Fault, ...]


class KeptSlots:
    """The three slots over one checkpoint store."""

    def __init__(self, url: str):
        self.store = CheckpointStore(url)
        self.slots: dict[str, Kept] = {}

    def keep(self, slot: str, version: int, tensors: dict[str, torch.Tensor],
             metadata: dict[str, str], on_saved: Callable[[Kept], None] | None = None) -> Kept:
        """Copy ``tensors`` into ``slot`` (durable on return); drop the file it replaces.

        ``on_saved`` sees the new copy before the old file goes (the best pointer is
        rewritten there, so it never names a removed file)."""
        if slot not in RESTORE_ORDER:
            raise ValueError(f"unknown slot {slot!r}; slots are {', '.join(RESTORE_ORDER)}")
        ref: CheckpointRef = self.store.save(version, tensors,
                                             {**metadata, "keeper.slot": slot})
        old = self.slots.get(slot)
        kept = Kept(slot, version, ref.address, ref.sha256)
        self.slots[slot] = kept
        if on_saved is not None:
            on_saved(kept)
        if old is not None and old.address != kept.address and \
                all(k.address != old.address for k in self.slots.values()) and \
                self.wrote(old, metadata.get("run_id")):
            self.store.delete(old.address)
        return kept

    def wrote(self, kept: Kept, run_id: str | None) -> bool:
        """The file of ``kept`` is one this keeper wrote: in its own store (checked again
        here, whatever remembered it), with a slot copy's header of this run. Only those
        are ever removed; anything else stays where it is."""
        try:
            meta = self.store.metadata(kept.address)
        except (CheckpointError, UntrustedAddress) as exc:
            log.warning("keeper.not_removed", address=kept.address, why=str(exc))
            return False
        ours = "keeper.slot" in meta and meta.get("run_id") == run_id
        if not ours:
            log.warning("keeper.not_removed", address=kept.address,
                        why="not a slot copy this run's keeper wrote")
        return ours

    def remember(self, kept: Kept) -> None:
        """Rebuild a slot from a recorded ``kept-checkpoint`` event (restart). The address
        must name a file directly in this keeper's store (UntrustedAddress otherwise): a
        slot is later loaded, and removed when replaced."""
        checkpoint_in(self.store.url, kept.address)
        self.slots[kept.slot] = kept

    def load(self, kept: Kept) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The slot's tensors and metadata, sha256 verified (raises CheckpointError)."""
        return self.store.load(kept.address, kept.sha256)

    def restore(self, exclude_versions: frozenset[int] = frozenset()) -> Restored:
        """The first slot, in :data:`RESTORE_ORDER`, that loads and verifies."""
        faults: list[Fault] = []
        tried: set[str] = set()
        for slot in RESTORE_ORDER:
            kept = self.slots.get(slot)
            if kept is None or kept.version in exclude_versions or kept.address in tried:
                continue
            tried.add(kept.address)
            try:
                tensors, _meta = self.load(kept)
            except CheckpointError as exc:
                faults.append(Fault(slot, kept.version, kept.address, kept.sha256, str(exc)))
                continue
            return Restored(kept, tensors, tuple(faults))
        return Restored(None, None, tuple(faults))
