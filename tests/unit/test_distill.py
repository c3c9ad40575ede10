"""The distillation losses against hand-computed values, on both feedback forms, and the losses that combine the
teacher with the reward (trainer/distill.py) on a real tiny model."""
from __future__ import annotations

import math

import pytest
import torch

from rlstream.models.logprobs import logprobs_at, top_k
from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.schemas.records import TeacherFeedback
from rlstream.trainer.distill import DistillConfig, coef_at, distill_loss, teacher_terms
from rlstream.trainer.sharding import make_engine
from rlstream.trainer.losses import OUTSIDE_TOPK_LOG_FLOOR, masked_mean, sampled_token_kl, topk_kl
from rlstream.trainer.update import UpdateConfig, build_batch, policy_update
from tests.helpers.batches import scored


def close(t, expected, tol=1e-4):
    got = torch.as_tensor(t).detach().double().flatten().tolist()
    assert got == pytest.approx(torch.as_tensor(expected, dtype=torch.float64).flatten().tolist(), abs=tol)


# --- the sampled-token form ------------------------------------------------------------------------------------

S = [[-1.0, -2.0, -4.0]]  # the current student's log-probs of the sampled tokens
T = [[-1.5, -1.0, 0.0]]  # the teacher's
B = [[-1.0, -3.0, -1.0]]  # the behaviour policy's (which sampled them)
MASK = torch.tensor([[1, 1, 0]])


def sampled(direction, mix=0.5):
    s = torch.tensor(S, requires_grad=True)
    surrogate, kl = sampled_token_kl(s, torch.tensor(T), torch.tensor(B), MASK, direction, mix, is_cap=5.0)
    masked_mean(surrogate, MASK).backward()
    return s.grad, kl


def test_sampled_reverse_kl_hand_computed():
    grad, kl = sampled("reverse")
    close(kl, [[0.5, -1.0, 0.0]])  # s - t
    # (s - t) less the baseline, the behaviour policy's mean k1 mean(b - t) = (0.5 - 2) / 2 = -0.75, times
    # w = exp(s - b) = [1, e], over n = 2 tokens
    close(grad, [[1.25 / 2, -0.25 * math.e / 2, 0.0]])


def _expected_reverse_grad(theta, teacher_lp, behaviour_lp, is_cap):
    """The surrogate's gradient in expectation over tokens drawn from ``behaviour_lp``: every token of a small
    vocabulary as a row of its own, each row's per-token gradient weighted by its probability under the behaviour
    policy (exact, no sampling)."""
    theta = theta.clone().requires_grad_(True)
    v = theta.shape[0]
    s = torch.log_softmax(theta, -1).expand(v, v).gather(1, torch.arange(v)[:, None])  # [V, 1]: row y samples y
    surrogate, _ = sampled_token_kl(s, teacher_lp[:, None], behaviour_lp[:, None], torch.ones(v, 1), "reverse",
                                    is_cap=is_cap)
    (surrogate[:, 0] * behaviour_lp.exp()).sum().backward()
    return theta.grad


@pytest.mark.parametrize("stale", [False, True])
def test_sampled_reverse_kl_gradient_is_the_true_kl_gradient_on_fresh_and_stale_samples(stale):
    """The sampled reverse-KL surrogate is an unbiased estimate of grad KL(student || teacher) also when an older
    policy drew the tokens (η > 0): without the importance weight its expectation has a term c * E_b[grad log q]
    (c the mean per-token KL, several nats) that pushes the student away from what it sampled, and OPD alone
    collapsed (held-out 0.09 -> 0, KL 3.3 -> 5.2 nats a token, in 40 versions at η = 2)."""
    theta = torch.tensor([2.0, 0.5, -1.0, 0.0, 1.0])  # the student's logits at one position
    teacher_lp = torch.log_softmax(torch.tensor([-2.0, 3.0, 0.0, -1.0, -3.0]), -1)
    behaviour_lp = torch.log_softmax(theta + (torch.tensor([1.5, -1.0, 0.5, 0.0, -0.5]) if stale else 0), -1)
    reference = theta.clone().requires_grad_(True)
    q_log = torch.log_softmax(reference, -1)
    (q_log.exp() * (q_log - teacher_lp)).sum().backward()  # the exact KL(q || p) over the vocabulary
    got = _expected_reverse_grad(theta, teacher_lp, behaviour_lp, is_cap=None)
    assert got.tolist() == pytest.approx(reference.grad.tolist(), abs=1e-5)


def test_sampled_reverse_kl_gradient_ignores_a_constant_offset_of_the_teacher():
    """A teacher whose log-probs all move by a constant (the size of the per-token reward, not its shape) gives
    the same step: the reward's batch mean is its baseline."""
    s = torch.tensor(S, requires_grad=True)
    surrogate, _ = sampled_token_kl(s, torch.tensor(T), torch.tensor(B), MASK, "reverse")
    masked_mean(surrogate, MASK).backward()
    shifted = torch.tensor(S, requires_grad=True)
    surrogate, _ = sampled_token_kl(shifted, torch.tensor(T) - 7.0, torch.tensor(B), MASK, "reverse")
    masked_mean(surrogate, MASK).backward()
    close(shifted.grad, s.grad.tolist())


def test_sampled_forward_kl_is_weighted_by_the_teacher_over_the_behaviour_policy():
    grad, kl = sampled("forward")
    w = [math.exp(-0.5), 5.0]  # exp(t - b) = [e^-0.5, e^2], the second capped at 5
    close(kl, [[w[0] * -0.5, w[1] * 1.0, 0.0]])  # w * (t - s)
    close(grad, [[-w[0] / 2, -w[1] / 2, 0.0]])  # -w / n: every token the teacher likes is pushed up


def test_sampled_mixed_kl_weighs_the_two():
    _, fwd = sampled("forward")
    _, rev = sampled("reverse")
    grad, kl = sampled("mixed", mix=0.25)
    close(kl, (0.25 * fwd + 0.75 * rev).tolist())
    close(grad, [[0.25 * -math.exp(-0.5) / 2 + 0.75 * 0.625, 0.25 * -2.5 + 0.75 * -0.125 * math.e, 0.0]])


def test_a_stale_sample_changes_the_forward_weight_not_the_reverse_kl():
    """Reverse KL is taken on the current student's log-probs alone; forward KL's weight is the teacher's over
    the behaviour policy's, so the log-probs a stale sample carries correct it."""
    s, t = torch.tensor(S), torch.tensor(T)
    fresh_b, stale_b = torch.tensor(S), torch.tensor(B)
    _, rev_fresh = sampled_token_kl(s, t, fresh_b, MASK, "reverse")
    _, rev_stale = sampled_token_kl(s, t, stale_b, MASK, "reverse")
    assert torch.equal(rev_fresh, rev_stale)
    _, fwd_fresh = sampled_token_kl(s, t, fresh_b, MASK, "forward")
    _, fwd_stale = sampled_token_kl(s, t, stale_b, MASK, "forward")
    assert not torch.equal(fwd_fresh, fwd_stale)


def test_unknown_direction_and_mix_are_refused():
    with pytest.raises(ValueError, match="direction"):
        sampled_token_kl(torch.tensor(S), torch.tensor(T), torch.tensor(B), MASK, "sideways")
    with pytest.raises(ValueError, match="mix"):
        DistillConfig(kl="mixed", kl_mix=1.5)


# --- the top-k form --------------------------------------------------------------------------------------------

# One token, k = 2: the teacher puts 0.6 and 0.3 on its top two, the student 0.1 and 0.4 on the same two (and 0.5
# on the only other token of a 3-token vocabulary).
P_TOP, Q_TOP, Q_REST = [0.6, 0.3], [0.1, 0.4], 0.5


def topk(direction, zero_outside=False, mix=0.5):
    q = torch.tensor([[[math.log(x) for x in Q_TOP]]], requires_grad=True)
    p = torch.tensor([[[math.log(x) for x in P_TOP]]])
    neg_entropy = torch.tensor([[sum(x * math.log(x) for x in Q_TOP + [Q_REST])]])
    kl, stats = topk_kl(q, p, torch.ones(1, 1), direction, mix, zero_outside, neg_entropy)
    return kl, stats


def test_topk_renormalised_kl_hand_computed():
    p_hat, q_hat = [2 / 3, 1 / 3], [0.2, 0.8]
    fwd = sum(p * math.log(p / q) for p, q in zip(p_hat, q_hat))
    rev = sum(q * math.log(q / p) for p, q in zip(p_hat, q_hat))
    assert (fwd, rev) == pytest.approx((0.51083, 0.45959), abs=1e-4)
    close(topk("forward")[0], [[fwd]])
    close(topk("reverse")[0], [[rev]])
    kl, stats = topk("mixed", mix=0.3)
    close(kl, [[0.3 * fwd + 0.7 * rev]])
    close(stats["kl_forward"], fwd)
    close(stats["kl_reverse"], rev)


def test_topk_zero_outside_topk_hand_computed():
    p_hat = [2 / 3, 1 / 3]
    # Forward: the teacher is zero outside its k, so this is the exact KL over the whole vocabulary.
    fwd = sum(p * math.log(p / q) for p, q in zip(p_hat, Q_TOP))
    # Reverse: the k terms with the student's own probabilities, and its 0.5 outside against the floor.
    rev = sum(q * math.log(q / p) for p, q in zip(p_hat, Q_TOP)) + Q_REST * (math.log(Q_REST) - OUTSIDE_TOPK_LOG_FLOOR)
    close(topk("forward", zero_outside=True)[0], [[fwd]])
    close(topk("reverse", zero_outside=True)[0], [[rev]])
    assert rev > 6  # mass the teacher does not have is expensive


def test_topk_gradient_moves_the_student_towards_the_teacher():
    q = torch.tensor([[[math.log(x) for x in Q_TOP]]], requires_grad=True)
    p = torch.tensor([[[math.log(x) for x in P_TOP]]])
    kl, _ = topk_kl(q, p, torch.ones(1, 1), "forward")
    kl.sum().backward()
    # Forward KL's gradient in the renormalised logits: q^ - p^ = [0.2 - 2/3, 0.8 - 1/3].
    close(q.grad, [[[0.2 - 2 / 3, 0.8 - 1 / 3]]])


def test_logprobs_at_and_top_k_agree_with_log_softmax():
    logits = torch.randn(2, 3, 11)
    ids, lps = top_k(logits, 4)
    full = torch.log_softmax(logits, -1)
    assert torch.equal(ids, full.topk(4, -1).indices)
    close(lps, full.topk(4, -1).values.tolist(), 1e-6)
    close(logprobs_at(logits, ids, chunk_tokens=2), lps.tolist(), 1e-6)


# --- λ and the combined losses on a real tiny model -------------------------------------------------------------

def test_coef_schedule_is_constant_or_linear_over_versions():
    assert coef_at(50, 0.5) == 0.5
    assert coef_at(0, 1.0, 0.0, 10) == 1.0
    assert coef_at(5, 1.0, 0.0, 10) == pytest.approx(0.5)
    assert coef_at(30, 1.0, 0.2, 10) == pytest.approx(0.2)


def feedback_batch(tok, k: int = 0):
    """Two groups of two samples with the teacher's sampled-token log-probs, and its top-k when ``k``."""
    groups = []
    for g, rewards in (("a", (1.0, 0.0)), ("b", (0.0, 1.0))):
        group = []
        for i, r in enumerate(rewards):
            fb = TeacherFeedback(scored(g, i, r), "t1", [-0.1, 0.0, -0.2])
            if k:
                fb.teacher_top_k = k
                fb.teacher_topk_ids = [7 + j for j in range(k)] + [0] * k + [2 + j for j in range(k)]
                fb.teacher_topk_logprobs = [-0.1 - j for j in range(k)] + [0.0] * k + [-0.2 - j for j in range(k)]
            group.append(fb)
        groups.append(group)
    return build_batch(groups, "grpo", tok.pad_token_id)


def test_topk_feedback_is_laid_out_per_target_token():
    tok = build_tokenizer()
    batch = feedback_batch(tok, k=2)
    # Prompt (1 5 6) then response (7 8 2), mask (1 0 1): target t is token t + 1.
    assert batch.teacher_topk_ids.shape == (4, 5, 2)
    assert batch.teacher_topk_ids[0].tolist() == [[0, 0], [0, 0], [7, 8], [0, 0], [2, 3]]
    close(batch.teacher_topk_logprobs[0, 2], [-0.1, -1.1])


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("loss", ["ppo+opd", "ppo+opd-sum"])
def test_combined_losses_report_each_term(loss, k):
    tok = build_tokenizer()
    engine = make_engine(build_model(tok, seed=0), lr=1e-3)
    batch = feedback_batch(tok, k)
    batch.opd_coef = 0.5
    stats = policy_update(engine, batch, UpdateConfig(loss=loss))
    for key in ("loss_rl", "opd_kl", "opd_coef", "clip_fraction", "loss"):
        assert key in stats, stats
    assert stats["opd_coef"] == 0.5
    if loss == "ppo+opd-sum":
        assert stats["loss"] == pytest.approx(stats["loss_rl"] + 0.5 * stats["loss_opd"], rel=1e-4, abs=1e-6)
    else:
        assert stats["opd_shaping"] == pytest.approx(0.5 * stats["opd_kl"], rel=1e-4, abs=1e-6)
    if k:
        assert {"kl_forward", "kl_reverse", "teacher_top1_agreement"} <= set(stats)


def test_shaped_advantage_is_a_minus_lambda_kl_per_token():
    """ppo+opd with λ = 0 is PPO; with λ > 0 its loss moves by exactly λ·KL_t per token (ratio 1 before the step)."""
    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    batch = feedback_batch(tok)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids.roll(-1, 1)[..., None])[..., 0][:, :-1]
    batch.behaviour_logprobs = logp.detach()  # on-policy: ratio 1, weight 1, no clipping
    cfg = DistillConfig()
    batch.opd_coef = 0.0
    plain, _ = distill_loss("ppo+opd", logits, logp, batch, 0.2, 5.0, cfg)
    batch.opd_coef = 2.0
    shaped, _ = distill_loss("ppo+opd", logits, logp, batch, 0.2, 5.0, cfg)
    _, kl, _ = teacher_terms(logits, logp, batch, cfg, 5.0)
    # loss = -mean(ratio * (A - λ KL)) with ratio 1: shaping adds λ·mean(KL).
    assert float((shaped - plain).detach()) == pytest.approx(2.0 * float(masked_mean(kl, batch.loss_mask)), abs=1e-5)


@pytest.mark.parametrize("zero_outside", [False, True])
@pytest.mark.parametrize("direction", ["reverse", "forward", "mixed"])
def test_opd_on_the_topk_form_lowers_the_kl(direction, zero_outside):
    tok = build_tokenizer()
    engine = make_engine(build_model(tok, seed=0), lr=1e-2)
    batch = feedback_batch(tok, k=3)
    cfg = UpdateConfig(loss="opd", distill=DistillConfig(kl=direction, zero_outside_topk=zero_outside))
    first = policy_update(engine, batch, cfg)
    for _ in range(5):
        last = policy_update(engine, batch, cfg)
    assert last["opd_kl"] < first["opd_kl"]


def test_ppo_on_the_feedback_topic_trains_samples_without_feedback():
    """--loss ppo reads only the reward: a sample the teacher timed out on is a sample like any other."""
    tok = build_tokenizer()
    groups = [[TeacherFeedback(scored("a", 0, 1.0), "t1", [-0.1, 0.0, -0.2]),
               TeacherFeedback(scored("a", 1, 0.0), "t1", [], status="timeout")]]
    batch = build_batch(groups, "grpo", tok.pad_token_id)
    assert batch.teacher_logprobs.shape == batch.loss_mask.shape and batch.teacher_topk_ids is None
    stats = policy_update(make_engine(build_model(tok, seed=0), lr=1e-3), batch, UpdateConfig(loss="ppo"))
    assert stats["samples"] == 2
