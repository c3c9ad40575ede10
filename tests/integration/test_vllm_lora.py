"""LoRA versions in vLLM in process (the CPU build): through its slots (one LoRARequest per version, never a reused
name or id, at most η + 1 resident) or merged into the weights; either way each version's log-probs those of PEFT's
merge of its adapter."""
from __future__ import annotations

import copy

import pytest
import torch

from rlstream.engine.local import VLLMBackend
from rlstream.policy.weights import PolicyWeights, WeightStore
from rlstream.schemas.records import SamplingParams
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.lora import LoraTraining
from rlstream.trainer.settings import TrainerSettings
from tests.helpers.lora import SEQ, logprobs, publish, tiny, train_a_step

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_vllm_serves_each_lora_version_as_peft_merged_forward(tmp_path):
    model, tok = tiny(False)
    store = WeightStore(str(tmp_path / "store"))
    lora = LoraTraining(TrainerSettings(lora_rank=4, lora_alpha=8.0), eta=1)  # η = 1: two adapters resident
    peft_model = lora.fresh(model, tok, store, "policy", lead=True)
    engine = TorchEngine(peft_model, lr=1e-2, max_grad_norm=1.0)
    weights = PolicyWeights(tmp_path / "cache")
    backend = None
    names = []
    for version in range(4):
        if version:
            train_a_step(engine, version)
        pv = publish(lora, peft_model, tok, store, version)
        if backend is None:
            backend = VLLMBackend(weights.engine_folder(pv), lora_serving="adapter")
            weights.adopt(pv, backend)
        else:
            weights.load(pv, backend)
        names.append(backend._adapter.lora_name)
        merged = copy.deepcopy(peft_model).merge_and_unload()
        served = torch.tensor(backend.probe_logprobs(SEQ))
        assert torch.allclose(served, logprobs(merged), atol=1e-3), f"v{version}: {served} vs {logprobs(merged)}"
        assert len(backend._adapters) <= 2, "more adapters resident than η + 1"
        gen = backend.generate([SEQ[:4]], SamplingParams(temperature=1.0, max_tokens=3, seed=version))[0]
        assert gen.versions == [version] * len(gen.token_ids), "tokens not stamped with the adapter that served them"
    assert len(set(names)) == len(names), "an adapter name was reused"
    assert {int(a.lora_int_id) for a in backend._adapters} == {3, 4}, "the oldest adapters were not the ones evicted"
    assert set(backend.llm.llm_engine.list_loras()) == {3, 4}
    backend.close()


@pytest.mark.timeout(600)
def test_vllm_merged_serving_loads_each_version_in_place_as_peft_merged_forward(tmp_path):
    """--lora-serving merged (the CPU's default): no LoRA slots; each version's adapter merged into the base's weights
    and loaded in place, from the base again each time (never over the previous version's merge), for a tied model
    and an untied one."""
    for tied in (False, True):
        model, tok = tiny(tied)
        store = WeightStore(str(tmp_path / f"store-{tied}"))
        lora = LoraTraining(TrainerSettings(lora_rank=4, lora_alpha=8.0), eta=1)
        peft_model = lora.fresh(model, tok, store, "policy", lead=True)
        engine = TorchEngine(peft_model, lr=1e-2, max_grad_norm=1.0)
        weights = PolicyWeights(tmp_path / f"cache-{tied}")
        backend = None
        for version in range(3):
            if version:
                train_a_step(engine, version)
            pv = publish(lora, peft_model, tok, store, version)
            if backend is None:
                backend = VLLMBackend(weights.engine_folder(pv), lora_serving="merged")
                assert backend.lora_serving == "merged" and backend.llm.llm_engine.vllm_config.lora_config is None
                weights.adopt(pv, backend)
            else:
                weights.load(pv, backend)
            merged = copy.deepcopy(peft_model).merge_and_unload()
            served = torch.tensor(backend.probe_logprobs(SEQ))
            assert torch.allclose(served, logprobs(merged), atol=1e-3), \
                f"tied={tied} v{version}: {served} vs {logprobs(merged)}"
            gen = backend.generate([SEQ[:4]], SamplingParams(temperature=1.0, max_tokens=3, seed=version))[0]
            assert gen.versions == [version] * len(gen.token_ids)
        backend.close()


def test_lora_serving_resolves_by_platform_and_refuses_what_it_cannot_do(monkeypatch):
    from rlstream.engine.local import resolve_lora_serving
    from rlstream.errors import UsageError
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert resolve_lora_serving("auto") == "merged"  # vLLM's CPU build: merged
    assert resolve_lora_serving("adapter") == "adapter"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine in another process: no tensors
    assert resolve_lora_serving("auto") == "adapter"
    with pytest.raises(UsageError, match="--lora-serving adapter"):
        resolve_lora_serving("merged")
    with pytest.raises(UsageError, match="one of auto, adapter, merged"):
        resolve_lora_serving("fused")
