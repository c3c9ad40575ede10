import math

import pytest
import torch

from rlstream.models.logprobs import token_logprobs
from rlstream.trainer.losses import aggregate, kl_penalty, opd_reverse_kl_loss, ppo_clip_loss

LN2 = math.log(2.0)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def on_policy(lp_values):
    """Current = proximal = behaviour, so ratio = 1 and w = 1."""
    lp = torch.tensor(lp_values, requires_grad=True)
    return lp, lp.detach().clone(), lp.detach().clone()


# --- ppo_clip_loss -----------------------------------------------------------

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
ADV = torch.tensor([2.0, -1.0])


@pytest.mark.parametrize(
    "aggregation, max_tokens, expected",
    [
        ("token-mean", None, -1.0),  # -(2 + 2 - 1) / 3
        ("seq-mean-token-sum", None, -1.5),  # (-4 + 1) / 2
        ("seq-mean-token-mean", None, -0.5),  # (-2 + 1) / 2
        ("token-sum-norm", 4, -0.375),  # (-4 + 1) / 2 / 4
    ],
)
def test_ppo_loss_is_minus_advantage_at_ratio_one(aggregation, max_tokens, expected):
    lp, prox, beh = on_policy([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    loss, stats = ppo_clip_loss(lp, prox, beh, ADV, MASK, aggregation=aggregation, max_tokens=max_tokens)
    close(loss, expected)
    close(stats["clip_fraction"], 0.0)
    close(stats["importance_weight"], 1.0)
    close(stats["approx_kl"], 0.0)


def test_token_sum_norm_equals_token_mean_at_full_length():
    lp, prox, beh = on_policy([[-1.0, -2.0], [-0.5, -0.7]])
    full = torch.ones(2, 2)
    a, _ = ppo_clip_loss(lp, prox, beh, ADV, full, aggregation="token-sum-norm", max_tokens=2)
    b, _ = ppo_clip_loss(lp, prox, beh, ADV, full, aggregation="token-mean")
    close(a, b.item())


def test_clipping_both_sides_for_both_signs():
    # One token per row: (ratio, advantage) pairs.
    ratios = torch.tensor([[1.5], [0.5], [0.5], [1.5]])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    prox = torch.zeros(4, 1)
    lp = ratios.log().requires_grad_()
    loss, stats = ppo_clip_loss(lp, prox, prox, adv, torch.ones(4, 1), clip_eps=0.2, aggregation="seq-mean-token-sum")
    # per token: -min(r A, clip(r, .8, 1.2) A)
    #  r=1.5 A=+1: -min(1.5, 1.2) = -1.2 (clipped)   r=0.5 A=+1: -min(.5, .8) = -0.5
    #  r=0.5 A=-1: -min(-.5, -.8) = 0.8 (clipped)    r=1.5 A=-1: -min(-1.5, -1.2) = 1.5
    close(loss, (-1.2 - 0.5 + 0.8 + 1.5) / 4)
    close(stats["clip_fraction"], 0.5)
    loss.backward()
    # d(-r A)/d logp = -r A on unclipped tokens, 0 on clipped ones; / 4 from the mean.
    close(lp.grad, [[0.0], [-0.5 / 4], [0.0], [1.5 / 4]])


def test_clip_eps_high_is_asymmetric():
    lp = torch.tensor([[math.log(1.5)], [math.log(0.5)]])
    prox = torch.zeros(2, 1)
    loss, _ = ppo_clip_loss(lp, prox, prox, torch.tensor([1.0, -1.0]), torch.ones(2, 1),
                            clip_eps=0.2, clip_eps_high=0.28, aggregation="seq-mean-token-sum")
    # -min(1.5, 1.28) = -1.28 ; -min(-0.5, -0.8) = 0.8
    close(loss, (-1.28 + 0.8) / 2)


def test_importance_weight_truncated_at_cap():
    lp = torch.zeros(1, 2, requires_grad=True)
    prox = torch.zeros(1, 2)
    beh = torch.tensor([[-math.log(10.0), -LN2]])  # w = 10 -> capped to 5, and w = 2
    loss, stats = ppo_clip_loss(lp, prox, beh, torch.tensor([1.0]), torch.ones(1, 2), is_cap=5.0)
    close(loss, -(5.0 + 2.0) / 2)
    close(stats["importance_weight"], 3.5)
    close(stats["is_capped_fraction"], 0.5)
    uncapped, _ = ppo_clip_loss(lp, prox, beh, torch.tensor([1.0]), torch.ones(1, 2), is_cap=None)
    close(uncapped, -(10.0 + 2.0) / 2)


def test_behaviour_equal_to_proximal_gives_weight_one():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.8]])
    adv = torch.tensor([0.7])
    decoupled, stats = ppo_clip_loss(lp, old, old, adv, torch.ones(1, 2))
    close(stats["importance_weight"], 1.0)
    close(stats["is_capped_fraction"], 0.0)
    standard, _ = ppo_clip_loss(lp, None, old, adv, torch.ones(1, 2))
    close(decoupled, standard.item())


def test_proximal_none_clips_against_behaviour():
    lp = torch.tensor([[math.log(1.5)]])
    loss, stats = ppo_clip_loss(lp, None, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))
    close(loss, -1.2)
    close(stats["clip_fraction"], 1.0)
    close(stats["approx_kl"], 0.5 - math.log(1.5))  # r - 1 - log r


def test_mask_excludes_tokens_even_garbage():
    lp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    prox = torch.tensor([[-1.0, -2.0, 50.0]])
    beh = torch.tensor([[-1.0, -2.0, float("-inf")]])
    adv = torch.tensor([[1.0, 1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = ppo_clip_loss(lp, prox, beh, adv, mask)
    close(loss, -1.0)
    assert all(torch.isfinite(v) for v in stats.values())
    loss.backward()
    close(lp.grad, [[-0.5, -0.5, 0.0]])


def test_empty_mask_gives_zero_not_nan():
    lp, prox, beh = on_policy([[-1.0, -2.0]])
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        loss, _ = ppo_clip_loss(lp, prox, beh, torch.tensor([1.0]), torch.zeros(1, 2), aggregation=agg)
        close(loss, 0.0)


def test_gradients_flow_only_through_logprobs():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    prox = torch.tensor([[-1.1, -1.9]], requires_grad=True)
    beh = torch.tensor([[-1.3, -1.7]], requires_grad=True)
    adv = torch.tensor([0.5], requires_grad=True)
    loss, stats = ppo_clip_loss(lp, prox, beh, adv, torch.ones(1, 2))
    loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    assert prox.grad is None and beh.grad is None and adv.grad is None
    assert not any(v.requires_grad for v in stats.values())


def test_bad_aggregation_arguments():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "token-sum-norm")


# --- kl_penalty --------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, expected",
    [("k1", LN2), ("k2", 0.5 * LN2**2), ("k3", 0.5 - 1 + LN2)],  # log r = ln 2 on every counted token
)
def test_kl_estimators_hand_computed(kind, expected):
    lp = torch.tensor([[LN2, LN2, 9.0]])
    ref = torch.tensor([[0.0, 0.0, 0.0]])
    close(kl_penalty(lp, ref, torch.tensor([[1, 1, 0]]), kind=kind), expected)


def test_kl_penalty_zero_when_equal_and_grad_through_policy_only():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    kl = kl_penalty(lp, ref, torch.ones(1, 2))
    close(kl, 0.0)
    kl_penalty(lp, ref - 0.5, torch.ones(1, 2)).backward()
    assert lp.grad is not None and ref.grad is None
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, torch.ones(1, 2), kind="k4")


# --- opd_reverse_kl_loss -----------------------------------------------------


def test_opd_hand_computed():
    student = torch.tensor([[-1.0, -2.0, -5.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = opd_reverse_kl_loss(student, teacher, mask)
    # gap = student - teacher = [0.5, -1], less its mean -0.25: [0.75, -0.75]; loss = mean(that * student)
    close(loss, (0.75 * -1.0 - 0.75 * -2.0) / 2)
    close(stats["reverse_kl"], -0.25)
    loss.backward()
    # d/d student = centred gap / n: pushes down tokens the student overrates, more than the batch does.
    close(student.grad, [[0.375, -0.375, 0.0]])
    assert teacher.grad is None


# --- token_logprobs ----------------------------------------------------------


def test_token_logprobs_hand_computed():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # softmax [1/4, 3/4] and [1/2, 1/2]
    out = token_logprobs(logits, torch.tensor([[1, 0]]))
    close(out, [[math.log(0.75), math.log(0.5)]])


def test_token_logprobs_chunked_matches_reference_in_float32():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 11, (2, 5), generator=g)
    out = token_logprobs(logits, targets, chunk_tokens=3)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32 and out.shape == (2, 5)
    close(out, ref.detach())
    out.sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape
