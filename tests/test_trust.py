"""The trust model (docs/RELIABILITY.md, "Trust model"): a role trusts its own config and run
directory, not the content of events.

- an address an event names resolves only inside the run's storage roots and protocol, and
  is refused before any file-system or network call (a foreign protocol opens no socket);
- a refused input is dead-lettered with a reason that starts with ``untrusted``, and the
  role goes on (the learner keeps training, its commits move);
- nothing is created, opened or deleted because an event named it: loading creates no
  folder, a crafted ``kept-checkpoint`` makes the keeper delete nothing;
- checkpoints are loaded only when announced by the role that owns them (producer, run id);
- a checkpoint holding NaN or inf weights is refused, naming the tensor.

Actors run on the real embedded bus.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import TinyConfig
from scratch import run_until
from test_bad_inputs import store_segment, tiny_learner_config

from actors.keeper import Keeper
from actors.learner import Learner
from actors.sampler import Sampler
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.compose import build_policy, build_tokenizer, load_weights, save_weights
from gyre_async.folds.runlog import current_policy_version
from gyre_async.runtime.actor import ActorRunner
from gyre_async.runtime.topology import build_actor
from gyre_async.storage.checkpoints import CheckpointNotFinite, CheckpointStore
from gyre_async.storage.errors import CheckpointError, UntrustedAddress, UntrustedProducer
from gyre_async.storage.roots import StorageRoots
from gyre_async.storage.segments import SegmentStore
from schemas import decode, encode, event_id
from schemas.events import (
    EvalResult,
    KeptCheckpoint,
    PolicyVersion,
    Rollback,
    SegmentClosed,
)
from schemas.topics import (
    ALL_TOPICS,
    EVAL,
    KEEPER,
    POLICY_VERSION,
    SCORED,
    SEGMENT_CLOSED,
)

SHA = "0" * 64


def _listener() -> socket.socket:
    """A local listening socket: a connection attempt to it completes in the kernel's
    backlog, so ``accept`` afterwards tells whether anything connected."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    return server


def _no_connection(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def _pv(ref, producer: str = "learner", **fields) -> PolicyVersion:
    return PolicyVersion(event_id=event_id("pv", ref.address, producer), run_id="tiny",
                         producer=producer, key="policy", version=ref.version,
                         checkpoint=ref.address, checkpoint_hash=ref.sha256,
                         reason="init" if ref.version == 0 else "update", **fields)


def published(scratch_bus, dead_letters: int, holds):
    """Stop once ``holds()`` and ``dead_letters`` dead letters are on the bus: a batch's
    outputs go out after its last record, so a stop as soon as the actor's state moved (a
    version loaded mid-batch) can end the actor before they are published, and on a loaded
    machine they were not yet there (they are not lost: the batch was not committed)."""
    async def until() -> bool:
        return holds() and len(await scratch_bus.dead_letters()) >= dead_letters
    return until


# -- the learner: a foreign protocol is dead-lettered, never kept, never connected to --------

async def test_learner_dead_letters_a_foreign_protocol_without_connecting_and_trains_on(
        tmp_path, tiny: TinyConfig, scratch_bus):
    cfg = tiny_learner_config(tiny)  # run_dir = tmp_path, batches of 8 steps
    store = SegmentStore(str(tmp_path / "segments.zarr"))  # the run's own segment store
    a, b, c, d = (store_segment(store, t) for t in ("traj-a", "traj-b", "traj-c", "traj-d"))
    server = _listener()
    port = server.getsockname()[1]
    foreign = msgspec.structs.replace(store_segment(store, "traj-x"), event_id="foreign",
                                      address=f"ftp://127.0.0.1:{port}/x#{a.segment_id}")
    await scratch_bus.publish(SCORED, a, foreign, b, c, d, key=b"k")
    learner = Learner(cfg)
    await scratch_bus.run(learner, published(scratch_bus, 1, lambda: learner.core.version >= 2))
    dead = await scratch_bus.dead_letters()
    versions = await scratch_bus.events(POLICY_VERSION)
    committed = await scratch_bus.bus.committed("tiny.learner", SCORED)
    try:
        assert _no_connection(server), "the learner connected to the address an event named"
    finally:
        server.close()
    assert len(dead) == 1 and dead[0].source_offset == 1, [d.reason for d in dead]
    assert "untrusted address" in dead[0].reason and "ftp://127.0.0.1" in dead[0].reason
    assert [v.version for v in versions] == [0, 1, 2]  # it kept training on good segments
    assert versions[1].trained_segments == [a.segment_id, b.segment_id]
    assert versions[2].trained_segments == [c.segment_id, d.segment_id]
    assert committed == {0: 5}  # and its commits moved past the refused event
    assert learner.core.buffer == []


# -- addresses outside the roots: segments and checkpoints --------------------------------

def _roots(tmp_path: Path) -> StorageRoots:
    run = tmp_path / "run"
    return StorageRoots("tiny", f"file://{run}/segments.zarr", f"file://{run}/checkpoints",
                        f"file://{run}/keeper")


@pytest.mark.parametrize("address", [
    "segments.zarr#seg-1",  # relative
    "run/segments.zarr#seg-1",
    "{tmp}/run/segments.zarr#seg-1",  # absolute, but not in the store's own spelling
    "file://{tmp}/other.zarr#seg-1",  # absolute, outside the roots
    "file:///etc#passwd",
    "file://{tmp}/run/segments.zarr/../../other.zarr#seg-1",  # climbs out
    "file://{tmp}/run/segments-a/../../x.zarr#seg-1",  # a "replica" that climbs out
    "file://{tmp}/run/checkpoints#seg-1",  # another root of the run
    "ftp://127.0.0.1:21/{tmp}/run/segments.zarr#seg-1",  # another protocol
    "s3://bucket/run/segments.zarr#seg-1",
    "file://{tmp}/run/segments.zarr#",  # no segment id
    "file://{tmp}/run/segments.zarr",
])
def test_segment_addresses_outside_the_roots_are_refused(tmp_path, address):
    roots = _roots(tmp_path)
    with pytest.raises(UntrustedAddress, match="untrusted address"):
        roots.segment(address.format(tmp=tmp_path))
    # the run's store and a segmenter replica's store beside it resolve
    assert roots.segment(f"file://{tmp_path}/run/segments.zarr#seg-1")
    assert roots.segment(f"file://{tmp_path}/run/segments-segmenter-1.zarr#seg-1")


@pytest.mark.parametrize("address", [
    f"v000000000001-{SHA}.safetensors",  # relative
    f"checkpoints/v000000000001-{SHA}.safetensors",
    f"{{tmp}}/run/checkpoints/v000000000001-{SHA}.safetensors",  # not the store's spelling
    f"file://{{tmp}}/elsewhere/v000000000001-{SHA}.safetensors",  # absolute, outside
    f"file://{{tmp}}/run/checkpoints/../../v000000000001-{SHA}.safetensors",
    f"file://{{tmp}}/run/checkpoints/sub/v000000000001-{SHA}.safetensors",  # a sub-folder
    "file://{tmp}/run/checkpoints/notes.txt",  # not a checkpoint's name
    "file://{tmp}/run/checkpoints/../events.db",
    f"file://{{tmp}}/run/keeper/v000000000001-{SHA}.safetensors",  # the keeper's root
    f"ftp://127.0.0.1:21{{tmp}}/run/checkpoints/v000000000001-{SHA}.safetensors",
])
def test_checkpoint_addresses_outside_the_roots_are_refused(tmp_path, address):
    roots = _roots(tmp_path)
    with pytest.raises(UntrustedAddress, match="untrusted address"):
        roots.checkpoint(address.format(tmp=tmp_path), "learner")
    good = f"file://{tmp_path}/run/checkpoints/v000000000001-{SHA}.safetensors"
    assert roots.checkpoint(good, "learner") == good
    if address.startswith("{tmp}/run/checkpoints/"):
        return  # a store, handed a plain path of its own file, reads it (its own API)
    with pytest.raises(UntrustedAddress):  # ... and the store itself refuses the others too
        CheckpointStore(str(tmp_path / "run" / "checkpoints")).load(
            address.format(tmp=tmp_path), SHA)


async def test_sampler_dead_letters_a_checkpoint_outside_the_roots_and_creates_nothing(
        tmp_path, tiny: TinyConfig, scratch_bus):
    """A ``policy-version`` naming a real, intact checkpoint (right hash) in a folder outside
    the run's checkpoint root: refused unread; a good one is then loaded."""
    cfg = tiny_learner_config(tiny)
    sampler = Sampler(cfg)
    outside = save_weights(CheckpointStore(str(tmp_path / "outside")), sampler.holder.policy, 0)
    missing = tmp_path / "never" / "made"
    nowhere = msgspec.structs.replace(
        _pv(outside), event_id="nowhere", checkpoint=f"file://{missing}/{outside.address.rsplit('/', 1)[1]}")
    good = save_weights(CheckpointStore(str(tmp_path / "checkpoints")), sampler.holder.policy, 1)
    await scratch_bus.publish(POLICY_VERSION, _pv(outside), nowhere, _pv(good), key=b"policy")
    await scratch_bus.run(sampler, published(scratch_bus, 2, lambda: sampler.holder.version >= 1),
                          30)
    dead = await scratch_bus.dead_letters()
    assert [d.source_offset for d in dead] == [0, 1], [d.reason for d in dead]
    assert all("untrusted address" in d.reason for d in dead)
    assert sampler.holder.version == 1  # the good one, from the run's root, was loaded
    assert not (tmp_path / "never").exists()


# -- nothing is created because an event named it ---------------------------------------------

def test_loading_a_checkpoint_creates_no_directory(tmp_path, tiny: TinyConfig):
    cfg = tiny.config()
    policy = build_policy(cfg, build_tokenizer(cfg))
    address = f"file://{tmp_path}/made/by/an/event/v000000000001-{SHA}.safetensors"
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(policy, address, SHA)
    from gyre_async.core.keeper import _load
    with pytest.raises(CheckpointError, match="does not exist"):
        _load(address, SHA)
    assert not (tmp_path / "made").exists()


# -- checkpoints announced by the role that owns them -----------------------------------------

async def test_checkpoints_announced_by_another_producer_are_refused(tmp_path, tiny: TinyConfig, scratch_bus):
    """A ``policy-version`` must come from this run's learner; a ``rollback`` from its
    keeper, with the file in the keeper's store: forged ones are dead-lettered with the
    reason, whatever hash they carry (the file and hash here are real)."""
    cfg = tiny_learner_config(tiny)
    sampler = Sampler(cfg)
    ref = save_weights(CheckpointStore(str(tmp_path / "checkpoints")), sampler.holder.policy, 3)
    forged = [_pv(ref, producer=p) for p in ("arbiter", "sampler", "learnerx", "keeper")]
    await scratch_bus.publish(POLICY_VERSION, *forged, key=b"policy")
    runner = scratch_bus.runner(sampler)
    await run_until(runner, lambda: runner.dead_letters >= len(forged), 30)
    dead = await scratch_bus.dead_letters()
    roots = StorageRoots.from_config(cfg)
    # a restart looking for the latest version skips them too
    assert await current_policy_version(scratch_bus.bus, "tiny", roots.trusts) is None
    assert (await current_policy_version(scratch_bus.bus, "tiny")).producer == "keeper"
    assert len(dead) == len(forged) and sampler.holder.version == -1
    assert all("untrusted producer" in d.reason for d in dead), [d.reason for d in dead]
    assert sampler.core.learner_version == -1  # the gate did not move either

    order = Rollback(event_id="r1", run_id="tiny", producer="learner", key="keeper",
                     sequence=1, regressed_version=3, restore_version=2, slot="best",
                     checkpoint=ref.address, checkpoint_hash=ref.sha256, learning_rate=1e-4,
                     previous_learning_rate=1e-3, why="forged")
    with pytest.raises(UntrustedProducer, match="untrusted producer"):
        roots.checkpoint_of(order)
    with pytest.raises(UntrustedAddress):  # the keeper's name, the learner's file
        roots.checkpoint_of(msgspec.structs.replace(order, producer="keeper"))
    with pytest.raises(UntrustedProducer, match="run 'other'"):
        roots.checkpoint_of(msgspec.structs.replace(_pv(ref), run_id="other"))
    assert roots.checkpoint_of(_pv(ref)) == ref.address
    assert roots.checkpoint_of(_pv(ref, producer="learner-0")) == ref.address
    assert roots.checkpoint_of(_pv(ref, producer="warmstart")) == ref.address


async def test_arbiter_dead_letters_a_segment_outside_the_roots(tmp_path, tiny: TinyConfig, scratch_bus):
    cfg = tiny_learner_config(tiny)
    closed = SegmentClosed(
        event_id="c1", run_id="tiny", producer="segmenter", key="traj-a", segment_id="seg-1",
        trajectory_id="traj-a", task_id="task", step_start=0, step_end=2, boundary="max-length",
        address="ftp://127.0.0.1:21/x#seg-1", content_hash=SHA, min_policy_version=0,
        max_policy_version=0)
    await scratch_bus.publish(SEGMENT_CLOSED, closed)
    runner = scratch_bus.runner(build_actor("arbiter", cfg))
    await run_until(runner, lambda: runner.dead_letters >= 1, 30)
    dead = await scratch_bus.dead_letters()
    scored = await scratch_bus.events(SCORED)
    assert len(dead) == 1 and "untrusted address" in dead[0].reason, dead
    assert scored == []  # never passed on to the learner


async def test_a_forged_version_dated_in_the_future_is_not_in_force_after_a_later_one(
        tmp_path, tiny: TinyConfig, scratch_bus):
    """The version in force on a restart is the last one published, in log order: a
    forged announcement (trusted producer and file, a timestamp far in the future) is in
    force only until the learner publishes again, not at every restart after."""
    cfg = tiny_learner_config(tiny)
    policy = build_policy(cfg, build_tokenizer(cfg))
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    refs = [save_weights(store, policy, v, {"run_id": "tiny"}) for v in range(3)]
    forged = msgspec.structs.replace(_pv(refs[0]), event_id="forged", version=7,
                                     ts=time.time() + 10 * 365 * 86400)
    await scratch_bus.publish(POLICY_VERSION, _pv(refs[0]), _pv(refs[1]), forged, _pv(refs[2]))
    trusted = StorageRoots.from_config(cfg).trusts
    in_force = await current_policy_version(scratch_bus.bus, "tiny", trusted)
    assert in_force is not None and in_force.event_id == _pv(refs[2]).event_id


# -- the keeper deletes only files it wrote ----------------------------------------------------

def _eval(version: int, success: float) -> EvalResult:
    return EvalResult(event_id=event_id("eval", version, success), run_id="tiny",
                      producer="evaluator", key="eval", policy_version=version, episodes=32,
                      success_rate=success, mean_score=success, mean_length=10.0)


async def test_a_crafted_kept_checkpoint_makes_the_keeper_delete_nothing(tmp_path, tiny: TinyConfig):
    """Crafted ``kept-checkpoint`` events, folded when the keeper starts, name a file outside
    the run directory and a checkpoint-named file in the keeper's store that the keeper did
    not write. When the slots are next replaced, neither is deleted."""
    cfg = tiny.config(keeper={"probe_contexts": 1})
    run_dir = Path(cfg.run.run_dir)
    policy = build_policy(cfg, build_tokenizer(cfg))
    refs = [save_weights(CheckpointStore(str(run_dir / "checkpoints")), policy, v)
            for v in (0, 1)]
    victim_dir = tmp_path / "outside"
    victim = CheckpointStore(str(victim_dir)).save(0, {"w": torch.zeros(2)})  # a real file
    planted = CheckpointStore(str(run_dir / "keeper")).save(9, {"w": torch.ones(2)},
                                                            {"run_id": "tiny"})  # no slot header
    ids = {"run_id": "tiny", "producer": "keeper", "key": "keeper"}
    crafted = [KeptCheckpoint(event_id="k-out", slot="best", version=0, address=victim.address,
                              sha256=victim.sha256, **ids),
               KeptCheckpoint(event_id="k-in", slot="stable", version=0,
                              address=planted.address, sha256=planted.sha256, **ids)]
    async with open_bus(f"sqlite:///{run_dir}/events.db") as bus:
        await bus.create_topics(ALL_TOPICS, 1)
        await bus.publish(KEEPER, [(b"keeper", encode(e)) for e in crafted])
        await bus.publish(POLICY_VERSION, [(b"policy", encode(msgspec.structs.replace(
            _pv(r), parent=r.version - 1 if r.version else None))) for r in refs])
        keeper = Keeper(cfg)
        runner = ActorRunner(keeper, bus, run_id="tiny", name="keeper", partitions=1,
                             heartbeat_s=30)
        task = asyncio.create_task(runner.run())
        try:
            await bus.publish(EVAL, [(b"eval", encode(e)) for e in (_eval(0, 0.2), _eval(1, 0.5))])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not task.done() and not (
                    keeper.core and (slot := keeper.core.slots.slots.get("best"))
                    and slot.version == 1 and await runner.caught_up()):
                await asyncio.sleep(0.1)
        finally:
            runner.stop()
            await task
        kept = [e for r in await read_topics(bus, [KEEPER])
                if isinstance(e := decode(KEEPER, r.value), KeptCheckpoint)]
    assert Path(victim.address.removeprefix("file://")).exists()  # outside: untouched
    assert Path(planted.address.removeprefix("file://")).exists()  # not the keeper's: kept
    assert {(e.slot, e.version) for e in kept if e.event_id not in ("k-out", "k-in")} >= {
        ("best", 0), ("stable", 0), ("best", 1), ("stable", 1)}  # slots replaced twice
    assert keeper.core is not None and keeper.core.untrusted == 1  # the outside one, refused
    ours = [Path(e.address.removeprefix("file://")) for e in kept
            if e.event_id not in ("k-out", "k-in")]
    assert sum(p.exists() for p in ours) == 2  # its own replaced copy (v0) was removed


# -- NaN / inf weights --------------------------------------------------------------------------

async def test_a_checkpoint_with_nan_weights_is_refused_naming_the_tensor(tmp_path, tiny: TinyConfig,
                                                                         scratch_bus):
    cfg = tiny_learner_config(tiny)
    sampler = Sampler(cfg)
    policy = sampler.holder.policy
    name = sorted(k for k, v in policy.state_dict().items() if v.is_floating_point())[1]
    with torch.no_grad():
        policy.state_dict()[name].view(-1)[0] = float("nan")
    ref = save_weights(CheckpointStore(str(tmp_path / "checkpoints")), policy, 0)
    with pytest.raises(CheckpointNotFinite, match=f"tensor '{name}' holds NaN or inf"):
        load_weights(build_policy(cfg, build_tokenizer(cfg)), ref.address, ref.sha256)
    inf = CheckpointStore(str(tmp_path / "other")).save(0, {"a": torch.ones(3),
                                                            "b": torch.tensor([1.0, float("inf")])})
    with pytest.raises(CheckpointNotFinite, match="tensor 'b'.*1 of 2 values"):
        CheckpointStore(str(tmp_path / "other")).load(inf.address, inf.sha256)
    await scratch_bus.publish(POLICY_VERSION, _pv(ref), key=b"policy")
    runner = scratch_bus.runner(sampler)
    await run_until(runner, lambda: runner.dead_letters >= 1, 30)
    dead = await scratch_bus.dead_letters()
    assert len(dead) == 1 and name in dead[0].reason and "NaN or inf" in dead[0].reason
    assert sampler.holder.version == -1  # it never acted with those weights
