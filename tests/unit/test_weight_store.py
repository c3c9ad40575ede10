"""The weight store on a local path and on an fsspec filesystem (memory://, no network), its retention policy, and
the hash check of every load (rlstream.policy.weights)."""
from __future__ import annotations

import uuid

import pytest
import torch

from rlstream.policy.deltas import Content, folder_hash, write_folder
from rlstream.policy.weight_log import WeightLogReader
from rlstream.policy.weights import COMPLETE, PolicyWeights, WeightStore
from rlstream.schemas.records import PolicyVersion


def writer(version: int):
    def write(folder):
        content = Content({"w": torch.full((3,), float(version))}, {"w": "model.safetensors"},
                          {"config.json": b"{}", "sub/tokenizer.json": b"[]"})
        write_folder(content, folder)
        (folder / "optimizer.pt").write_bytes(b"trainer only")
    return write


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        return WeightStore(str(tmp_path / "weights"))
    return WeightStore(f"memory://bucket-{uuid.uuid4().hex[:8]}/weights")


def test_put_versions_prune_and_fetch(store, tmp_path):
    for v in range(8):
        uri = store.put("p", v, writer(v))
        assert uri == store.uri("p", v)
    assert store.versions("p") == list(range(8))
    # η = 2 at version 7 keeps 4.., plus version 0 and every 3rd for audit.
    removed = store.prune("p", keep_from=7 - 2 - 1, keep={0}, keep_every=3)
    assert removed == [1, 2] and store.versions("p") == [0, 3, 4, 5, 6, 7]
    folder = store.fetch("p", 6, tmp_path / "cache")
    assert folder_hash(folder) == folder_hash(store.fetch("p", 6, tmp_path / "cache2"))
    assert (folder / "sub" / "tokenizer.json").read_bytes() == b"[]"
    assert (folder / "model.safetensors").exists() and (folder / COMPLETE).exists()


def test_a_remote_version_without_its_marker_is_not_a_version(tmp_path):
    store = WeightStore(f"memory://bucket-{uuid.uuid4().hex[:8]}/w")
    store.put("p", 0, writer(0))
    store.put("p", 1, writer(1))
    store.fs.rm_file(f"{store._remote('p', 1)}/{COMPLETE}")  # as if the upload stopped before its end
    assert store.versions("p") == [0]
    weights = PolicyWeights(tmp_path / "cache")
    with pytest.raises(OSError, match="not a complete version"):
        weights.folder(PolicyVersion("p", 1, store.uri("p", 1), created_at=0, published_at=0))


def test_an_unknown_scheme_is_a_clear_error():
    with pytest.raises(ValueError, match="weight store"):
        WeightStore("nosuchfs://x/y")


def test_every_load_is_checked_against_the_announced_hash(store, tmp_path):
    store.put("p", 0, writer(0))
    store.put("p", 1, writer(1))
    right = folder_hash(store.fetch("p", 1, tmp_path / "c"))
    weights = PolicyWeights(tmp_path / "worker-cache")
    good = PolicyVersion("p", 1, store.uri("p", 1), created_at=0, published_at=0, content_hash=right)
    assert folder_hash(weights.folder(good)) == right
    bad = PolicyVersion("p", 0, store.uri("p", 0), created_at=0, published_at=0, content_hash=right)
    with pytest.raises(ValueError, match="refused"):
        weights.folder(bad)
    log_uri = PolicyVersion("p", 2, "kafka:weights?policy=p&version=2", created_at=0, published_at=0)
    with pytest.raises(OSError, match="no broker"):
        weights.folder(log_uri)


def test_a_garbled_log_uri_is_refused_with_its_reason_and_nothing_read(tmp_path):
    reader = WeightLogReader({"bootstrap.servers": "127.0.0.1:1"}, "r", tmp_path / "cache")  # never reached
    pv = PolicyVersion("policy", 3, "kafka:weights?policy=policy&version=3", created_at=0, published_at=0)
    for call in (lambda: reader.fetch(pv), lambda: reader.load(pv, lambda tensors: None)):
        with pytest.raises(ValueError, match="policy v3 refused: weights-log URI .* lacks or garbles"):
            call()
