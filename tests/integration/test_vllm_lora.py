"""LoRA versions in vLLM in process (the CPU build): through its slots (one LoRARequest per version, never a reused
name or id, at most η + 1 resident) or merged into the weights; either way each version's log-probs those of PEFT's
merge of its adapter."""
from __future__ import annotations

import copy

import pytest
import torch

from rlstream.engine.local import VLLMBackend
from rlstream.schemas.records import SamplingParams
from tests.helpers.lora import SEQ, logprobs, served_versions, tiny

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_vllm_serves_each_lora_version_as_peft_merged_forward(tmp_path):
    names = []

    def adapter_engine(folder):
        return VLLMBackend(folder, lora_serving="adapter")
    # η = 1: two adapters resident.
    for version, _, backend, peft_model, _ in served_versions(tmp_path, *tiny(False), adapter_engine, versions=4,
                                                              eta=1):
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
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vllm_merged_serving_loads_each_version_in_place_as_peft_merged_forward(tmp_path, tied):
    """--lora-serving merged (the CPU's default): no LoRA slots; each version's adapter merged into the base's weights
    and loaded in place, from the base again each time (never over the previous version's merge)."""

    def merged_engine(folder):
        return VLLMBackend(folder, lora_serving="merged")
    for version, _, backend, peft_model, _ in served_versions(tmp_path, *tiny(tied), merged_engine):
        assert backend.lora_serving == "merged" and backend.llm.llm_engine.vllm_config.lora_config is None
        want = logprobs(copy.deepcopy(peft_model).merge_and_unload())
        served = torch.tensor(backend.probe_logprobs(SEQ))
        assert torch.allclose(served, want, atol=1e-3), f"v{version}: {served} vs {want}"
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
