"""Checkpoint store: round trips, idempotence, corruption, atomicity, other processes; and
policies through it (save_weights / load_weights), refusing a checkpoint of another model."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from gyre_async.policy.base import CheckpointMismatch
from gyre_async.policy.factory import load_weights, save_weights
from gyre_async.policy.tokenizer import ByteTokenizer
from gyre_async.policy.torch_policy import ModelConfig, TorchPolicy
from gyre_async.storage.checkpoints import CheckpointStore
from gyre_async.storage.errors import CheckpointCorrupt, CheckpointError

ROOT = Path(__file__).resolve().parents[1]


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(32, 8, generator=g),
        "head.weight": torch.randn(8, 32, generator=g).to(torch.bfloat16),
        "head.bias": torch.zeros(32, dtype=torch.float16),
        "step": torch.tensor(seed, dtype=torch.int64),
        "transposed": torch.randn(4, 6, generator=g).t(),  # non-contiguous input
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        assert torch.equal(got[name], w), name


def test_round_trip(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    w = weights(1)
    ref = store.save(7, w, {"parent": "6", "why": "update"})
    path = Path(ref.address.removeprefix("file://"))
    assert path.name == f"v{7:012d}-{ref.sha256}.safetensors"
    assert ref.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert ref.version == 7
    tensors, meta = store.load(ref.address, ref.sha256)
    assert_same(tensors, w)
    assert meta == {"parent": "6", "why": "update"}
    # A plain path and another store instance load the same address.
    assert_same(CheckpointStore(f"file://{tmp_path / 'ckpt'}").load(str(path), ref.sha256)[0], w)


def test_tied_weights_are_saved_as_copies(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    shared = torch.arange(4.0)
    ref = store.save(1, {"embed": shared, "unembed": shared})
    tensors, _ = store.load(ref.address, ref.sha256)
    assert torch.equal(tensors["embed"], shared) and torch.equal(tensors["unembed"], shared)


def test_bytes_are_deterministic_across_processes(tmp_path):
    meta = {k: k for k in "qwertyuiop"}
    code = (
        "import sys; sys.path.insert(0, sys.argv[2]); from test_checkpoints import weights;"
        "from gyre_async.storage.checkpoints import CheckpointStore;"
        f"print(CheckpointStore(sys.argv[1]).save(5, weights(3), {meta!r}).sha256)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path / "other"), str(ROOT / "tests")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True)
    here = CheckpointStore(str(tmp_path / "here")).save(5, weights(3), meta)
    assert here.sha256 == other.stdout.strip()


def test_save_is_idempotent_and_never_overwrites(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    first = store.save(3, weights(1), {"a": "b"})
    assert store.save(3, weights(1), {"a": "b"}) == first
    # A re-trained version 3 (different bytes) gets its own file; the first stays intact.
    second = store.save(3, weights(2), {"a": "b"})
    assert second.address != first.address
    assert_same(store.load(first.address, first.sha256)[0], weights(1))
    assert [r.address for r in store.list()] == [first.address, second.address]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(  # no temporaries
        r.address.rsplit("/", 1)[-1] for r in (first, second))


def test_latest_and_list(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    assert store.latest() is None and store.list() == []
    refs = [store.save(v, weights(v)) for v in (2, 10, 1)]
    assert [r.version for r in store.list()] == [1, 2, 10]
    assert store.latest() == refs[1]
    (tmp_path / "ckpt" / "notes.txt").write_text("ignored")
    store.delete(refs[1].address)
    assert store.latest() == refs[0]
    store.delete(refs[1].address)  # already gone: fine


def test_corrupted_file_is_detected(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    ref = store.save(1, weights(1))
    path = Path(ref.address.removeprefix("file://"))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt) as err:
        store.load(ref.address, ref.sha256)
    message = str(err.value)
    assert str(path) in message and ref.sha256 in message
    assert hashlib.sha256(bytes(data)).hexdigest() in message


def test_wrong_expected_hash_and_missing_file(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    ref = store.save(1, weights(1))
    with pytest.raises(CheckpointCorrupt, match="does not match expected 0{64}"):
        store.load(ref.address, "0" * 64)
    store.delete(ref.address)
    with pytest.raises(CheckpointError, match="does not exist"):
        store.load(ref.address, ref.sha256)


def test_failed_save_leaves_nothing(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="safetensors code"):
        store.save(1, {"ok": torch.zeros(3), "z": torch.zeros(2, dtype=torch.complex64)})
    assert list((tmp_path / "ckpt").iterdir()) == []
    with pytest.raises(ValueError, match="reserved"):
        store.save(1, weights(1), {"gyre.version": "9"})
    with pytest.raises(ValueError, match="version"):
        store.save(-1, weights(1))


LOADER = """
import sys, torch
from gyre_async.storage.checkpoints import CheckpointStore
tensors, meta = CheckpointStore(sys.argv[1]).load(sys.argv[2], sys.argv[3])
print(meta["why"], float(tensors["embed.weight"].double().sum()))
"""


def test_load_in_another_process(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    w = weights(4)
    ref = store.save(4, w, {"why": "rollback"})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", LOADER, store.url, ref.address, ref.sha256],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    why, total = proc.stdout.split()
    assert why == "rollback"
    assert float(total) == pytest.approx(float(w["embed.weight"].double().sum()))


# -- policies through the store: the live load path (learner restart/rollback, samplers) ----

def tiny_policy(seed: int = 0, **overrides) -> TorchPolicy:
    shape = {"d_model": 16, "n_heads": 2, "max_len": 32, **overrides}
    config = ModelConfig(vocab_size=ByteTokenizer.vocab_size, **shape)
    return TorchPolicy(config, ByteTokenizer(), seed=seed)


def test_policy_weights_round_trip_and_record_the_model_config(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    policy = tiny_policy(seed=1)
    ref = save_weights(store, policy, 3, {"why": "update"})
    _, meta = store.load(ref.address, ref.sha256)
    assert msgspec.json.decode(meta["model_config"], type=ModelConfig) == policy.config
    assert meta["format"] == "gyre-torch-policy" and meta["why"] == "update"
    other = tiny_policy(seed=2)
    assert not torch.equal(other.state_dict()["tok_emb.weight"], policy.state_dict()["tok_emb.weight"])
    load_weights(other, ref.address, ref.sha256)
    assert_same(other.state_dict(), policy.state_dict())


def test_a_checkpoint_of_another_model_config_is_refused_naming_both(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    ref = save_weights(store, tiny_policy(d_model=32), 1)
    with pytest.raises(CheckpointMismatch) as err:
        load_weights(tiny_policy(), ref.address, ref.sha256)
    message = str(err.value)
    assert ref.address in message
    assert '"d_model":32' in message and '"d_model":16' in message  # theirs and mine


def test_another_format_or_a_header_without_config_that_does_not_fit_is_refused(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    tensors = tiny_policy().state_dict()
    foreign = store.save(1, tensors, {"format": "gyre-hf-policy"})
    with pytest.raises(CheckpointMismatch, match="gyre-hf-policy"):
        load_weights(tiny_policy(), foreign.address, foreign.sha256)
    newer = store.save(3, tensors, {"model_config": '{"vocab_size": 264, "wings": 2}'})
    with pytest.raises(CheckpointMismatch, match="wings"):  # a config this code cannot read
        load_weights(tiny_policy(), newer.address, newer.sha256)
    # A header that records no model config (a plain tensor copy) is checked by shape.
    small = store.save(2, tiny_policy(d_model=32).state_dict(), {"why": "copy"})
    with pytest.raises(CheckpointMismatch, match="does not fit this policy"):
        load_weights(tiny_policy(), small.address, small.sha256)
    with pytest.raises(CheckpointCorrupt):  # the hash is still checked first
        load_weights(tiny_policy(), small.address, "0" * 64)
