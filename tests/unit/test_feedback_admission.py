"""Which feedback samples a trainer takes: arrays that fit, no half-filled signal, teacher versions, and the
staleness bound per loss (reverse KL on sampled tokens has its own; forward KL and the top-k form keep η)."""
from __future__ import annotations

import pytest
import torch

from rlstream.config import LoopSettings
from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.schemas.records import TeacherFeedback
from rlstream.trainer.distill import DistillConfig, teacher_terms
from rlstream.trainer.gate import admit_feedback, feedback_mismatch
from rlstream.trainer.service import TrainerService, TrainerSettings
from rlstream.trainer.update import build_batch
from tests.helpers.batches import scored


def feedback(k: int = 0, status: str = "ok", n_lp: int = 3, version: str = "t1") -> TeacherFeedback:
    fb = TeacherFeedback(scored("a", 0, 1.0), version, [-0.5] * n_lp, status=status)
    if k:
        fb.teacher_top_k, fb.teacher_topk_ids, fb.teacher_topk_logprobs = k, [3] * (3 * k), [-1.0] * (3 * k)
    return fb


def test_arrays_that_fit_are_taken():
    assert feedback_mismatch(feedback()) is None
    assert feedback_mismatch(feedback(k=4)) is None
    assert admit_feedback(feedback(k=4), "opd").action == "take"


def test_a_short_array_is_dead_lettered_with_both_lengths():
    verdict = admit_feedback(feedback(n_lp=2), "opd")
    assert (verdict.action, verdict.reason) == ("dead_letter", "invalid")
    assert "2 entries" in verdict.error and "3 tokens" in verdict.error
    fb = feedback(k=2)
    fb.teacher_topk_logprobs = fb.teacher_topk_logprobs[:-1]
    verdict = admit_feedback(fb, "ppo")  # dead-lettered whatever the loss: the record is wrong
    assert verdict.action == "dead_letter" and "5 entries" in verdict.error and "make 6" in verdict.error


def test_a_sample_without_teacher_feedback_is_refused_only_by_a_loss_that_needs_it():
    timed_out = feedback(status="timeout", n_lp=0)
    assert admit_feedback(timed_out, "ppo").action == "take"
    for loss in ("opd", "ppo+opd", "ppo+opd-sum"):
        verdict = admit_feedback(timed_out, loss)
        assert (verdict.action, verdict.reason) == ("refuse", "teacher_timeout")
    # A half-filled signal is never trained on: a timed-out record with values is a bad record.
    assert admit_feedback(feedback(status="timeout", n_lp=3), "ppo").action == "dead_letter"


def test_another_teacher_version_is_skipped():
    assert admit_feedback(feedback(version="t2"), "opd", teacher_version="t1").action == "skip"
    assert admit_feedback(feedback(version="t1"), "opd", teacher_version="t1").action == "take"


def trainer(tmp_path, **knobs) -> TrainerService:
    return TrainerService(TrainerSettings(weights=str(tmp_path / "w"), source="feedback", **knobs),
                          LoopSettings(eta=2, groups_per_step=1))


@pytest.mark.parametrize("kl,k,accepted", [
    ("reverse", 0, False),  # sampled tokens from an older student: the k1 reverse KL is biased, refused past 0
    ("mixed", 0, False),
    ("forward", 0, True),  # weighted by the teacher over the behaviour log-probs: a stale sample is corrected
    ("reverse", 4, True),  # top-k form: the reverse KL is recomputed under the current student
])
def test_staleness_bound_per_loss(tmp_path, kl, k, accepted):
    svc = trainer(tmp_path, loss="opd", opd_kl=kl, opd_reverse_eta=0)
    # The trainer is at version 5; the sample is one version old (within η = 2).
    assert svc.gate._bound_for(feedback(k=k)).accepts(5, 4) is accepted
    assert svc.gate._bound_for(feedback(k=k)).accepts(5, 5)
    assert not svc.gate._bound_for(feedback(k=k)).accepts(5, 2)  # past η, whatever the loss


def test_reverse_bound_defaults_to_eta_and_ppo_ignores_it(tmp_path):
    assert trainer(tmp_path, loss="opd").gate._bound_for(feedback()).accepts(5, 3)
    assert trainer(tmp_path, loss="ppo", opd_reverse_eta=0).gate._bound_for(feedback()).accepts(5, 4)


def test_a_teacher_loss_without_the_feedback_topic_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--source feedback"):
        TrainerService(TrainerSettings(weights=str(tmp_path / "w"), loss="opd"), LoopSettings())


def test_topk_reverse_kl_is_computed_under_the_current_student():
    """The top-k form's reverse KL comes from the trainer's forward of the current model: change the model and the
    KL changes with it, with the same (stale) feedback and behaviour log-probs."""
    tok = build_tokenizer()
    fb = feedback(k=3)
    fb.teacher_topk_ids = [7, 8, 9, 0, 0, 0, 2, 3, 4]
    fb.teacher_topk_logprobs = [-0.2, -2.0, -3.0, 0, 0, 0, -0.1, -3.0, -4.0]
    batch = build_batch([[fb]], "grpo", tok.pad_token_id)
    cfg = DistillConfig(kl="reverse")

    def reverse_kl(model):
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids).logits
            logp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids.roll(-1, 1)[..., None])[..., 0][:, :-1]
            _, _, stats = teacher_terms(logits, logp, batch, cfg, 5.0)
            # By hand: renormalise the student's log-probs of the teacher's k ids at each masked target.
            q = torch.log_softmax(logits[0, :-1], -1).gather(-1, batch.teacher_topk_ids[0])
            q = q - torch.logsumexp(q, -1, keepdim=True)
            p = batch.teacher_topk_logprobs[0] - torch.logsumexp(batch.teacher_topk_logprobs[0], -1, keepdim=True)
            per_token = (q.exp() * (q - p)).sum(-1)
            by_hand = per_token[batch.loss_mask[0].bool()].mean()
        return float(stats["kl_reverse"]), float(by_hand)

    a = reverse_kl(build_model(tok, seed=0))
    b = reverse_kl(build_model(tok, seed=1))
    assert a[0] == pytest.approx(a[1], abs=1e-5) and b[0] == pytest.approx(b[1], abs=1e-5)
    assert a[0] != pytest.approx(b[0], abs=1e-4)
