"""How a segment's arrays map onto rows of the store's shared Zarr arrays. Pure functions.

Every named array of a segment becomes a run of rows (its first dimension; a 0-d array is
one row) in the shared array for its (name, dtype, trailing-shape bucket). Trailing
dimensions are zero-padded up to the next power of two so that, say, contexts of width 60
and 64 share ``arrays/context_tokens/int32_64``; the true shape lives in the index.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import numpy as np

from gyre_async.storage.segment_index import Placement


def bucket(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def as_rows(a: np.ndarray) -> np.ndarray:
    """The stored form of ``a``: at least 1-d, trailing dims zero-padded to their bucket."""
    rows = a.reshape(1) if a.ndim == 0 else a
    target = (rows.shape[0], *(bucket(d) for d in rows.shape[1:]))
    if target == rows.shape:
        return rows
    padded = np.zeros(target, dtype=rows.dtype)
    padded[tuple(slice(0, d) for d in rows.shape)] = rows
    return padded


def array_path(name: str, rows: np.ndarray) -> str:
    """``arrays/<name>/<dtype>[_<d1>x<d2>...]`` for rows in stored form."""
    dims = "x".join(map(str, rows.shape[1:]))
    return f"arrays/{name}/{rows.dtype.name}" + (f"_{dims}" if dims else "")


def from_rows(block: np.ndarray | None, p: Placement) -> np.ndarray:
    """Undo :func:`as_rows` on the rows read back for placement ``p`` (``block`` is None
    for a placement of no rows: nothing is stored, so nothing is read)."""
    dtype = np.dtype(p.dtype)
    if p.rows == 0:
        return np.zeros(p.shape, dtype=dtype)
    assert block is not None, f"placement {p.name!r} has {p.rows} rows, so they were read"
    if not p.shape:
        out = block.reshape(())
    else:
        out = block[(slice(None), *(slice(0, d) for d in p.shape[1:]))]
    out = out.astype(dtype, copy=False)
    return out if out.flags.c_contiguous else out.copy(order="C")


def coalesce(
    wanted: Iterable[tuple[int, int, object]], gap: int
) -> list[tuple[int, int, list[tuple[int, int, object]]]]:
    """Group row ranges ``(start, stop, tag)`` into spans ``(lo, hi, members)`` read at once:
    ranges closer than ``gap`` rows (one chunk) share a span, as they likely share chunks."""
    spans: list[tuple[int, int, list[tuple[int, int, object]]]] = []
    for start, stop, tag in sorted(wanted, key=lambda w: (w[0], w[1])):
        if spans and start <= spans[-1][1] + gap:
            lo, hi, members = spans[-1]
            members.append((start, stop, tag))
            spans[-1] = (lo, max(hi, stop), members)
        else:
            spans.append((start, stop, [(start, stop, tag)]))
    return spans


def dead_chunks(
    dead: Iterable[tuple[int, int]],
    live: Iterable[tuple[int, int]],
    rows_per_chunk: int,
    cursor: int,
) -> list[int]:
    """Chunk indices touched by the ``dead`` row ranges that hold no ``live`` row and lie
    wholly below ``cursor`` (rows at or past it may still be appended to)."""
    spans = sorted((s, e) for s, e in live if e > s)
    starts = [s for s, _ in spans]
    r = rows_per_chunk
    out = []
    for c in sorted({c for s, e in dead if e > s for c in range(s // r, (e - 1) // r + 1)}):
        lo, hi = c * r, (c + 1) * r
        k = bisect.bisect_left(starts, hi) - 1  # last live span starting before hi
        if hi <= cursor and not (k >= 0 and spans[k][1] > lo):
            out.append(c)
    return out
