"""What the trainer writes per version (rlstream.trainer.checkpoint): the tiny model's folders after the first go
through safetensors directly, load in transformers to the same weights, hash as workers hash them, do not alias the
live model; and a resume takes the newest optimizer state at or before its version."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.policy.deltas import content_hash, folder_hash
from rlstream.policy.weights import WeightStore
from rlstream.trainer.checkpoint import (MASTER_FILE, PendingVersion, VersionWriter, load_resumed,
                                         resume_optimizer_states, write_optimizer_states)


def _nudge(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def test_every_version_folder_loads_to_the_models_weights_and_hashes_as_workers_hash_it(tmp_path):
    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    writer = VersionWriter(model, tok)
    contents = []
    for v in range(3):
        folder = tmp_path / f"v{v}"
        folder.mkdir()
        content, digest = writer.write(folder)
        contents.append(content)
        assert writer._names is not None  # the first save taught it the names: later ones skip save_pretrained
        assert folder_hash(folder) == content_hash(content) == digest
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        for (name, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
            assert torch.equal(p, q), name
        assert sorted(f.name for f in folder.iterdir()) == sorted(f.name for f in (tmp_path / "v0").iterdir())
        _nudge(model)
    # The last version's content (the weights log's next base) is intact after the next one is written.
    assert content_hash(contents[1]) == folder_hash(tmp_path / "v1")
    # The content kept (the weights log's next base) is a copy: training on did not change it.
    assert not torch.equal(contents[1].tensors["model.embed_tokens.weight"],
                           model.state_dict()["model.embed_tokens.weight"])


def test_a_resume_takes_the_newest_optimizer_state_at_or_before_its_version(tmp_path):
    store = WeightStore(str(tmp_path / "store"))
    for v in range(6):
        def write(folder, v=v):
            (folder / "config.json").write_text("{}")
            if v in (0, 3, 5):
                write_optimizer_states(folder, [{"state": {}, "param_groups": [], "v": v}], sharded=False)
        store.put("p", v, write)
    cache = tmp_path / "cache"
    assert resume_optimizer_states(store.path("p", 4), store, "p", 4, cache)[0]["v"] == 3
    assert resume_optimizer_states(store.path("p", 5), store, "p", 5, cache)[0]["v"] == 5
    store.prune("p", keep_from=4, keep=set())
    assert resume_optimizer_states(store.path("p", 4), store, "p", 4, cache) is None


def test_a_bf16_publish_of_an_fp32_model_keeps_the_fp32_master_for_the_resume(tmp_path):
    """--publish-dtype bf16: the folder's tensors (what workers load and hash) are bf16 and its config says so; the
    master beside them is private and loads back bit-identical in fp32, through both write paths."""
    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    writer = VersionWriter(model, tok, publish_dtype=torch.bfloat16)
    for v in range(2):  # v0 through save_pretrained, v1 through safetensors directly
        _nudge(model)
        folder = tmp_path / f"v{v}"
        folder.mkdir()
        content, digest = writer.write(folder)
        assert {t.dtype for t in content.tensors.values()} == {torch.bfloat16}
        assert (folder / MASTER_FILE).exists() and MASTER_FILE not in content.names()
        assert folder_hash(folder) == content_hash(content) == digest
        assert AutoModelForCausalLM.from_pretrained(folder).dtype == torch.bfloat16  # the config names bf16
        resumed = load_resumed(folder)
        assert resumed.dtype == torch.float32
        for (name, p), (_, q) in zip(model.state_dict().items(), resumed.state_dict().items()):
            assert p.dtype == q.dtype == torch.float32 and torch.equal(p, q), name
        # Not the rounding: the published bf16 differs from the master.
        assert not torch.equal(content.tensors["model.embed_tokens.weight"].float(),
                               model.state_dict()["model.embed_tokens.weight"])


def test_publishing_in_the_trained_dtype_writes_no_master(tmp_path):
    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    for dtype in (None, torch.float32):
        folder = tmp_path / str(dtype)
        folder.mkdir()
        content, _ = VersionWriter(model, tok, publish_dtype=dtype).write(folder)
        assert not (folder / MASTER_FILE).exists()
        assert {t.dtype for t in content.tensors.values()} == {torch.float32}


def test_a_pending_version_hands_its_content_over_before_its_folder_is_done_and_passes_on_a_failed_write(tmp_path):
    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    writer = VersionWriter(model, tok, publish_dtype=torch.bfloat16)
    store, pool = WeightStore(str(tmp_path / "store")), ThreadPoolExecutor(1)
    (tmp_path / "v0").mkdir()
    writer.write(tmp_path / "v0")  # the first write learns the tensor names; later ones take the fast path
    release = threading.Event()

    def write(folder, on_content):
        writer.write(folder, on_content=on_content)
        assert release.wait(30)  # the folder's last files are still being written
    pending = PendingVersion(pool, store, "p", 1, write)
    content, digest = pending.content()  # while the write is still held back
    assert not store.versions("p") and digest == content_hash(content)
    release.set()
    assert pending.uri() == store.uri("p", 1) and folder_hash(store.path("p", 1)) == digest

    def broken(folder, on_content):
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        PendingVersion(pool, store, "p", 2, broken).content()

    def late(folder, on_content):
        writer.write(folder, on_content=on_content)
        raise OSError("no space for the optimizer state")
    failing = PendingVersion(pool, store, "p", 3, late)
    assert failing.content()[1]
    with pytest.raises(OSError, match="optimizer state"):
        failing.uri()
    assert 3 not in store.versions("p")
