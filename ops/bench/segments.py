"""Segment store throughput: ``python ops/bench/segments.py [--n 10000]``.

Writes and reads ``n`` segments of 32 steps with a 64-token context (the shape the
segmenter produces), in batches through ``SegmentStore.write_many`` / ``read_many`` (as the
segmenter writes one batch per input batch) and one at a time, and prints segments per
second, bytes on disk and file count as one JSON line.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
from _common import print_result, scratch_dir

from gyre_async.storage.segments import SegmentStore


def synthetic_segment(rng: np.random.Generator, steps: int = 32, context: int = 64,
                      actions: int = 16) -> dict[str, np.ndarray]:
    return {
        "context_tokens": rng.integers(0, 50_000, (steps, context), dtype=np.int32),
        "context_len": np.full(steps, context, np.int32),
        "action_tokens": rng.integers(0, 50_000, (steps, actions), dtype=np.int32),
        "action_logprobs": -rng.random((steps, actions), dtype=np.float32),
        "action_mask": np.ones((steps, actions), np.bool_),
        "policy_version": np.full(steps, 7, np.int32),
        "feedback": rng.standard_normal(steps).astype(np.float32),
        "step_index": np.arange(steps, dtype=np.int64),
    }


def run_benchmark(root: str, n: int = 10_000, batch: int = 250, singles: int = 200,
                  durable: bool = True) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    segments = [(f"traj-{i // 8}/seg-{i % 8}", synthetic_segment(rng)) for i in range(n)]
    store = SegmentStore(os.path.join(root, "segments"), durable=durable)
    t0 = time.perf_counter()
    refs = [r for j in range(0, n, batch) for r in store.write_many(segments[j:j + batch])]
    t1 = time.perf_counter()
    reader = SegmentStore(os.path.join(root, "segments"), read_only=True)  # a fresh process' view
    for j in range(0, n, batch):
        reader.read_many([r.address for r in refs[j:j + batch]])
    t2 = time.perf_counter()
    single_refs = [store.write(f"single-{i}", synthetic_segment(rng)) for i in range(singles)]
    t3 = time.perf_counter()
    for ref in single_refs:
        reader.read(ref.address)
    t4 = time.perf_counter()
    files = sum(len(fs) for _, _, fs in os.walk(os.path.join(root, "segments")))
    return {
        "segments": n, "batch": batch, "durable": durable,
        "batched_write_per_s": round(n / (t1 - t0)),
        "batched_read_verified_per_s": round(n / (t2 - t1)),
        "batched_write_plus_read_per_s": round(n / (t2 - t0)),
        "single_write_per_s": round(singles / (t3 - t2)),
        "single_read_verified_per_s": round(singles / (t4 - t3)),
        "disk_mib": round(store.disk_bytes() / 2**20, 1),
        "raw_mib": round(sum(a.nbytes for _, s in segments for a in s.values()) / 2**20, 1),
        "files": files,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=250)
    parser.add_argument("--singles", type=int, default=200)
    parser.add_argument("--no-fsync", action="store_true")
    args = parser.parse_args()
    with scratch_dir("gyre-bench-") as root:
        result = run_benchmark(root, args.n, args.batch, args.singles, not args.no_fsync)
    print_result(result)


if __name__ == "__main__":
    main()
