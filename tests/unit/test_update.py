"""Batch building and one update step on a real tiny model, with plain torch and with DeepSpeed ZeRO on CPU."""
from __future__ import annotations

import socket

import pytest
import torch

from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.schemas.records import TeacherFeedback
from rlstream.trainer.sharding import make_engine
from rlstream.trainer.update import UpdateConfig, build_batch, policy_update
from tests.helpers.batches import scored


def test_batch_aligns_masks_and_logprobs_with_targets():
    groups = [[scored("a", 0, 1.0), scored("a", 1, 0.0, prompt=(1, 5))]]
    b = build_batch(groups, "grpo", pad_id=0)
    # Row 0: [1 5 6 | 7 8 2]; targets are tokens 1..5 and only response tokens with mask 1 count.
    assert b.input_ids[0].tolist() == [1, 5, 6, 7, 8, 2]
    assert b.loss_mask[0].tolist() == [0, 0, 1, 0, 1]
    assert b.behaviour_logprobs[0].tolist() == [0, 0, -1, 0, -2]
    # Row 1 is one token shorter: right padding, with its mask shifted accordingly.
    assert b.input_ids[1].tolist() == [1, 5, 7, 8, 2, 0]
    assert b.loss_mask[1].tolist() == [0, 1, 0, 1, 0]
    # Per target token; without turn scores a row holds its sample's advantage throughout.
    assert b.advantages.shape == b.loss_mask.shape
    assert b.advantages.tolist() == [[pytest.approx(1.0, abs=1e-4)] * 5, [pytest.approx(-1.0, abs=1e-4)] * 5]


def test_batch_advantages_stay_within_groups_of_unequal_size():
    # Group a: rewards 1, 0 -> +1, -1. Group b (three samples, the last padded wider): 1, 1, 0.
    groups = [[scored("a", 0, 1.0), scored("a", 1, 0.0)],
              [scored("b", 0, 1.0), scored("b", 1, 1.0), scored("b", 2, 0.0, response=(7, 8, 9, 2), mask=(1, 1, 1, 1))]]
    groups[1][2].trajectory.behaviour_logprobs = [-1.0, -1.0, -1.0, -3.0]
    b = build_batch(groups, "grpo", pad_id=0)
    std_b = (2 / 9) ** 0.5  # population std of (1, 1, 0)
    assert b.advantages.shape == (5, 6) and (b.advantages == b.advantages[:, :1]).all()
    assert b.advantages[:, 0].tolist() == pytest.approx([1, -1, (1 / 3) / std_b, (1 / 3) / std_b, -(2 / 3) / std_b],
                                                        abs=1e-4)
    assert b.rewards.tolist() == [1, 0, 1, 1, 0]
    assert b.input_ids.shape == (5, 7)
    assert b.input_ids[0].tolist() == [1, 5, 6, 7, 8, 2, 0]
    assert b.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 1, 0]
    assert b.loss_mask[4].tolist() == [0, 0, 1, 1, 1, 1]
    assert b.behaviour_logprobs[4].tolist() == [0, 0, -1, -1, -1, -3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["none", pytest.param("zero2", marks=pytest.mark.slow)])
def test_update_moves_the_policy_towards_the_rewarded_sample(sharding, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    engine = make_engine(model, lr=1e-2, sharding=sharding)
    groups = [[scored("a", 0, 1.0, response=(7, 8, 2), mask=(1, 1, 1)),
               scored("a", 1, 0.0, response=(9, 10, 2), mask=(1, 1, 1))]]
    batch = build_batch(groups, "grpo", tok.pad_token_id)

    def seq_logprob(row):
        with torch.no_grad():
            logits = engine.model(input_ids=batch.input_ids[row:row + 1]).logits[0, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[row, 1:, None])[:, 0]
        return float((lp * batch.loss_mask[row]).sum())

    good, bad = seq_logprob(0), seq_logprob(1)
    # Behaviour = current policy, so the importance weight is 1 and this is plain policy gradient.
    with torch.no_grad():
        logits = engine.model(input_ids=batch.input_ids).logits[:, :-1]
        batch.behaviour_logprobs = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    first = policy_update(engine, batch, UpdateConfig())
    assert first["importance_weight"] == pytest.approx(1.0, abs=1e-4)
    for _ in range(2):
        policy_update(engine, batch, UpdateConfig())
    assert seq_logprob(0) > good and seq_logprob(1) < bad


def test_opd_needs_teacher_feedback_and_uses_it():
    tok = build_tokenizer()
    engine = make_engine(build_model(tok, seed=0), lr=1e-2)
    plain = build_batch([[scored("a", 0, 1.0), scored("a", 1, 0.0)]], "grpo", tok.pad_token_id)
    with pytest.raises(ValueError, match="feedback"):
        policy_update(engine, plain, UpdateConfig(loss="opd"))
    fb = [[TeacherFeedback(scored("a", i, 1.0), "t1", [-0.1, 0.0, -0.2]) for i in range(2)]]
    batch = build_batch(fb, "grpo", tok.pad_token_id)
    assert batch.teacher_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, 0, -0.2])
    def student_lp():
        with torch.no_grad():
            logits = engine.model(input_ids=batch.input_ids).logits[:, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        return float((lp * batch.loss_mask).sum())

    before = student_lp()
    stats = policy_update(engine, batch, UpdateConfig(loss="opd"))
    # The teacher is far more confident than a random student: distillation raises the student's log-probs.
    assert stats["reverse_kl"] < 0 and student_lp() > before


def test_lr_warmup_ramps_linearly_then_holds_and_resumes_from_the_restored_step_count(tmp_path):
    from rlstream.trainer.engine import warmup_lr
    assert [warmup_lr(1e-4, s, 4) for s in (1, 2, 4, 9)] == pytest.approx([2.5e-5, 5e-5, 1e-4, 1e-4])
    assert warmup_lr(1e-4, 1, 0) == 1e-4
    torch.manual_seed(0)
    engine = make_engine(torch.nn.Linear(3, 1), lr=1e-2, lr_warmup_steps=4)
    seen = []
    for _ in range(3):
        engine.step(engine.model(torch.ones(2, 3)).sum())
        seen.append(engine.optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([2.5e-3, 5e-3, 7.5e-3])
    # A restart from the checkpointed optimizer state goes on with step 4, not back to step 1.
    resumed = make_engine(torch.nn.Linear(3, 1), lr=1e-2, lr_warmup_steps=4)
    from rlstream.trainer import shards
    manifest = shards.save(engine, str(tmp_path / "state"), "none", 1)  # as a version's training state
    shards.load(resumed, str(tmp_path / "state"), manifest, "none", 1)
    resumed.step(resumed.model(torch.ones(2, 3)).sum())
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
