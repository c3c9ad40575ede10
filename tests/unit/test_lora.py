"""LoRA through real PEFT on tiny models built in code (a tied and an untied one): what trains, what is published,
what an engine serves, and the bad input refused before anything trains."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rlstream.engine.local import TransformersBackend
from rlstream.errors import UserError
from rlstream.policy.adapters import BaseMismatch
from rlstream.policy.deltas import folder_hash
from rlstream.policy.weights import PolicyWeights, WeightStore
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.lora import BaseReference, LoraTraining, check_lora
from rlstream.trainer.settings import TrainerSettings
from tests.helpers.lora import SEQ, logprobs, publish, served_versions, tiny, train_a_step


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_each_version_served_by_the_transformers_engine_is_peft_merged_forward(tmp_path, tied):
    """Version after version, the engine built from the base and given each adapter gives the log-probs of PEFT's
    merge of that adapter; only the adapter trains (the base stays bit for bit), and only it has Adam state."""
    model, tok = tiny(tied)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    for version, pv, backend, peft_model, engine in served_versions(tmp_path, model, tok, TransformersBackend):
        merged = copy.deepcopy(peft_model).merge_and_unload()
        served = torch.tensor(backend.probe_logprobs(SEQ))
        assert torch.allclose(served, logprobs(merged), atol=1e-5), f"v{version} served unlike PEFT's merge"
        assert torch.allclose(served, logprobs(peft_model), atol=1e-5)
    assert not torch.allclose(logprobs(peft_model), logprobs(BaseReference(engine)), atol=1e-4), \
        "three Adam steps did not move the adapter off the base"
    base = peft_model.get_base_model()
    trained = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    held = {id(p) for p in engine.optimizer.param_groups[0]["params"]}
    assert held == {id(p) for n, p in peft_model.named_parameters() if n in trained}
    unmerged = {k.replace("base_layer.", ""): v for k, v in base.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(unmerged[k], v) for k, v in base_before.items()), "the frozen base changed"
    # The base in the store is the one the versions name.
    assert folder_hash(PolicyWeights(tmp_path / "cache").engine_folder(pv)) == pv.base_hash


def test_the_writer_after_its_first_version_writes_what_peft_save_pretrained_writes(tmp_path):
    """The trainer's one writer writes later versions itself (not through PEFT): each folder's content and hash
    equal those of PEFT's ``save_pretrained`` of the same adapter, its tensors equal the adapter's parameters, and
    PEFT loads it; a version's content stays what was written while the adapter trains on."""
    from peft import PeftModel
    from rlstream.policy.deltas import read_folder
    model, tok = tiny(False)
    lora = LoraTraining(TrainerSettings(lora_rank=4, lora_alpha=8.0))
    peft_model = lora.fresh(model, tok, WeightStore(str(tmp_path / "store")), "policy", lead=True)
    engine = TorchEngine(peft_model, lr=1e-2, max_grad_norm=1.0)
    writer, reference = lora.writer(peft_model, tok), lora.writer(peft_model, tok)
    for version in range(3):
        if version:
            train_a_step(engine, version)
        (tmp_path / f"own{version}").mkdir()
        content, digest = writer.write(tmp_path / f"own{version}")
        _, expected = reference.write(tmp_path / f"peft{version}", fast=False)
        assert digest == expected == folder_hash(tmp_path / f"own{version}"), f"v{version}"
        assert sorted(p.name for p in (tmp_path / f"own{version}").iterdir()) == \
            sorted(p.name for p in (tmp_path / f"peft{version}").iterdir())
        if version == 1:
            kept = {k: v.clone() for k, v in content.tensors.items()}
            held = content
    assert writer._params is not None, "the writer never left PEFT's save"
    train_a_step(engine, 9)
    assert all(torch.equal(held.tensors[k], v) for k, v in kept.items()), "a written content moved with training"
    loaded = PeftModel.from_pretrained(tiny(False)[0], str(tmp_path / "own2"))
    assert torch.equal(logprobs(loaded), logprobs(PeftModel.from_pretrained(tiny(False)[0], str(tmp_path / "peft2"))))
    assert read_folder(tmp_path / "own2").tensors.keys() == read_folder(tmp_path / "peft2").tensors.keys()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_transformers_engine_serving_adapters_unmerged_gives_peft_forward(tmp_path, tied):
    """``--lora-serving adapter``: PEFT's layers in the engine's model, each version's A and B copied in; its
    log-probs are PEFT's own forward, version after version, and the base's weights are never touched."""
    model, tok = tiny(tied)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    versions = served_versions(tmp_path, model, tok, lambda folder: TransformersBackend(folder, lora_serving="adapter"))
    for version, pv, backend, peft_model, engine in versions:
        served = torch.tensor(backend.probe_logprobs(SEQ))
        assert torch.allclose(served, logprobs(peft_model), atol=1e-5), f"v{version} served unlike PEFT's forward"
        held = {k.replace("base_layer.", ""): v for k, v in backend.model.state_dict().items() if ".lora_" not in k}
        assert all(torch.equal(held[k], v) for k, v in base_before.items()), "the served base was merged into"
    assert version >= 2 and not torch.allclose(served, logprobs(BaseReference(engine)), atol=1e-4)
    with pytest.raises(ValueError, match="whole weights.*LoRA layers"):
        backend.load_tensors(base_before, version + 1)


def test_an_adapter_of_another_shape_is_refused_by_an_engine_serving_adapters(tmp_path):
    model, tok = tiny(False)
    first = LoraTraining(TrainerSettings(lora_rank=4, lora_alpha=8.0))
    other = LoraTraining(TrainerSettings(lora_rank=2, lora_alpha=8.0))
    store = WeightStore(str(tmp_path / "store"))
    a = publish(first, first.fresh(copy.deepcopy(model), tok, store, "policy", lead=True), tok, store, 1)
    b = publish(other, other.fresh(copy.deepcopy(model), tok, store, "policy", lead=True), tok, store, 2)
    weights = PolicyWeights(tmp_path / "cache")
    backend = TransformersBackend(weights.engine_folder(a), lora_serving="adapter")
    backend.load_adapter(weights.folder(a), 1)
    with pytest.raises(ValueError, match="rank 2.*made for rank 4"):
        backend.load_adapter(weights.folder(b), 2)


def test_the_kl_reference_is_the_base_with_the_adapter_off(tmp_path):
    model, tok = tiny(False)
    base = copy.deepcopy(model)
    lora = LoraTraining(TrainerSettings(lora_rank=2))
    engine = TorchEngine(lora.fresh(model, tok, WeightStore(str(tmp_path)), "policy", lead=True), 1e-2, 1.0)
    train_a_step(engine, 1)
    train_a_step(engine, 2)
    ref = BaseReference(engine)
    ids = torch.tensor([SEQ])
    assert torch.allclose(ref(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-6)
    assert not torch.allclose(engine.forward(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-4)


def test_an_adapter_for_another_base_is_refused_with_both_hashes(tmp_path):
    model, tok = tiny(False, seed=0)
    lora = LoraTraining(TrainerSettings(lora_rank=2))
    store = WeightStore(str(tmp_path / "store"))
    peft_model = lora.fresh(model, tok, store, "policy", lead=True)
    pv = publish(lora, peft_model, tok, store, 0)
    other, _ = tiny(False, seed=1)  # another base, published by another trainer
    other_lora = LoraTraining(TrainerSettings(lora_rank=2))
    other_pv = publish(other_lora, other_lora.fresh(other, tok, store, "policy", lead=True), tok, store, 1)
    weights = PolicyWeights(tmp_path / "cache")
    backend = TransformersBackend(weights.engine_folder(other_pv))
    weights.adopt(other_pv, backend)
    before = backend.probe_logprobs(SEQ)
    with pytest.raises(BaseMismatch) as refused:
        weights.load(pv, backend)
    assert pv.base_hash[:16] in str(refused.value) and other_pv.base_hash[:16] in str(refused.value)
    assert pv.base_hash != other_pv.base_hash
    assert backend.probe_logprobs(SEQ) == before, "a refused adapter changed the served weights"


def test_targets_naming_no_module_list_the_model_linear_modules():
    model, _ = tiny(False)
    with pytest.raises(UserError, match="names no module") as err:
        check_lora(model, 2, ("qkv",), "none")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in str(err.value)


def test_a_rank_larger_than_a_layer_is_refused_naming_the_layer_and_flag():
    model, _ = tiny(False)  # hidden 32: every projection has a 32-wide side
    with pytest.raises(UserError, match=r"--lora-rank 64 is larger than layer .*q_proj"):
        check_lora(model, 64, ("q_proj",), "none")


def test_lora_with_sharding_is_refused_naming_the_flag():
    model, _ = tiny(False)
    for sharding in ("zero3", "fsdp2"):
        with pytest.raises(UserError, match=f"--sharding {sharding}"):
            check_lora(model, 2, ("all-linear",), sharding)
    # The weights log carries LoRA versions (rlstream.policy.log_bases): no refusal there.
    LoraTraining(dataclasses.replace(TrainerSettings(lora_rank=2), weights_transport="kafka"))


def test_the_output_head_of_a_tied_model_is_refused():
    model, _ = tiny(True)
    with pytest.raises(UserError, match="tied"):
        check_lora(model, 2, ("lm_head",), "none")


def test_an_engine_that_cannot_serve_adapters_is_refused_naming_it_and_the_flag(tmp_path):
    from rlstream.engine.base import InferenceBackend

    class NoAdapters(InferenceBackend):  # only its missing ability matters here; the check is on real records
        name = "some-server"

        def generate(self, prompts, params, between_steps=None, keys=None):
            return []

        def load_weights(self, folder, version):
            pass
    model, tok = tiny(False)
    lora = LoraTraining(TrainerSettings(lora_rank=2))
    store = WeightStore(str(tmp_path / "store"))
    pv = publish(lora, lora.fresh(model, tok, store, "policy", lead=True), tok, store, 0)
    with pytest.raises(UserError, match="some-server engine cannot serve adapters.*--backend transformers"):
        PolicyWeights(tmp_path / "cache").adopt(pv, NoAdapters())


def test_export_merge_gives_a_folder_from_pretrained_loads_with_the_served_log_probs(tmp_path):
    """``rlstream export --merge`` of a trained LoRA version: the merged folder, loaded by from_pretrained, gives
    the log-probs the transformers engine serves for that version; the bare adapter comes beside it."""
    from rlstream import cli
    from rlstream.policy.adapters import is_adapter
    model, tok = tiny(False)
    store = WeightStore(str(tmp_path / "store"))
    lora = LoraTraining(TrainerSettings(lora_rank=4))
    peft_model = lora.fresh(model, tok, store, "policy", lead=True)
    engine = TorchEngine(peft_model, 1e-2, 1.0)
    publish(lora, peft_model, tok, store, 0)
    train_a_step(engine, 1)
    pv = publish(lora, peft_model, tok, store, 1)
    weights = PolicyWeights(tmp_path / "cache")
    backend = TransformersBackend(weights.engine_folder(pv))
    weights.adopt(pv, backend)
    out = tmp_path / "out"
    assert cli.main(["export", "--store", str(tmp_path / "store"), "--version", "1", "--out", str(out), "--merge",
                     "--home", str(tmp_path / "home")]) == 0
    assert is_adapter(out / "adapter") and not is_adapter(out / "merged")
    merged = Qwen2ForCausalLM.from_pretrained(out / "merged")
    assert torch.allclose(logprobs(merged), torch.tensor(backend.probe_logprobs(SEQ)), atol=1e-5)
    assert not torch.allclose(logprobs(merged), logprobs(peft_model.get_base_model().__class__.from_pretrained(
        weights.engine_folder(pv))), atol=1e-4), "the export is the base, not the trained version"
    assert cli.main(["export", "--store", str(tmp_path / "store"), "--version", "7", "--out", str(tmp_path / "o2"),
                     "--home", str(tmp_path / "home")]) == 1  # a version not in the store: an error, no traceback
