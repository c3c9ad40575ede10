"""A teacher that follows a LoRA policy: built once from the base the versions name, each version's adapter merged
over it, so it scores as PEFT's model of that version does; an adapter of another base is refused with both hashes
while the teacher keeps scoring with the version it holds; the vLLM teacher refuses adapters naming the flag."""
from __future__ import annotations

import copy

import pytest
import torch

from rlstream.config import LoopSettings
from rlstream.errors import UserError
from rlstream.policy.adapters import BaseMismatch
from rlstream.policy.weights import WeightStore
from rlstream.stages.teacher import TeacherSettings, TeacherStage
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.lora import LoraTraining
from rlstream.trainer.settings import TrainerSettings
from tests.helpers.lora import SEQ, logprobs, publish, tiny, train_a_step


def scored(stage: TeacherStage) -> torch.Tensor:
    """The teacher's log-prob of each next token of SEQ."""
    (lps, _, _), = stage.scorer.score([SEQ], 1.0, 0)
    return torch.tensor(lps[-(len(SEQ) - 1):])


def teacher(tmp_path, **kw) -> TeacherStage:
    stage = TeacherStage(TeacherSettings(**kw), LoopSettings(home=str(tmp_path / "teacher-home")))
    stage.weights, stage.device = stage.follower.weights, torch.device("cpu")  # what _start sets
    return stage


def test_a_teacher_following_a_lora_policy_scores_as_each_version_and_refuses_another_base(tmp_path):
    model, tok = tiny(False)
    store = WeightStore(str(tmp_path / "store"))
    lora = LoraTraining(TrainerSettings(lora_rank=4, lora_alpha=8.0))
    peft_model = lora.fresh(model, tok, store, "policy", lead=True)
    engine = TorchEngine(peft_model, lr=1e-2, max_grad_norm=1.0)
    stage = teacher(tmp_path)
    for version in range(3):
        if version:
            train_a_step(engine, version)
        pv = publish(lora, peft_model, tok, store, version)
        assert stage._follow(pv) == version and stage.version == f"policy-v{version}"
        merged = copy.deepcopy(peft_model).merge_and_unload()
        assert torch.allclose(scored(stage), logprobs(merged), atol=1e-5), f"v{version} scored unlike PEFT's merge"
    base_model = stage.scorer.model
    # An adapter trained on another base: refused with both hashes; the teacher scores on with v2.
    other, _ = tiny(False, seed=1)
    other_lora = LoraTraining(TrainerSettings(lora_rank=4, lora_alpha=8.0))
    other_pv = publish(other_lora, other_lora.fresh(other, tok, store, "other", lead=True), tok, store, 3)
    before = scored(stage)
    with pytest.raises(BaseMismatch) as refused:
        stage._follow(other_pv)
    assert other_pv.base_hash[:16] in str(refused.value) and pv.base_hash[:16] in str(refused.value)
    assert stage.version == "policy-v2" and stage.scorer.model is base_model and torch.equal(scored(stage), before)


def test_the_vllm_teacher_refuses_a_lora_policy_naming_the_flag(tmp_path):
    model, tok = tiny(False)
    store = WeightStore(str(tmp_path / "store"))
    lora = LoraTraining(TrainerSettings(lora_rank=2))
    pv = publish(lora, lora.fresh(model, tok, store, "policy", lead=True), tok, store, 0)
    with pytest.raises(UserError, match="--backend transformers"):
        teacher(tmp_path, backend="vllm")._follow(pv)
