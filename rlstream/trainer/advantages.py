"""Group-relative advantage estimators, and per-turn advantages from per-turn scores.

Every estimator takes ``rewards`` of shape ``[B, G]``: B groups (one per prompt),
G sampled completions each, and returns advantages of the same shape.
Standard deviations are population ones (``unbiased=False``).

A reward may also score each action turn (``Reward.turn_scores``); ``turn_advantages`` states the rule that turns
those into the advantage of each turn's tokens, and ``token_row`` lays a sample's advantages over its tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["ADVANTAGES", "compute_advantages", "dr_grpo", "grpo", "reinforce_pp", "rloo", "token_row",
           "turn_advantages"]


def _check(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, group_size], got {tuple(rewards.shape)}")
    # Integer rewards (e.g. 0/1 correctness) cannot take a mean in place.
    return rewards if rewards.is_floating_point() else rewards.to(torch.float32)


def grpo(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``, population std (unbiased=False)."""
    r = _check(rewards)
    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, unbiased=False, keepdim=True) + eps)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: ``r - mean_group``; no std normalisation (it biases toward easy/hard prompts)."""
    r = _check(rewards)
    return r - r.mean(-1, keepdim=True)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: ``r_i`` minus the mean of the other G-1 rewards of its group (needs G >= 2)."""
    r = _check(rewards)
    g = r.shape[-1]
    if g < 2:
        raise ValueError("rloo needs at least 2 samples per group")
    return r - (r.sum(-1, keepdim=True) - r) / (g - 1)


def reinforce_pp(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten with the global batch mean/std.

    The group mean removes per-prompt difficulty; global (not per-group) whitening keeps
    the scale comparable across prompts. Population std (unbiased=False).
    """
    centred = dr_grpo(rewards)
    return (centred - centred.mean()) / (centred.std(unbiased=False) + eps)


ADVANTAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}


def compute_advantages(name: str, rewards: torch.Tensor) -> torch.Tensor:
    """Apply the estimator registered under ``name`` to ``[B, G]`` rewards."""
    try:
        fn = ADVANTAGES[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGES)}") from None
    return fn(rewards)


def turn_advantages(sample_advantages: torch.Tensor, turn_scores: list[list[float]],
                    eps: float = 1e-6) -> list[list[float]]:
    """Per sample of one group, the advantage of each of its action turns' tokens (empty: no turn scores).

    The rule, here and nowhere else: the outcome advantage plus the normalised return-to-go of the turn scores
    (DeepSeekMath's process supervision, added to the estimator's outcome advantage)::

        A[i, k] = A_i + sum_{j >= k} (s[i, j] - mean) / (std + eps)

    ``A_i`` is sample i's advantage from its total (``sample_advantages[i]``, the group's estimator),
    ``s[i, j]`` the score of its j-th action turn, and ``mean`` / ``std`` (population) are over every turn score of
    the group, so a turn is credited for how it and the turns after it compare with the group's turns. A sample
    without turn scores gets ``A_i`` on all its tokens and adds nothing to ``mean`` / ``std``; a group whose turn
    scores are all equal adds nothing to any turn.
    """
    if len(turn_scores) != len(sample_advantages):
        raise ValueError(f"{len(turn_scores)} turn-score lists for {len(sample_advantages)} samples")
    flat = torch.tensor([v for scores in turn_scores for v in scores], dtype=torch.float64)
    if not len(flat):
        return [[] for _ in turn_scores]
    mean, std = flat.mean(), flat.std(unbiased=False)
    out = []
    for a, scores in zip(sample_advantages.tolist(), turn_scores):
        normalised = ((torch.tensor(scores, dtype=torch.float64) - mean) / (std + eps)).tolist()
        to_go, acc = [], 0.0
        for v in reversed(normalised):
            acc += v
            to_go.append(a + acc)
        out.append(to_go[::-1])
    return out


def token_row(sample_advantage: float, turn_advantages: list[float], spans: list[tuple[int, int]],
              offset: int, width: int) -> list[float]:
    """One row of a batch's per-token advantages: ``sample_advantage`` everywhere, and action turn k's advantage
    over its tokens ``[start, end)`` of ``spans`` (positions in the trajectory, shifted by ``offset``, the prompt).
    Positions outside the action turns are masked out of the loss; they carry the sample's advantage."""
    row = [sample_advantage] * width
    if turn_advantages:
        if len(turn_advantages) != len(spans):
            raise ValueError(f"{len(turn_advantages)} turn advantages for {len(spans)} action turns")
        for value, (start, end) in zip(turn_advantages, spans):
            row[offset + start:offset + end] = [value] * (end - start)
    return row
