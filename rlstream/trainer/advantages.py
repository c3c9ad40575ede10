"""Group-relative advantage estimators.

Every estimator takes ``rewards`` of shape ``[B, G]``: B groups (one per prompt),
G sampled completions each, and returns advantages of the same shape.
Standard deviations are population ones (``unbiased=False``).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["ADVANTAGES", "compute_advantages", "dr_grpo", "grpo", "reinforce_pp", "rloo"]


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
