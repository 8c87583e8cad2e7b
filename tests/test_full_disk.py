"""A full disk, for real: stores on a small tmpfs (this needs root, as CI has; without the
right to mount, the tests say so and skip — they are not counted as passes).

Each write that runs out of space raises ``StorageFull`` naming the path and the setting
to change; nothing half-written is visible to a reader (no index page for the segment, no
checkpoint file); the segmenter actor exits without committing the steps it could not
store, and once space is freed a restarted segmenter stores and announces all of them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from scratch import run_until

from actors.segmenter import Segmenter
from gyre_async.bus.reading import read_topics
from gyre_async.storage.checkpoints import CheckpointStore
from gyre_async.storage.errors import StorageFull
from gyre_async.storage.segments import SegmentStore
from schemas import event_id
from schemas.config import SegmenterConfig
from schemas.events import SegmentClosed, TrajectoryStep
from schemas.topics import SEGMENT_CLOSED, TRAJECTORY_STEP


@pytest.fixture
def small_volume(tmp_path):
    """A 1 MiB tmpfs, unmounted afterwards; ``resize(mib)`` remounts it bigger."""
    mount = tmp_path / "vol"
    mount.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.strip()}")

    def resize(mib: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={mib}m", str(mount)], check=True)

    try:
        yield mount, resize
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(volume: Path, leave_bytes: int) -> Path:
    """Fill the volume with one file until only about ``leave_bytes`` remain."""
    filler = volume / "filler"
    free = os.statvfs(volume).f_bavail * os.statvfs(volume).f_frsize
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
    return filler


def random_segment(rng: np.random.Generator, rows: int = 64) -> dict[str, np.ndarray]:
    # incompressible: the store's zstd cannot make it fit
    return {"context_tokens": rng.integers(0, 1 << 30, (rows, 256), dtype=np.int32)}


def test_segment_store_full_raises_clearly_and_shows_nothing_partial(small_volume):
    volume, resize = small_volume
    store = SegmentStore(str(volume / "segments.zarr"), chunk_bytes=32 * 1024)
    rng = np.random.default_rng(0)
    written, failed = [], None
    for i in range(40):  # 64 KiB each: the 1 MiB volume fills within 16
        batch = [(f"seg-{i}", random_segment(rng))]
        try:
            store.write_many(batch)
            written.append(batch[0])
        except StorageFull as exc:
            failed = (batch, exc)
            break
    assert failed is not None and written, "the volume never filled"
    batch, exc = failed
    message = str(exc)
    assert str(volume / "segments.zarr") in message and "segmenter.store" in message
    assert "No space left" in message and "Fix:" in message
    # a fresh reader sees exactly the segments written before, each whole
    reader = SegmentStore(str(volume / "segments.zarr"), read_only=True)
    assert reader.list_segments() == sorted(sid for sid, _ in written)
    for sid, arrays in written:
        np.testing.assert_array_equal(reader.read(reader.address(sid))["context_tokens"],
                                      arrays["context_tokens"])
    assert not reader.contains(batch[0][0])
    # space freed: the same write goes through, and the reader sees it whole
    resize(8)
    ref = store.write_many(batch)[0]
    np.testing.assert_array_equal(reader.read(ref.address)["context_tokens"],
                                  batch[0][1]["context_tokens"])


def test_checkpoint_save_on_full_disk_leaves_no_file(small_volume):
    volume, _ = small_volume
    store = CheckpointStore(str(volume / "checkpoints"))
    small = store.save(0, {"w": torch.zeros(16)})
    with pytest.raises(StorageFull) as info:
        store.save(1, {"w": torch.randn(512 * 1024)})  # 2 MiB on a 1 MiB volume
    assert str(volume / "checkpoints") in str(info.value)
    assert "learner.checkpoints" in str(info.value)
    assert [p.name for p in (volume / "checkpoints").iterdir()] == [
        small.address.rsplit("/", 1)[-1]]  # no temp file, no partial v1
    assert [r.version for r in store.list()] == [0]


def _steps(n_traj: int, n_steps: int) -> list[TrajectoryStep]:
    rng = np.random.default_rng(1)
    return [TrajectoryStep(
        event_id=event_id("s", t, i), run_id="full", producer="test", key=f"traj{t}",
        trajectory_id=f"traj{t}", task_id="task", step_index=i, policy_version=0,
        context_tokens=rng.integers(0, 50_000, 400).tolist(), action_tokens=[1],
        action_logprobs=[-0.5], done=i == n_steps - 1)
        for t in range(n_traj) for i in range(n_steps)]


async def _run_segmenter(scratch_bus, store: Path, timeout: float = 30) -> None:
    """Run a segmenter until it has committed every step (or it crashes: raised here)."""
    actor = Segmenter(SegmenterConfig(write_delay_s=0.0), str(store), "full")
    runner = scratch_bus.runner(actor, run_id="full")

    async def stored_all() -> bool:
        return await scratch_bus.bus.lag(runner.group, actor.consumes) == 0

    await run_until(runner, stored_all, timeout)


async def test_segmenter_on_full_disk_stops_without_committing_then_resumes(small_volume,
                                                                            scratch_bus):
    volume, _ = small_volume
    bus = scratch_bus.bus  # the bus is on a normal disk (the test's folder)
    steps = _steps(4, 8)
    await scratch_bus.publish(TRAJECTORY_STEP, *steps)
    SegmentStore(str(volume / "segments.zarr"))  # create the store, then fill the disk
    filler = fill(volume, leave_bytes=8 * 1024)

    with pytest.raises(StorageFull) as error:  # the segmenter crashes, for its supervisor
        await _run_segmenter(scratch_bus, volume / "segments.zarr")
    assert "segmenter.store" in str(error.value)
    committed = await bus.committed("full.segmenter", TRAJECTORY_STEP)
    announced = await read_topics(bus, [SEGMENT_CLOSED])
    assert committed.get(0, 0) == 0 and announced == []  # nothing committed or announced
    assert SegmentStore(str(volume / "segments.zarr"), read_only=True).list_segments() == []

    filler.unlink()  # space freed: a restarted segmenter stores and announces everything
    await _run_segmenter(scratch_bus, volume / "segments.zarr")
    committed = await bus.committed("full.segmenter", TRAJECTORY_STEP)
    segments = await scratch_bus.events(SEGMENT_CLOSED)
    assert committed[0] == len(steps)
    assert all(isinstance(s, SegmentClosed) for s in segments)
    covered = sorted((s.trajectory_id, i) for s in segments
                     for i in range(s.step_start, s.step_end))
    assert covered == sorted((s.trajectory_id, s.step_index) for s in steps)
