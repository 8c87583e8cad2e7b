"""Checkpoint store: policy weights as safetensors files, content-addressed, never pickled.

Layout: one flat folder (local path, ``file://`` or an fsspec URL)::

    v<version:012d>-<sha256 of the file>.safetensors

Files are serialised here, deterministically (sorted header keys, tensors in name order),
because the safetensors library orders metadata keys by a randomised hash map, and the
same checkpoint must give the same bytes and sha256. They load with the library as usual.

The name carries the version and the file's full sha256, so a file is never overwritten
with different bytes: saving the same tensors again finds the same file (idempotent), and a
re-trained version after a crash gets a new name instead of clobbering one that may already
have been published. Local saves go through :func:`~gyre_async.storage.atomic.atomic_writer`
(temporary file in the same folder, fsync, rename, fsync of the folder); the sha256 that
names the file is computed by serialising once into a hash before the file is written, so
an existing file is found without writing anything. The address is returned only after that;
the caller publishes it (``policy-version``) and readers load by address + expected hash.
Safetensors only: loading a checkpoint can never run code.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import msgspec
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from gyre_async.faultpoints import pause_point
from gyre_async.storage.atomic import atomic_writer
from gyre_async.storage.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFinite,
    as_storage_full,
)
from gyre_async.storage.roots import CHECKPOINT_NAME, checkpoint_in
from gyre_async.storage.urls import fsync_dir, normalize_store_url

__all__ = ["CheckpointCorrupt", "CheckpointError", "CheckpointNotFinite", "CheckpointRef",
           "CheckpointStore", "check_finite", "load_checkpoint"]

VERSION_KEY = "gyre.version"  # stored in the file's metadata, stripped on load
_NAME_RE = CHECKPOINT_NAME
_BLOCK = 1 << 20
_MAX_HEADER = 100 << 20  # the safetensors library refuses larger headers too
_CORRUPT_FIX = ("fix: the file changed after it was published; restore it from a copy, or "
                "roll back to an intact version")
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class CheckpointRef(msgspec.Struct, frozen=True):
    """What a ``policy-version`` event carries about the weights."""

    address: str
    sha256: str
    version: int


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


class _Writable(Protocol):
    def write(self, data: bytes | memoryview, /) -> int: ...


class _Sha256Sink:
    """A write-only file that only hashes what is written to it."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        self._hash.update(data)
        return len(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _write_safetensors(f: _Writable, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """The safetensors format: u64 little-endian header size, JSON header (padded with
    spaces to 8 bytes), then the tensors' little-endian bytes back to back."""
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for name in sorted(tensors):
        f.write(tensors[name].reshape(-1).view(torch.uint8).numpy().data)


def _prepare(
    version: int, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"checkpoint version must be an int >= 0, got {version!r}")
    meta = dict(metadata or {})
    if VERSION_KEY in meta:
        raise ValueError(f"metadata key {VERSION_KEY!r} is reserved")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("checkpoint metadata must map str to str")
    meta[VERSION_KEY] = str(version)
    flat = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return flat, dict(sorted(meta.items()))


def load_checkpoint(address: str, expected_sha256: str
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of the checkpoint at ``address`` (resolved by the caller: see
    :mod:`gyre_async.storage.roots`), after checking the file's sha256 (CheckpointCorrupt
    names the file and both hashes) and that every weight is finite (CheckpointNotFinite
    names the tensor). Creates nothing: no store is opened, no folder made."""
    url, local = normalize_store_url(address)
    if local is None:
        tensors, meta = _load_remote(url, expected_sha256)
    else:
        tensors, meta = _load_local(local, expected_sha256)
    meta.pop(VERSION_KEY, None)
    check_finite(tensors, url)
    return tensors, meta


def _load_local(local: Path, expected: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        actual = _sha256_file(local)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {local} does not exist") from None
    if actual != expected:
        raise CheckpointCorrupt(
            f"checkpoint {local}: sha256 {actual} does not match expected "
            f"{expected}; {_CORRUPT_FIX}")
    try:
        with safe_open(str(local), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:
        raise CheckpointCorrupt(f"checkpoint {local} is not a valid safetensors file: {exc}") from exc
    return tensors, meta


def _load_remote(url: str, expected: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    data = fs.cat_file(path)
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise CheckpointCorrupt(f"checkpoint {url}: sha256 {actual} does not match expected {expected}")
    try:
        header_len = int.from_bytes(data[:8], "little")
        meta = dict(json.loads(data[8:8 + header_len]).get("__metadata__") or {})
        tensors = st_load(data)
    except Exception as exc:
        raise CheckpointCorrupt(f"checkpoint {url} is not a valid safetensors file: {exc}") from exc
    return tensors, meta


def check_finite(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """CheckpointNotFinite naming the first tensor (in name order) holding NaN or inf:
    weights like that would make every action and every update NaN."""
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            continue
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            t = t.float()  # float8: isfinite is not defined for it everywhere
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad = int(finite.numel() - int(finite.sum()))
            raise CheckpointNotFinite(
                f"checkpoint {where}: tensor {name!r} holds NaN or inf ({bad} of "
                f"{t.numel()} values); refusing to load it. Fix: roll back to an earlier "
                "version (the keeper's slots), or lower learner.learning_rate and retrain")


class CheckpointStore:
    """Saves and loads versioned weight files under ``url``; see the module docstring."""

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.url, self._root = normalize_store_url(url)
        self._fs: Any = None
        if self._root is not None:
            self._root.mkdir(parents=True, exist_ok=True)
        else:
            from fsspec.core import url_to_fs

            self._fs, self._remote_root = url_to_fs(self.url, **(storage_options or {}))
            self._fs.makedirs(self._remote_root, exist_ok=True)

    def save(
        self,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
    ) -> CheckpointRef:
        """Write the tensors (moved to CPU) and str metadata; return the ref once durable.

        Tensors sharing memory (tied weights) are stored as separate copies.
        """
        flat, meta = _prepare(version, tensors, metadata)
        if self._root is None:
            buf = io.BytesIO()
            _write_safetensors(buf, flat, meta)
            data = buf.getvalue()
            sha = hashlib.sha256(data).hexdigest()
            name = f"v{version:012d}-{sha}.safetensors"
            self._fs.pipe_file(f"{self._remote_root}/{name}", data)
            return CheckpointRef(f"{self.url}/{name}", sha, version)
        digest = _Sha256Sink()  # the name holds the sha256: serialise once to learn it
        _write_safetensors(digest, flat, meta)
        sha = digest.hexdigest()
        final = self._root / f"v{version:012d}-{sha}.safetensors"
        if final.exists():  # same name, same sha256: the same bytes are already there
            return CheckpointRef(f"{self.url}/{final.name}", sha, version)
        try:
            with atomic_writer(final, "wb") as f:
                _write_safetensors(f, flat, meta)
                f.flush()
                pause_point("checkpoint-save")  # temp file written, not renamed (ops/chaos.py)
        except BaseException as exc:
            full = as_storage_full(exc, f"checkpoint v{version} to {self._root}",
                                   "learner.checkpoints")
            if full is not None:
                raise full from exc
            raise
        return CheckpointRef(f"{self.url}/{final.name}", sha, version)

    def load(
        self, address: str, expected_sha256: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Tensors and metadata of the checkpoint at ``address`` in this store
        (UntrustedAddress for one elsewhere); see :func:`load_checkpoint`."""
        return load_checkpoint(checkpoint_in(self.url, normalize_store_url(address)[0]),
                               expected_sha256)

    def metadata(self, address: str) -> dict[str, str]:
        """The header metadata of the checkpoint at ``address`` in this store (tensors not
        read, sha256 not checked): enough to tell who wrote a file before removing it."""
        url, local = normalize_store_url(
            checkpoint_in(self.url, normalize_store_url(address)[0]))
        try:
            if local is not None:
                with safe_open(str(local), framework="pt") as f:
                    return dict(f.metadata() or {})
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(url)
            with fs.open(path, "rb") as remote:
                size = int.from_bytes(remote.read(8), "little")
                if size > _MAX_HEADER:
                    raise ValueError(f"header of {size} bytes")
                return dict(json.loads(remote.read(size)).get("__metadata__") or {})
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {url} does not exist") from None
        except Exception as exc:
            raise CheckpointCorrupt(f"checkpoint {url} has no readable header: {exc}") from exc

    def list(self) -> list[CheckpointRef]:
        """All checkpoints, by version, then by age for several files of one version."""
        if self._root is not None:
            found = [(p.name, p.stat().st_mtime) for p in self._root.iterdir()]
        else:
            found = [(info["name"].rsplit("/", 1)[-1], float(info.get("mtime") or 0))
                     for info in self._fs.ls(self._remote_root, detail=True)]
        refs = []
        for name, mtime in found:
            if m := _NAME_RE.match(name):
                version = int(m.group(1))
                refs.append((version, mtime, CheckpointRef(f"{self.url}/{name}", m.group(2), version)))
        return [ref for _, _, ref in sorted(refs, key=lambda r: (r[0], r[1], r[2].sha256))]

    def latest(self) -> CheckpointRef | None:
        """The highest version (the newest file if it was saved more than once), or None.

        For start-up and recovery only: the live source of truth is the ``policy-version``
        events, which name exactly one file per version."""
        refs = self.list()
        return refs[-1] if refs else None

    def delete(self, address: str) -> None:
        """Remove one checkpoint file (retention); a missing file is not an error."""
        url, local = normalize_store_url(
            checkpoint_in(self.url, normalize_store_url(address)[0]))
        if local is not None:
            local.unlink(missing_ok=True)
            fsync_dir(local.parent)
            return
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(url)
        if fs.exists(path):
            fs.rm_file(path)
