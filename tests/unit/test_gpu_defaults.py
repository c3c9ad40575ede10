"""Defaults that follow the device: micro-batching, precision, DeepSpeed's bf16 block, attention, CUDA graphs,
threads, and ``--device auto`` on a machine whose GPUs torch cannot use.

This machine has no GPU: each decision is a pure function of the device kind and the figures it is handed (free
memory, the model's shape), and is checked here with those handed in; the CPU path runs for real."""
from __future__ import annotations

import pytest
import torch

from rlstream.config import load
from rlstream.engine.factory import resolve_enforce_eager
from rlstream.errors import UsageError, UserError
from rlstream.models.devices import auto_device, check_vllm_device, resolve_threads
from rlstream.models.loading import resolve_attention
from rlstream.models.resources import GIB, ModelShape, activation_bytes_per_token
from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.microbatch import (MAX_BUDGET, MIN_BUDGET, StepBudget, activation_room, check_whole_batch,
                                         default_budget, resolve_budget, step_budget, step_tokens, trainer_budget,
                                         train_step)
from rlstream.trainer.precision import Precision, resolve_precision
from rlstream.trainer.settings import TrainerSettings
from rlstream.trainer.sharded import deepspeed_config
from rlstream.trainer.update import UpdateConfig
from tests.helpers.batches import mixed_batch

SMOL = ModelShape(params=134_515_008, hidden=576, layers=30, vocab=49152)
QWEN_7B = ModelShape(params=7_600_000_000, hidden=3584, layers=28, vocab=152064)


# -- micro-batching -------------------------------------------------------------------------------------------------

def test_the_budget_is_sized_from_the_room_on_either_device_and_whole_without_one():
    assert TrainerSettings().micro_batch_tokens == -1
    assert default_budget("cpu", None, SMOL) == 0
    assert resolve_budget(-1, "cpu", None, SMOL) == 0
    # On the CPU as on CUDA, from the room, in float32 there: SmolLM2 in 8 GiB gets a few thousand tokens, not the
    # whole step (64 samples of ~250 tokens took 20 GB and were OOM-killed on a 24 GB machine).
    cpu = default_budget("cpu", 8 * GIB, SMOL, dtype_bytes=4)
    assert MIN_BUDGET <= cpu <= 4096 and cpu * activation_bytes_per_token(SMOL, 4) <= 0.6 * 8 * GIB
    per_token = activation_bytes_per_token(SMOL)
    # A 135 M model on a 24 GB card's 16 GiB of room: 0.6 of it at ~1.1 MB a token, in multiples of 1024.
    budget = default_budget("cuda", 16 * GIB, SMOL)
    assert budget % 1024 == 0 and MIN_BUDGET <= budget < MAX_BUDGET
    assert budget * per_token <= 0.6 * 16 * GIB < (budget + 1024) * per_token
    # An H200's room is more than the budget's bound; a 7 B model with a 152k vocabulary in 4 GiB gets the floor.
    assert default_budget("cuda", 120 * GIB, SMOL) == MAX_BUDGET
    assert default_budget("cuda", 4 * GIB, QWEN_7B) == MIN_BUDGET
    # Given values are kept, on any device; below -1 is refused by name.
    assert resolve_budget(0, "cuda", 16 * GIB, SMOL) == 0 and resolve_budget(2048, "cpu", None, SMOL) == 2048
    with pytest.raises(UserError, match="--micro-batch-tokens -2"):
        resolve_budget(-2, "cuda", GIB, SMOL)


def test_activation_estimates_follow_the_dtype_and_checkpointing():
    bf16, fp32 = activation_bytes_per_token(SMOL, 2), activation_bytes_per_token(SMOL, 4)
    assert bf16 < fp32 and activation_bytes_per_token(SMOL, 2, checkpointing=True) < bf16
    # The head's share: 12 bytes per vocabulary entry per token.
    assert bf16 - 30 * 34 * 576 == 12 * 49152


def test_room_is_the_trainers_share_less_what_it_holds_and_its_pending_state():
    total, free = 80 * GIB, 70 * GIB
    assert activation_room(total, free, held=2 * GIB, fraction=1.0, pending=GIB) == 70 * GIB - GIB
    # A trainer sharing the GPU at 0.4: its share less what it holds, even though more is free.
    assert activation_room(total, free, held=2 * GIB, fraction=0.4, pending=GIB) == 32 * GIB - 2 * GIB - GIB


def test_a_whole_batch_step_that_cannot_fit_is_refused_naming_the_flag():
    batch = mixed_batch()
    tokens = step_tokens(batch)
    assert tokens == batch.input_ids.shape[0] * int(batch.attention_mask.sum(-1).max())
    assert step_tokens(batch, packed=True) == int(batch.attention_mask.sum())
    check_whole_batch(tokens, per_token=1000, room=tokens * 1000, rows=8)  # fits: nothing said
    check_whole_batch(tokens, per_token=1000, room=None, rows=8)  # not on a GPU: nothing to check
    with pytest.raises(UserError, match=r"--micro-batch-tokens \d+ \(or -1"):
        check_whole_batch(tokens, per_token=1000, room=tokens * 1000 - 1, rows=8)
    # Through the trainer's step: refused before any forward, so the model is untouched.
    model = build_model(build_tokenizer(), seed=0)
    engine = TorchEngine(model, lr=1e-2, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UserError, match="does not fit"):
        train_step(engine, batch, UpdateConfig(), max_tokens=StepBudget(0, per_token=1 << 20, room=GIB // 1024))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # The same step with a budget trains (micro-batches are not checked against the whole batch's estimate).
    stats = train_step(engine, batch, UpdateConfig(), max_tokens=StepBudget(24, per_token=1 << 20, room=GIB // 1024))
    assert stats["samples"] == 8.0


# -- precision ----------------------------------------------------------------------------------------------------

def test_cuda_defaults_to_fp32_masters_under_bf16_autocast_published_in_bf16():
    assert TrainerSettings().autocast == "auto" and TrainerSettings().dtype == "auto"
    assert resolve_precision("cuda") == Precision("fp32", "bf16", "bf16")
    # The CPU keeps what it did: the checkpoint's dtype, no autocast, published as trained.
    assert resolve_precision("cpu") == Precision("auto", "off", "auto")
    # Given values are kept; a GPU without bf16 gets no autocast by default and refuses it asked.
    assert resolve_precision("cuda", "bf16", "off", "fp32") == Precision("bf16", "off", "fp32")
    assert resolve_precision("cuda", bf16_supported=False) == Precision("fp32", "off", "auto")
    with pytest.raises(UsageError, match="no bf16"):
        resolve_precision("cuda", autocast="bf16", bf16_supported=False)
    assert resolve_precision("cpu", autocast="bf16") == Precision("auto", "bf16", "auto")


def test_the_deepspeed_config_has_a_bf16_block_under_bf16_autocast():
    plain = deepspeed_config(2, 1e-6, 1.0)
    assert "bf16" not in plain and plain["zero_optimization"] == {"stage": 2}
    assert deepspeed_config(3, 1e-6, 1.0, "bf16")["bf16"] == {"enabled": True}


def test_the_trainer_resolves_its_device_knobs_once_on_the_cpu_as_before(monkeypatch):
    from rlstream.trainer.service import TrainerService
    service = TrainerService(load(TrainerSettings, device="cpu"))
    service._place()
    s = service.settings
    assert (str(service.device), s.dtype, s.autocast, s.publish_dtype) == ("cpu", "auto", "off", "auto")
    assert service.attention is None
    # The whole batch, nothing to check.
    assert trainer_budget(s, service.device, None, False, service.ranks.world) == StepBudget(0)
    assert step_budget(64, torch.device("cpu"), None, False, False, 1.0) == StepBudget(64)


def test_the_trainer_service_on_the_cpu_sizes_its_budget_from_its_model():
    from rlstream.trainer.service import TrainerService
    service = TrainerService(load(TrainerSettings, device="cpu"))
    service._place()
    service.model = build_model(build_tokenizer())
    service._engine(None)
    # The tiny model's bytes a token are few: the bound (it was the whole batch, 0, whatever the model).
    assert service.budget == StepBudget(MAX_BUDGET)


def test_a_cpu_trainer_sizes_its_default_budget_from_the_memory_available(monkeypatch):
    import rlstream.trainer.microbatch as microbatch
    cpu = torch.device("cpu")
    monkeypatch.setattr(microbatch, "available_memory", lambda: 10 * GIB)
    pending = 12 * SMOL.params
    sized = step_budget(-1, cpu, SMOL, False, False, 1.0, pending=pending)
    assert sized.tokens == default_budget("cpu", 10 * GIB - pending, SMOL, 4) and sized.room is None
    # Two ranks on the machine share it; a budget given, or the whole batch asked for, is kept as it is.
    assert step_budget(-1, cpu, SMOL, False, False, 1.0, world=2, pending=pending).tokens == default_budget(
        "cpu", (10 * GIB - pending) // 2, SMOL, 4) < sized.tokens
    assert step_budget(0, cpu, SMOL, False, False, 1.0).tokens == 0
    assert step_budget(2048, cpu, SMOL, False, False, 1.0).tokens == 2048
    # A tiny model (the demo's) gets the bound: more than its steps have, so nothing changes for it.
    tiny = ModelShape(params=1_000_000, hidden=64, layers=2, vocab=512)
    assert step_budget(-1, cpu, tiny, False, False, 1.0).tokens == MAX_BUDGET


def test_available_memory_is_within_the_hosts_and_positive():
    import psutil
    from rlstream.models.resources import available_memory
    assert 0 < available_memory() <= psutil.virtual_memory().available + GIB


# -- engines, attention, threads, devices ---------------------------------------------------------------------------

def test_vllm_runs_eager_on_the_cpu_and_with_cuda_graphs_on_a_gpu():
    assert resolve_enforce_eager("auto", cuda=False) is True
    assert resolve_enforce_eager("auto", cuda=True) is False
    assert resolve_enforce_eager("on", cuda=True) is True and resolve_enforce_eager("off", cuda=False) is False
    with pytest.raises(UserError, match="--enforce-eager"):
        resolve_enforce_eager("maybe", cuda=True)


def test_in_process_vllm_past_the_first_gpu_is_refused_with_how_to_place_it():
    for ok in ("auto", "cpu", "cuda", "cuda:0"):
        check_vllm_device(ok)
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES=1 and --device cuda"):
        check_vllm_device("cuda:1")


def test_attention_auto_is_flash_attention_for_packed_rows_on_cuda_when_installed():
    assert resolve_attention("auto", "cuda", flash_installed=True, packed=True) == "flash_attention_2"
    assert resolve_attention("auto", "cuda", flash_installed=False, packed=True) is None  # SDPA's masked path
    assert resolve_attention("auto", "cuda", flash_installed=True, packed=False) is None
    assert resolve_attention("auto", "cpu", flash_installed=True, packed=True) is None
    assert resolve_attention("sdpa", "cpu", False) == "sdpa" and resolve_attention("eager", "cuda", True) == "eager"
    with pytest.raises(UsageError, match="flash-attn package is not installed"):
        resolve_attention("flash_attention_2", "cuda", flash_installed=False)
    with pytest.raises(UsageError, match="CUDA only"):
        resolve_attention("flash_attention_2", "cpu", flash_installed=True)


def test_the_attention_knob_reaches_a_loaded_model(tmp_path):
    from rlstream.models.loading import load_model, set_attention
    from tests.helpers.models import llama_folder
    folder = llama_folder(tmp_path / "m")
    assert load_model(folder, attn_implementation="eager").config._attn_implementation == "eager"
    model = load_model(folder)
    set_attention(model, "eager")
    assert model.config._attn_implementation == "eager"


def test_threads_follow_the_placement_then_the_machine():
    assert resolve_threads(3) == 3
    assert resolve_threads(0, omp="6") == 6 and resolve_threads(0, share=2, omp="6") == 3
    assert resolve_threads(0, omp="", cores=16) == 16 and resolve_threads(0, share=4, omp="", cores=16) == 4
    assert resolve_threads(0, share=4, omp="1", cores=2) == 1
    assert TrainerSettings().threads == 0


def test_device_auto_stops_when_nvidia_smi_sees_gpus_that_torch_cannot_use():
    assert auto_device(True, 0) == "cuda"
    assert auto_device(False, 0) == "cpu"
    asked = []
    assert auto_device(True, lambda: asked.append(1) or 8) == "cuda" and not asked  # nvidia-smi asked only if needed
    with pytest.raises(UsageError, match=r"nvidia-smi sees 8 GPU\(s\) but torch 2.13.0\+cpu \(a CPU-only build\)"):
        auto_device(False, 8, "2.13.0+cpu", None)
    with pytest.raises(UsageError, match="built for CUDA 13.0.*--device cpu"):
        auto_device(False, lambda: 1, "2.13.0+cu130", "13.0")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero_with_the_bf16_block_keeps_fp32_masters_that_small_updates_move(monkeypatch):
    """DeepSpeed's bf16 block, run for real (on the CPU accelerator): the module in bf16, the masters in fp32 in
    ZeRO's partition, and an update far below bf16's resolution still moves them."""
    import socket

    from rlstream.trainer.sharding import make_engine
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
    engine = make_engine(build_model(build_tokenizer(), seed=0), lr=1e-6, sharding="zero2", autocast_mode="bf16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    [master] = engine.engine.optimizer.single_partition_of_fp32_groups
    assert master.dtype == torch.float32
    before_master = master.detach().clone()
    before_module = [p.detach().clone() for p in engine.model.parameters()]
    train_step(engine, mixed_batch(), UpdateConfig())
    assert not torch.equal(master, before_master)
    # At lr 1e-6 most bf16 weights round back to where they were: the update lives in the masters.
    same = sum(int((a == b).sum()) for a, b in zip(before_module, engine.model.parameters()))
    assert same > 0.9 * sum(a.numel() for a in before_module)
