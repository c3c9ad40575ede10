"""Token-level policy losses over padded batches.

Shapes: per-token tensors are ``[B, T]``; ``mask`` is 1 on model-generated action
tokens and 0 on prompt, observation and padding tokens. Stats are detached 0-dim tensors.
"""

from __future__ import annotations

import torch

__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "kl_penalty",
    "masked_mean",
    "opd_reverse_kl_loss",
    "ppo_clip_loss",
]

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "token-sum-norm")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is set; 0 when the mask is empty."""
    m = mask.bool()
    # where (not multiply) so inf/nan at padding cannot leak in as 0 * inf.
    return torch.where(m, values, 0).sum() / m.sum().clamp(min=1)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", max_tokens: int | None = None
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    - ``token-mean``: sum over all masked tokens / number of masked tokens.
    - ``seq-mean-token-sum``: per-sequence token sum, mean over the B sequences.
    - ``seq-mean-token-mean``: per-sequence token mean, mean over sequences with >= 1 token.
    - ``token-sum-norm`` (Dr. GRPO): per-sequence token sum / constant ``max_tokens``, mean
      over the B sequences; a constant normaliser avoids the length bias of per-sequence means.
    """
    m = mask.bool()
    x = torch.where(m, per_token, 0)
    if mode == "token-mean":
        return x.sum() / m.sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return x.sum(-1).mean()
    if mode == "seq-mean-token-mean":
        lengths = m.sum(-1)
        has_tokens = lengths > 0
        seq = x.sum(-1) / lengths.clamp(min=1)
        return seq[has_tokens].sum() / has_tokens.sum().clamp(min=1)
    if mode == "token-sum-norm":
        if not max_tokens or max_tokens <= 0:
            raise ValueError("aggregation 'token-sum-norm' needs a positive max_tokens")
        return x.sum(-1).mean() / max_tokens
    raise ValueError(f"unknown aggregation {mode!r}; valid: {list(AGGREGATIONS)}")


def ppo_clip_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_cap: float | None = 5.0,
    aggregation: str = "token-mean",
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (AReaL): clip against the proximal policy, reweight by a truncated IS weight.

    ``ratio = exp(logprobs - proximal)`` is clipped to ``[1 - clip_eps, 1 + clip_eps_high]``
    and the surrogate is multiplied by ``w = min(exp(proximal - behaviour), is_cap)`` (detached),
    which corrects for samples drawn by a stale behaviour policy. With ``proximal_logprobs=None``
    the behaviour policy is the proximal one (standard PPO, w = 1). ``is_cap=None`` disables
    truncation. ``advantages`` is ``[B]`` (per sequence) or ``[B, T]``. Gradients flow only
    through ``logprobs``. Returns ``(loss, stats)`` with clip_fraction, importance_weight,
    is_capped_fraction and approx_kl (k3 estimate of KL(proximal || current)).
    """
    m = mask.bool()
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    behaviour = behaviour_logprobs.detach()
    if proximal_logprobs is None:
        proximal = behaviour
        weight = torch.ones_like(logprobs, dtype=torch.float32)
        capped = torch.zeros_like(m)
    else:
        proximal = proximal_logprobs.detach()
        # Zero the log-gap at padding so exp() cannot overflow there.
        weight = torch.exp(torch.where(m, proximal - behaviour, 0).float())
        capped = weight > is_cap if is_cap is not None else torch.zeros_like(m)
        if is_cap is not None:
            weight = weight.clamp(max=is_cap)

    log_ratio = torch.where(m, logprobs - proximal, 0)
    ratio = torch.exp(log_ratio)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * adv
    per_token = -weight * torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, m, aggregation, max_tokens)

    with torch.no_grad():
        stats = {
            # Tokens whose gradient the clip removed.
            "clip_fraction": masked_mean((clipped < unclipped).float(), m),
            "importance_weight": masked_mean(weight, m),
            "is_capped_fraction": masked_mean(capped.float(), m),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, m),
        }
    return loss, stats


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Masked token-mean estimate of KL(policy || ref) from sampled tokens (Schulman's k1/k2/k3)."""
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - ref_logprobs.detach(), 0)
    if kind == "k1":
        per_token = log_ratio
    elif kind == "k2":
        per_token = 0.5 * log_ratio**2
    elif kind == "k3":
        # k3 = r - 1 - log r with r = ref / policy: unbiased and always >= 0.
        per_token = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: ['k1', 'k2', 'k3']")
    return masked_mean(per_token, m)


def opd_reverse_kl_loss(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """On-policy distillation (Thinking Machines; GKD-style) by per-token reverse KL.

    On tokens sampled from the student, ``adv = -(student_lp - teacher_lp)`` (detached) is a
    policy-gradient reward; ``loss = -token_mean(adv * student_lp)`` has the gradient of
    KL(student || teacher). Stats: ``reverse_kl``, the token-mean of ``student_lp - teacher_lp``.
    """
    m = mask.bool()
    gap = torch.where(m, student_logprobs.detach() - teacher_logprobs.detach(), 0)
    loss = -masked_mean(-gap * student_logprobs, m)
    return loss, {"reverse_kl": masked_mean(gap, m)}
