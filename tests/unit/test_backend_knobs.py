"""Rollout's engine knobs reach the engine: --gpu-memory-utilization and --max-context to vLLM, --device to the
transformers backend (vLLM itself is faked: only what rlstream hands it is checked here)."""
from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest

from rlstream.config import load
from rlstream.stages.rollout import RolloutSettings, RolloutStage


@pytest.fixture
def fake_vllm(monkeypatch):
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def get_tokenizer(self):
            return SimpleNamespace(eos_token_id=2)

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    sys.modules["vllm"].LLM = LLM
    return seen


def test_gpu_memory_utilization_and_max_context_from_the_environment_reach_vllm(fake_vllm, monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    monkeypatch.setenv("RLSTREAM_ROLLOUT_GPU_MEMORY_UTILIZATION", "0.45")
    monkeypatch.setenv("RLSTREAM_ROLLOUT_MAX_CONTEXT", "48")
    stage = RolloutStage(load(RolloutSettings, backend="vllm"))
    stage.max_context = stage.settings.max_context
    stage._make_backend(tmp_path, 0)
    assert fake_vllm["gpu_memory_utilization"] == 0.45
    assert fake_vllm["max_model_len"] == 48


def test_enforce_eager_follows_the_device_unless_given(fake_vllm, monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    import torch
    stage = RolloutStage(load(RolloutSettings, backend="vllm"))
    stage._make_backend(tmp_path, 0)
    assert fake_vllm["enforce_eager"] is (not torch.cuda.is_available())  # auto: eager on the CPU only
    monkeypatch.setenv("RLSTREAM_ROLLOUT_ENFORCE_EAGER", "off")
    RolloutStage(load(RolloutSettings, backend="vllm"))._make_backend(tmp_path, 0)
    assert fake_vllm["enforce_eager"] is False
    with pytest.raises(Exception, match="--device cuda:2"):
        RolloutStage(load(RolloutSettings, backend="vllm", device="cuda:2"))._make_backend(tmp_path, 0)


def test_gpu_memory_utilization_outside_0_1_is_refused_by_name():
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        RolloutStage(RolloutSettings(gpu_memory_utilization=1.5))


def test_transformers_backend_goes_to_the_device_asked(monkeypatch, tmp_path):
    from rlstream.errors import UsageError
    from rlstream.engine import make_backend
    placed = {}
    import rlstream.engine.local as local
    monkeypatch.setattr(local.TransformersBackend, "__init__",
                        lambda self, folder, threads=1, device="cpu", dtype="auto", attn_implementation=None,
                        lora_serving="auto": placed.update(device=device, threads=threads, attn=attn_implementation,
                                                           lora=lora_serving))
    make_backend("transformers", tmp_path, device="cpu", threads=3, attn_implementation="eager",
                 lora_serving="adapter")
    assert placed == {"device": "cpu", "threads": 3, "attn": "eager", "lora": "adapter"}
    make_backend("transformers", tmp_path, device="cpu")
    assert placed["attn"] is None  # auto off CUDA: transformers' own choice
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="0 CUDA device"):
            make_backend("transformers", tmp_path, device="cuda")


def _weights(folder, *shapes):
    """A checkpoint folder whose safetensors hold zero tensors of these shapes (only the header is read)."""
    import torch
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"w{i}": torch.zeros(shape, dtype=torch.bfloat16) for i, shape in enumerate(shapes)},
              str(folder / "model.safetensors"))
    return folder


def test_auto_picks_transformers_for_a_small_model_on_the_cpu_and_vllm_otherwise(fake_vllm, monkeypatch, tmp_path):
    from rlstream.engine import factory
    from rlstream.engine.factory import auto_kind, parameter_count
    monkeypatch.setattr(factory, "SMALL_MODEL_PARAMETERS", 100_000)  # the rule, on files of a few hundred KB
    small = _weights(tmp_path / "small", (1000, 64), (64,))
    big = _weights(tmp_path / "big", (100, 1000), (8,))
    assert parameter_count(small) == 64_064
    assert parameter_count(big) == 100_008
    assert parameter_count(tmp_path / "no-weights") is None
    assert auto_kind(small, device="cpu") == "transformers"
    assert auto_kind(big, device="cpu") == "vllm"  # the fake vllm is importable
    assert auto_kind(tmp_path / "no-weights", device="cpu") == "vllm"  # size unknown: the engine made for serving
    assert auto_kind(small, device="cuda") == "vllm"  # on a GPU vLLM's engine is the point


def test_auto_falls_back_to_transformers_without_vllm(monkeypatch, tmp_path):
    from rlstream.engine import factory
    monkeypatch.setattr(factory, "SMALL_MODEL_PARAMETERS", 100)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    assert factory.auto_kind(_weights(tmp_path / "big", (100, 2)), device="cpu") == "transformers"
