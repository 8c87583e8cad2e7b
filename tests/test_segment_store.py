"""Segment store: round trips, idempotence, corruption, crashes, retention, other processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gyre_async.storage import (
    SegmentConflict,
    SegmentCorrupt,
    SegmentNotFound,
    SegmentStore,
    SegmentStoreError,
)
from gyre_async.storage.index_log import IndexLog
from gyre_async.storage.segment_index import IndexPage, canonical_arrays, content_hash
from gyre_async.storage.segment_rows import coalesce, dead_chunks

ROOT = Path(__file__).resolve().parents[1]


def make_segment(segment_id: str, steps: int | None = None, context: int = 64) -> dict[str, np.ndarray]:
    """Deterministic content from the id, so another process can check what it reads."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(segment_id.encode()).digest()[:8], "little"))
    s = int(rng.integers(1, 40)) if steps is None else steps
    return {
        "context_tokens": rng.integers(0, 50_000, (s, context), dtype=np.int32),
        "context_len": rng.integers(1, context + 1, s, dtype=np.int32),
        "action_tokens": rng.integers(0, 50_000, (s, 16), dtype=np.int32),
        "action_logprobs": -rng.random((s, 16), dtype=np.float32),
        "action_mask": rng.random((s, 16)) < 0.8,
        "policy_version": np.full(s, 3, np.int32),
        "feedback": rng.standard_normal(s).astype(np.float32),
        "step_index": np.arange(100, 100 + s, dtype=np.int64),
        "bootstrap_context": rng.integers(0, 50_000, context, dtype=np.int32),
        "terminal": np.bool_(rng.random() < 0.5),
    }


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        w = np.asarray(w)
        assert got[name].dtype == w.dtype.newbyteorder("<") or got[name].dtype == w.dtype, name
        assert got[name].shape == w.shape, name
        assert np.array_equal(got[name], w), name


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_round_trip_and_address(tmp_path):
    store = SegmentStore(str(tmp_path / "seg"))
    seg = make_segment("traj-1/seg-0")
    ref = store.write("traj-1/seg-0", seg)
    assert ref.address == f"file://{tmp_path / 'seg'}#traj-1/seg-0"
    assert ref.content_hash == content_hash(canonical_arrays(seg))
    assert_same(store.read(ref.address), seg)
    assert store.contains("traj-1/seg-0") and not store.contains("nope")
    assert store.list_segments() == ["traj-1/seg-0"]
    # The same store opened through a file:// URL reads the same address.
    assert_same(SegmentStore(f"file://{tmp_path / 'seg'}", read_only=True).read(ref.address), seg)
    with pytest.raises(ValueError, match="does not belong"):
        store.read("file:///elsewhere#traj-1/seg-0")
    with pytest.raises(SegmentNotFound):
        store.read(store.address("never-written"))
    with pytest.raises(ValueError, match="bad segment id"):
        store.write("has#hash", seg)


def test_odd_shapes_and_dtypes_round_trip(tmp_path):
    store = SegmentStore(str(tmp_path / "seg"), chunk_bytes=4096)
    segs = {
        "empty": {"x": np.zeros((0, 5), np.float32), "y": np.zeros(0, np.int64)},
        "scalars": {"a": np.float64(2.5), "b": np.int8(-3), "c": np.uint16(7)},
        "big-endian": {"x": np.arange(6, dtype=">i4").reshape(3, 2)},
        "3d": {"x": np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)},
        "non-contiguous": {"x": np.arange(40, dtype=np.int32).reshape(4, 10)[:, ::3]},
        "width-60": make_segment("w60", context=60),
        "width-65": make_segment("w65", context=65),
    }
    refs = {sid: store.write(sid, arrays) for sid, arrays in segs.items()}
    for sid, arrays in segs.items():
        assert_same(store.read(refs[sid].address), arrays)
    # Widths 60 and 64 share the 64-wide array; 65 goes to the 128 bucket.
    made = {p.name for p in (tmp_path / "seg" / "arrays" / "context_tokens").iterdir()}
    assert made == {"int32_64", "int32_128", "zarr.json"}
    with pytest.raises(ValueError, match="dtype"):
        store.write("strings", {"x": np.array(["a", "b"])})


def test_idempotent_rewrite_and_conflict(tmp_path):
    store = SegmentStore(str(tmp_path / "seg"))
    seg = make_segment("s")
    ref = store.write("s", seg)
    before = store.disk_bytes()
    assert store.write("s", {k: np.copy(v) for k, v in seg.items()}) == ref
    assert store.write_many([("s", seg), ("s", seg)]) == [ref, ref]
    assert store.disk_bytes() == before  # nothing stored twice
    changed = dict(seg, feedback=seg["feedback"] + 1)
    with pytest.raises(SegmentConflict, match="'s'"):
        store.write("s", changed)
    # A conflicting item stops the whole batch before anything is written.
    with pytest.raises(SegmentConflict):
        store.write_many([("t", make_segment("t")), ("s", changed)])
    assert not store.contains("t")
    assert store.disk_bytes() == before
    # A restarted writer (new instance) is just as idempotent.
    assert SegmentStore(str(tmp_path / "seg")).write("s", seg) == ref


def _corrupt_setup(tmp_path):
    store = SegmentStore(str(tmp_path / "seg"), chunk_bytes=1024)
    refs = store.write_many([(f"s{i}", make_segment(f"s{i}", steps=8)) for i in range(3)])
    chunk_dir = tmp_path / "seg" / "arrays" / "feedback" / "float32" / "c"
    return store, refs, sorted(chunk_dir.iterdir())[0]  # rows 0..255: all three segments


def test_garbage_chunk_is_reported_naming_the_segment(tmp_path):
    store, refs, chunk = _corrupt_setup(tmp_path)
    chunk.write_bytes(b"\x00garbage" * 10)
    reader = SegmentStore(str(tmp_path / "seg"), read_only=True)
    with pytest.raises(SegmentCorrupt, match="segment 's0'.*unreadable"):
        reader.read(refs[0].address)
    with pytest.raises(SegmentCorrupt, match="segment 's0'"):
        reader.read_many([r.address for r in refs])


def test_wrong_but_decodable_data_fails_the_hash(tmp_path):
    store, refs, _ = _corrupt_setup(tmp_path)
    arr = zarr.open_array(str(tmp_path / "seg"), path="arrays/feedback/float32", mode="r+")
    arr[8:9] = np.float32(123.0)  # first row of s1, rewritten with valid codecs
    with pytest.raises(SegmentCorrupt, match="segment 's1'.*content hash"):
        store.read(refs[1].address)
    assert_same(store.read(refs[0].address), make_segment("s0", steps=8))
    assert store.read(refs[1].address, verify=False)["feedback"][0] == 123.0


def test_missing_chunk_fails_the_hash(tmp_path):
    store, refs, chunk = _corrupt_setup(tmp_path)
    chunk.unlink()
    with pytest.raises(SegmentCorrupt, match="segment 's2'"):
        store.read(refs[2].address)


def test_crash_between_data_and_index_leaves_nothing_visible(tmp_path, monkeypatch):
    url = str(tmp_path / "seg")
    store = SegmentStore(url)
    store.write("before", make_segment("before"))

    def crash(page):
        raise KeyboardInterrupt("power cut after the data, before the index page")

    monkeypatch.setattr(store._log, "append", crash)
    with pytest.raises(KeyboardInterrupt):
        store.write("lost", make_segment("lost"))
    restarted = SegmentStore(url)  # the writer process comes back
    assert restarted.list_segments() == ["before"]
    assert not SegmentStore(url, read_only=True).contains("lost")
    # The orphaned rows are simply reused.
    ref = restarted.write("after", make_segment("after"))
    assert_same(restarted.read(ref.address), make_segment("after"))
    assert_same(restarted.read(restarted.address("before")), make_segment("before"))


def test_second_writer_is_detected(tmp_path):
    store = SegmentStore(str(tmp_path / "seg"))
    a = IndexLog(store._store, store.url, None, durable=False)
    b = IndexLog(store._store, store.url, None, durable=False)
    a.append(IndexPage(1, deleted=("x",)))
    with pytest.raises(SegmentStoreError, match="one writer"):
        b.append(IndexPage(1, deleted=("y",)))


def test_delete_reclaims_whole_chunks(tmp_path):
    url = str(tmp_path / "seg")
    store = SegmentStore(url, chunk_bytes=2048)
    ids = [f"s{i:02d}" for i in range(12)]
    for sid in ids:  # one page each, rows shared across chunk boundaries
        store.write(sid, make_segment(sid, steps=10))
    stale = SegmentStore(url, read_only=True)
    stale.read_many([stale.address(s) for s in ids])  # caches the index
    before = store.disk_bytes()
    assert store.delete(ids[:8] + ["unknown"]) == 8
    assert store.delete(ids[:8]) == 0
    assert store.disk_bytes() < before
    assert store.list_segments() == ids[8:]
    for sid in ids[8:]:
        assert_same(stale.read(stale.address(sid)), make_segment(sid, steps=10))
    with pytest.raises(SegmentNotFound):
        store.read(store.address("s00"))
    with pytest.raises(SegmentNotFound):  # a reader with the old index, chunk gone
        stale.read(stale.address("s00"))
    ref = store.write("s00", make_segment("s00", steps=10))  # an id may come back later
    assert_same(stale.read(ref.address), make_segment("s00", steps=10))


def test_compact_index_keeps_readers_working(tmp_path):
    url = str(tmp_path / "seg")
    store = SegmentStore(url)
    for i in range(3):
        store.write(f"s{i}", make_segment(f"s{i}", steps=4))
    stale = SegmentStore(url, read_only=True)  # has applied pages 1..3
    for i in range(3, 5):
        store.write(f"s{i}", make_segment(f"s{i}", steps=4))
    assert store.compact_index() == 5
    assert sorted(p.name for p in (tmp_path / "seg" / "index").iterdir()) == ["snapshot-000000000005.json"]
    store.write("s5", make_segment("s5", steps=4))  # page 6, after the snapshot
    assert_same(stale.read(stale.address("s4")), make_segment("s4", steps=4))  # page 4 is gone
    assert SegmentStore(url, read_only=True).list_segments() == [f"s{i}" for i in range(6)]
    assert stale.list_segments() == [f"s{i}" for i in range(6)]


def test_coalesce_and_dead_chunks():
    spans = coalesce([(20, 30, "b"), (0, 10, "a"), (100, 110, "c")], gap=10)
    assert [(lo, hi, [t for *_, t in m]) for lo, hi, m in spans] == [(0, 30, ["a", "b"]), (100, 110, ["c"])]
    # Chunks of 10 rows; dead rows 0..25, live 25..30, cursor 40:
    #   chunk 0 (0..10) and 1 (10..20) only dead -> reclaim; chunk 2 (20..30) holds live rows.
    assert dead_chunks([(0, 25)], [(25, 30)], 10, 40) == [0, 1]
    # Cursor 15: chunk 1 ends at 20 > 15 and may still be appended to -> keep.
    assert dead_chunks([(0, 15)], [], 10, 15) == [0]


ARRAYS = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True),
    hnp.arrays(
        dtype=st.sampled_from([np.int32, np.int64, np.float32, np.bool_, np.uint8]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=7),
    ),
    min_size=1, max_size=4,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(ARRAYS, min_size=1, max_size=4))
def test_property_round_trip(tmp_path, batch):
    store = SegmentStore(str(tmp_path / "prop"), chunk_bytes=512, durable=False)
    base = len(store.list_segments())
    items = [(f"p{base + i}", arrays) for i, arrays in enumerate(batch)]
    refs = store.write_many(items)
    for (_sid, arrays), got in zip(items, store.read_many([r.address for r in refs])):
        for name, want in arrays.items():
            assert got[name].shape == want.shape and got[name].dtype == want.dtype
            assert np.array_equal(got[name], want, equal_nan=want.dtype.kind == "f")


READER = """
import json, sys
from gyre_async.storage.segments import SegmentStore
store = SegmentStore(sys.argv[1], read_only=True)
out = {}
for address in json.loads(sys.stdin.read()):
    arrays = store.read(address)
    out[address] = {k: [str(v.dtype), list(v.shape), v.tobytes().hex()] for k, v in arrays.items()}
print(json.dumps(out))
"""


def test_reader_in_another_process(tmp_path):
    store = SegmentStore(str(tmp_path / "seg"))
    refs = store.write_many([(f"s{i}", make_segment(f"s{i}")) for i in range(5)])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", READER, store.url], cwd=ROOT, env=env, text=True,
                          input=json.dumps([r.address for r in refs]), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    for i, ref in enumerate(refs):
        for name, want in make_segment(f"s{i}").items():
            want = np.asarray(want)
            assert seen[ref.address][name] == [str(want.dtype), list(want.shape), want.tobytes().hex()]


WRITER = """
import sys, numpy as np
sys.path.insert(0, sys.argv[2])
from test_segment_store import make_segment
from gyre_async.storage.segments import SegmentStore
store = SegmentStore(sys.argv[1], chunk_bytes=2048)
rng = np.random.default_rng(0)
n = 0
while n < 100:
    k = int(rng.integers(1, 6))
    store.write_many([(f"w{i}", make_segment(f"w{i}")) for i in range(n, n + k)])
    n += k
"""


def test_concurrent_read_while_writing_never_sees_partial_data(tmp_path):
    url = str(tmp_path / "seg")
    SegmentStore(url)  # create the store before the reader opens it
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, url, str(ROOT / "tests")], cwd=ROOT,
                              env=env, stderr=subprocess.PIPE, text=True)
    reader = SegmentStore(url, read_only=True)
    expected: dict[str, dict[str, np.ndarray]] = {}
    reads = 0
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            done = writer.poll() is not None
            listed = reader.list_segments()
            # New segments, plus the latest old ones: their tail chunks are being rewritten.
            ids = [s for s in listed if s not in expected] + [s for s in expected][-8:]
            for sid in ids:
                expected.setdefault(sid, make_segment(sid))
            for sid, got in zip(ids, reader.read_many([reader.address(s) for s in ids])):
                assert_same(got, expected[sid])
            reads += len(ids)
            if done:
                break
    finally:
        if writer.poll() is None:
            writer.kill()
        _, err = writer.communicate(timeout=30)
    assert writer.returncode == 0, err
    assert len(reader.list_segments()) >= 100
    assert reads > 100  # the reader did overlap with the writer


def test_throughput_smoke(tmp_path):
    """Batched writes and reads must run at hundreds-to-thousands of segments per second
    (full benchmark: python ops/bench/segments.py)."""
    store = SegmentStore(str(tmp_path / "seg"))
    segs = [(f"t{i}", make_segment(f"t{i}", steps=32)) for i in range(1000)]
    t0 = time.perf_counter()
    refs = [r for j in range(0, 1000, 200) for r in store.write_many(segs[j:j + 200])]
    t1 = time.perf_counter()
    for j in range(0, 1000, 200):
        store.read_many([r.address for r in refs[j:j + 200]])
    t2 = time.perf_counter()
    assert 1000 / (t1 - t0) > 150 and 1000 / (t2 - t1) > 150, (t1 - t0, t2 - t1)
