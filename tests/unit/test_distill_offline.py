"""The offline distillation probe's samples (benchmarks/distill_offline.py): a trainer Batch laid out as the loop's,
the student's tokens up to its first <eos>, the teacher's scores of exactly those tokens."""
from __future__ import annotations

import torch

from benchmarks.distill_offline import sample_step
from rlstream.models.logprobs import token_logprobs
from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.trainer.distill import DistillConfig
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.update import UpdateConfig, policy_update

PAIRS = [("abc>", "cba"), ("xyz>", "zyx")]


def _models():
    tok = build_tokenizer()
    return tok, build_model(tok, seed=0).eval(), build_model(tok, seed=1).eval()


def test_samples_are_masked_after_the_first_eos_and_scored_by_both_models():
    tok, student, teacher = _models()
    torch.manual_seed(0)
    b = sample_step(student, teacher, tok, PAIRS, group=4, temperature=1.0, k=5)
    n = len(tok(PAIRS[0][0])["input_ids"])
    assert b.input_ids.shape[0] == 8 and b.loss_mask.shape == b.behaviour_logprobs.shape == b.teacher_logprobs.shape
    assert not b.loss_mask[:, : n - 1].any()  # prompt targets are never trained on
    for row, mask in zip(b.input_ids, b.loss_mask):
        acted = row[1:][mask.bool()].tolist()
        # The student's tokens end at its first <eos> (or the task's 4 new tokens); nothing after it is masked in.
        assert tok.eos_token_id not in acted[:-1] and 1 <= len(acted) <= 4
        assert (row[n + len(acted):] == tok.pad_token_id).all()
    with torch.no_grad():
        ids = b.input_ids
        want_s = token_logprobs(student(input_ids=ids, attention_mask=b.attention_mask).logits[:, :-1].float(),
                                ids[:, 1:]) * b.loss_mask
        want_t = token_logprobs(teacher(input_ids=ids, attention_mask=b.attention_mask).logits[:, :-1].float(),
                                ids[:, 1:]) * b.loss_mask
    assert torch.allclose(b.behaviour_logprobs, want_s, atol=1e-5)
    assert torch.allclose(b.teacher_logprobs, want_t, atol=1e-5)
    assert b.teacher_topk_ids.shape == (*b.loss_mask.shape, 5)
    # The top-k is the teacher's, most likely first.
    assert (b.teacher_topk_logprobs[..., :-1] >= b.teacher_topk_logprobs[..., 1:]).all()
    # An untrained student gets the reverse task wrong: zero rewards, zero GRPO advantages.
    assert b.rewards.tolist() == [0.0] * 8 and not b.advantages.any()


def test_a_forward_kl_step_on_the_whole_distribution_brings_the_student_closer_to_the_teacher():
    tok, student, teacher = _models()
    torch.manual_seed(0)
    b = sample_step(student, teacher, tok, PAIRS, group=4, temperature=1.0, k=len(tok))
    engine = TorchEngine(student, 1e-3, 1.0)
    cfg = UpdateConfig(loss="opd", distill=DistillConfig(kl="forward"))
    first = policy_update(engine, b, cfg)["kl_forward"]
    for _ in range(4):
        last = policy_update(engine, b, cfg)["kl_forward"]
    assert last < first
