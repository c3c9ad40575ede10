import math

import pytest
import torch

from rlstream.trainer.advantages import ADVANTAGES, compute_advantages, dr_grpo, grpo, reinforce_pp, rloo


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_grpo_hand_computed():
    close(grpo(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0), [[1.0, -1.0, -1.0, 1.0]])
    # mean 2, population std sqrt(2/3): 1 / sqrt(2/3) = sqrt(1.5) = 1.224745
    s = math.sqrt(1.5)
    close(grpo(torch.tensor([[3.0, 1.0, 2.0]]), eps=0.0), [[s, -s, 0.0]])


def test_grpo_default_eps_is_tiny_and_constant_group_is_zero():
    close(grpo(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[1.0, -1.0, -1.0, 1.0]])
    # All-equal rewards carry no signal: zeros, not NaN.
    close(grpo(torch.tensor([[1.0, 1.0, 1.0]])), [[0.0, 0.0, 0.0]])


def test_dr_grpo_hand_computed():
    close(dr_grpo(torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])),
          [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])


def test_rloo_hand_computed():
    # 1 - (0 + 0 + 1) / 3 = 2/3 ; 0 - (1 + 0 + 1) / 3 = -2/3
    close(rloo(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    # 3 - 1.5, 1 - 2.5, 2 - 2
    close(rloo(torch.tensor([[3.0, 1.0, 2.0]])), [[1.5, -1.5, 0.0]])


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError):
        rloo(torch.tensor([[1.0]]))


def test_reinforce_pp_whitens_globally_not_per_group():
    # centred [[.5, -.5], [1, -1]]; global mean 0, population std sqrt(2.5 / 4) = 0.790569
    out = reinforce_pp(torch.tensor([[1.0, 0.0], [3.0, 1.0]]), eps=0.0)
    sd = math.sqrt(0.625)
    close(out, [[0.5 / sd, -0.5 / sd], [1 / sd, -1 / sd]])
    # GRPO would give both groups the same [1, -1].
    close(grpo(torch.tensor([[1.0, 0.0], [3.0, 1.0]]), eps=0.0), [[1.0, -1.0], [1.0, -1.0]])


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_advantages_sum_to_zero_per_group(name):
    rewards = torch.rand(6, 8, generator=torch.Generator().manual_seed(0))
    out = compute_advantages(name, rewards)
    assert out.shape == rewards.shape
    torch.testing.assert_close(out.sum(-1), torch.zeros(6), atol=1e-5, rtol=0)


def test_integer_rewards_are_accepted():
    close(dr_grpo(torch.tensor([[1, 0]])), [[0.5, -0.5]])


def test_registry_and_unknown_name():
    assert set(ADVANTAGES) == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}
    with pytest.raises(ValueError, match="grpo.*rloo"):
        compute_advantages("ppo", torch.zeros(1, 2))


def test_wrong_shape_rejected():
    with pytest.raises(ValueError):
        grpo(torch.zeros(4))
