"""The segment store's index and content hash: pure data, no I/O.

The index is a sequence of immutable *pages* (``index/<seq:012d>.json``), each written
once, in order, by the single writer. A page adds segment entries (where each named array
of the segment lives: array path and first row), marks segments deleted, and records the
row cursor of every array it appended to. Replaying pages 1..n gives the index; a reader
catches up by fetching ``seq + 1`` until it is missing. A *snapshot*
(``index/snapshot-<seq:012d>.json``) folds pages 1..seq into one object so that old pages
can be removed (:meth:`SegmentStore.compact_index`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

import msgspec
import numpy as np

HASH_DOMAIN = b"gyre-segment-v1\0"
INDEX_PREFIX = "index/"
_PAGE_RE = re.compile(r"^index/(\d{12})\.json$")
_SNAPSHOT_RE = re.compile(r"^index/snapshot-(\d{12})\.json$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_SEGMENT_ID_RE = re.compile(r"^[^#\s\x00-\x1f\x7f]{1,512}$")
_ALLOWED_KINDS = "biuf"  # bool, signed/unsigned int, float


class Placement(msgspec.Struct, frozen=True, array_like=True):
    """Where one named array of a segment lives: rows ``start .. start + rows`` of
    ``array`` (a Zarr array path), with the segment's own shape and dtype."""

    name: str
    array: str
    start: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


class SegmentEntry(msgspec.Struct, frozen=True):
    segment_id: str
    content_hash: str
    placements: tuple[Placement, ...]


class IndexPage(msgspec.Struct, frozen=True):
    seq: int
    segments: tuple[SegmentEntry, ...] = ()
    deleted: tuple[str, ...] = ()
    cursors: dict[str, int] = {}


class IndexSnapshot(msgspec.Struct, frozen=True):
    through_seq: int
    segments: tuple[SegmentEntry, ...]
    cursors: dict[str, int]


_page_decoder = msgspec.json.Decoder(IndexPage)
_snapshot_decoder = msgspec.json.Decoder(IndexSnapshot)
encode = msgspec.json.Encoder().encode


def decode_page(raw: bytes) -> IndexPage:
    return _page_decoder.decode(raw)


def decode_snapshot(raw: bytes) -> IndexSnapshot:
    return _snapshot_decoder.decode(raw)


def page_key(seq: int) -> str:
    return f"{INDEX_PREFIX}{seq:012d}.json"


def snapshot_key(seq: int) -> str:
    return f"{INDEX_PREFIX}snapshot-{seq:012d}.json"


def parse_index_key(key: str) -> tuple[str, int] | None:
    """``("page", seq)`` or ``("snapshot", seq)`` for index keys, None for anything else
    (e.g. a writer's temporary file)."""
    if m := _PAGE_RE.match(key):
        return "page", int(m.group(1))
    if m := _SNAPSHOT_RE.match(key):
        return "snapshot", int(m.group(1))
    return None


class IndexState:
    """The index as replayed so far: live segments, array row cursors, last page applied.

    ``apply`` is idempotent per page, so two threads catching up concurrently are harmless.
    """

    def __init__(self) -> None:
        self.seq = 0
        self.live: dict[str, SegmentEntry] = {}
        self.cursors: dict[str, int] = {}

    def apply(self, page: IndexPage) -> None:
        for entry in page.segments:
            self.live[entry.segment_id] = entry
        for segment_id in page.deleted:
            self.live.pop(segment_id, None)
        for array, cursor in page.cursors.items():
            self.cursors[array] = max(cursor, self.cursors.get(array, 0))
        self.seq = max(self.seq, page.seq)

    def apply_snapshot(self, snapshot: IndexSnapshot) -> None:
        self.live = {e.segment_id: e for e in snapshot.segments}
        self.cursors = dict(snapshot.cursors)
        self.seq = snapshot.through_seq

    def snapshot(self) -> IndexSnapshot:
        return IndexSnapshot(self.seq, tuple(self.live.values()), dict(self.cursors))


def check_segment_id(segment_id: str) -> None:
    if not isinstance(segment_id, str) or not _SEGMENT_ID_RE.match(segment_id):
        raise ValueError(
            f"bad segment id {segment_id!r}: use 1-512 printable characters without '#' "
            "or whitespace ('#' separates store URL and segment id in addresses)"
        )


def canonical_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Validate names and dtypes; return C-contiguous little-endian arrays, sorted by name.

    This is the form that is hashed and stored, so a read returns exactly these dtypes.
    """
    if not arrays:
        raise ValueError("a segment needs at least one array")
    out: dict[str, np.ndarray] = {}
    for name in sorted(arrays):
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"bad array name {name!r}: use [A-Za-z0-9_.-], at most 128 chars")
        a = np.asarray(arrays[name])
        if a.dtype.kind not in _ALLOWED_KINDS:
            raise ValueError(
                f"array {name!r} has dtype {a.dtype}: only bool, integer and float arrays "
                "are stored (encode text as token ids)"
            )
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        out[name] = a if a.flags.c_contiguous else a.copy(order="C")
    return out


def content_hash(canonical: Mapping[str, np.ndarray]) -> str:
    """sha256 (hex) over names in sorted order, each as a length-prefixed header
    ``name NUL dtype.str NUL comma-joined shape`` followed by the array's raw C-order bytes.

    ``canonical`` must come from :func:`canonical_arrays`.
    """
    h = hashlib.sha256(HASH_DOMAIN)
    for name in sorted(canonical):
        a = canonical[name]
        header = f"{name}\0{a.dtype.str}\0{','.join(map(str, a.shape))}".encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()
