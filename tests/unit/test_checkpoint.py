"""What the trainer writes per version (rlstream.trainer.checkpoint): the tiny model's folders after the first go
through safetensors directly, load in transformers to the same weights, hash as workers hash them, do not alias the
live model; and a resume takes the newest training state (trainer/shards.py) at or before its version, from a local
store or an fsspec one."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.policy.deltas import content_hash, folder_hash
from rlstream.errors import UserError
from rlstream.policy.weights import WeightStore
from rlstream.trainer import shards
from rlstream.trainer.checkpoint import MASTER_FILE, PendingVersion, VersionWriter, load_resumed
from rlstream.trainer.engine import TorchEngine


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


def _stepped_engine(steps: int) -> TorchEngine:
    engine = TorchEngine(torch.nn.Linear(3, 2), lr=0.1, max_grad_norm=1.0)
    for _ in range(steps):
        engine.step(engine.model(torch.ones(1, 3)).sum())
    return engine


# file: a plain path; memory://: through fsspec, as an s3:// or gs:// store is written and read.
@pytest.mark.parametrize("scheme", ["file", "memory://"])
def test_a_resume_takes_the_newest_training_state_at_or_before_its_version(tmp_path, scheme):
    store = WeightStore(str(tmp_path / "store") if scheme == "file" else f"memory://{tmp_path / 'store'}")
    for v in range(6):
        # Version v's Adam has taken v steps (v0's none: a fresh AdamW writes no optimizer state).
        where = shards.staging(store, "p", v) if v in (0, 3, 5) else None
        manifest = shards.save(_stepped_engine(v), where, "none", 1) if where else None

        def write(folder, where=where, manifest=manifest):
            (folder / "config.json").write_text("{}")
            if where:
                shards.adopt(where, folder, manifest)
        store.put("p", v, write)
    listed = [str(p) for p in (tmp_path / "store" / "p").iterdir()] if store.local else \
        store.fs.ls(f"{tmp_path}/store/p", detail=False)
    assert not any(".training-state" in name for name in listed), "a staging folder was left behind"
    cache = tmp_path / "cache"

    def resumed_steps(v) -> int:
        found = shards.find(store.fetch("p", v, cache), store, "p", v, cache)
        if found is None:
            return -1
        engine = _stepped_engine(0)
        shards.load(engine, *found, "none", 1)
        return engine.steps
    assert [resumed_steps(v) for v in (0, 4, 5)] == [0, 3, 5]
    with pytest.raises(UserError, match="resume with --sharding none"):
        shards.load(_stepped_engine(0), *shards.find(store.fetch("p", 5, cache), store, "p", 5, cache), "fsdp2", 1)
    store.prune("p", keep_from=4, keep=set())
    assert resumed_steps(4) == -1


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


def test_weights_streamed_a_tensor_at_a_time_make_the_folder_save_pretrained_makes(tmp_path):
    """meta.stream_full on a model with tied embeddings (one process: each tensor is whole already): the file holds
    each tensor once under the name save_pretrained gives it, in the publish dtype, the master beside it; and the
    folder VersionWriter completes from it hashes as workers hash it."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlstream.trainer import meta
    from rlstream.trainer.checkpoint import WEIGHTS_FILE
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path / "reference")
    streamed = meta.stream_full(model, tmp_path / "stream", torch.bfloat16)
    reference = load_file(str(tmp_path / "reference" / WEIGHTS_FILE))
    weights, master = (load_file(str(tmp_path / "stream" / f)) for f in (WEIGHTS_FILE, MASTER_FILE))
    assert set(weights) == set(master) == set(reference)  # the tied head once, as save_pretrained saves it
    assert all(weights[k].dtype == torch.bfloat16 and torch.equal(weights[k], reference[k].to(torch.bfloat16))
               and torch.equal(master[k], reference[k]) for k in reference)
    folder = tmp_path / "version"
    folder.mkdir()
    _, digest = VersionWriter(model, build_tokenizer(), publish_dtype=torch.bfloat16).write(folder, streamed)
    assert digest == folder_hash(folder)
    assert not any((tmp_path / "stream").iterdir()), "the streamed files were moved into the version's folder"
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.config.tie_word_embeddings and loaded.lm_head.weight.dtype == torch.bfloat16
