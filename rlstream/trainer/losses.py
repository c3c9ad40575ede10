"""Token-level policy losses over padded batches.

Shapes: per-token tensors are ``[B, T]``; ``mask`` is 1 on model-generated action
tokens and 0 on prompt, observation and padding tokens. Stats are detached 0-dim tensors.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "KL_DIRECTIONS",
    "kl_penalty",
    "masked_mean",
    "opd_reverse_kl_loss",
    "ppo_clip_loss",
    "reverse_kl_baseline",
    "sampled_token_kl",
    "topk_kl",
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


#: Directions of the distillation KL: reverse KL(student || teacher), forward KL(teacher || student), or a mix.
KL_DIRECTIONS = ("reverse", "forward", "mixed")


def _check_direction(direction: str, mix: float) -> None:
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"unknown KL direction {direction!r}; valid: {list(KL_DIRECTIONS)}")
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"the mixed KL's forward weight must be in [0, 1], got {mix}")


def sampled_token_kl(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    direction: str = "reverse",
    mix: float = 0.5,
    is_cap: float | None = 5.0,
    baseline: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distillation on the sampled-token form (the teacher's log-prob of each token the student sampled).

    Returns ``(surrogate, kl)``, both ``[B, T]`` (0 outside ``mask``): the gradient of ``surrogate`` is the
    per-token KL's, and ``kl`` is the detached per-token estimate. With ``s`` the current student's log-prob
    (differentiable), ``t`` the teacher's and ``b`` the behaviour policy's that sampled the token:

    - reverse, KL(student || teacher): ``kl = s - t`` (k1 on a token sampled from the student). The surrogate is
      Thinking Machines' recipe, an importance-sampled policy gradient with the per-token reward ``t - s``
      (discount 0): ``surrogate = w * (kl - mean(kl)).detach() * s`` with ``w = min(exp(s - b), is_cap)``
      (detached). Both corrections are needed because the reward is large and one-signed (``s - t`` is a few
      nats on nearly every token): without ``w`` a token drawn by an older policy ``b`` gets
      ``E_b[kl * grad s]``, whose constant part ``c * E_b[grad s]`` no longer vanishes; it pushes the student
      away from whatever ``b`` sampled, which raises the entropy and the KL, which raises ``c``: OPD alone
      collapsed within 40 versions at η = 2. ``w`` turns the expectation into one under the current student
      (exact up to the cap), and the baseline takes the constant out of the reward, so the rest of the bias and
      most of the variance go with it (a baseline leaves the expected gradient unchanged). The baseline is one
      number for the whole step, ``reverse_kl_baseline`` of the step's batch (the behaviour policy's mean k1),
      never a micro-batch's own: micro-batches must sum to the whole batch's gradient. ``baseline`` None: that of
      the tensors given. The trainer still bounds the staleness (``--opd-reverse-eta``).
    - forward, KL(teacher || student): importance-weighted by the teacher, ``w = min(exp(t - b), is_cap)``
      (detached): ``kl = w * (t - s)``, ``surrogate = -w * s``. The weight uses the behaviour log-prob the sample
      carries, so a stale sample is corrected rather than biased.
    - mixed: ``mix * forward + (1 - mix) * reverse``.
    """
    _check_direction(direction, mix)
    m = mask.bool()
    s = student_logprobs
    t = teacher_logprobs.detach()
    zero = torch.zeros_like(s)
    b = behaviour_logprobs.detach()
    reverse_kl = torch.where(m, s.detach() - t, 0)
    if baseline is None:
        baseline = reverse_kl_baseline(b, t, m)
    reverse = (_capped_ratio(s.detach() - b, m, is_cap) * (reverse_kl - baseline) * s, reverse_kl)
    if direction == "reverse":
        return torch.where(m, reverse[0], zero), reverse[1]
    w = _capped_ratio(t - b, m, is_cap)
    forward = (-w * s, torch.where(m, w * (t - s.detach()), 0))
    if direction == "forward":
        return torch.where(m, forward[0], zero), forward[1]
    surrogate = mix * forward[0] + (1 - mix) * reverse[0]
    return torch.where(m, surrogate, zero), mix * forward[1] + (1 - mix) * reverse[1]


def reverse_kl_baseline(behaviour_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
                        ) -> torch.Tensor:
    """The sampled reverse KL's baseline for a step: the token-mean of ``b - t`` (k1 under the behaviour policy)."""
    return masked_mean(behaviour_logprobs.detach() - teacher_logprobs.detach(), mask)


def _capped_ratio(log_gap: torch.Tensor, mask: torch.Tensor, is_cap: float | None) -> torch.Tensor:
    """``min(exp(log_gap), is_cap)``, 1 outside ``mask`` (the gap is zeroed there so exp() cannot overflow)."""
    w = torch.exp(torch.where(mask, log_gap, 0).float())
    return w.clamp(max=is_cap) if is_cap is not None else w


#: log p of the teacher outside its top-k under ``zero_outside_topk`` in the reverse direction: log 0 would make any
#: student mass there an infinite loss; a floor makes it a large, finite one (NeMo-RL's choice too).
OUTSIDE_TOPK_LOG_FLOOR = math.log(1e-6)


def topk_kl(
    student_topk_logprobs: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    direction: str = "reverse",
    mix: float = 0.5,
    zero_outside_topk: bool = False,
    student_neg_entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token KL ``[B, T]`` on the top-k form, exact over the teacher's k tokens, differentiable in the student.

    ``student_topk_logprobs`` ``[B, T, K]`` are the current student's full-vocabulary log-probs of the teacher's
    top-k ids, ``teacher_topk_logprobs`` the teacher's. The student's side is recomputed by the trainer's own
    forward, so the reverse KL here is under the current student, however stale the sample. The teacher is
    renormalised over its k tokens (``p^``) in both options:

    - default: the student renormalised over the same k tokens too (``q^``): forward ``sum p^ log(p^/q^)``,
      reverse ``sum q^ log(q^/p^)``; both >= 0, and blind to the student's mass outside the k.
    - ``zero_outside_topk``: the teacher is zero outside its k tokens, the student keeps its whole vocabulary
      (``q``). Forward ``sum_k p^ log(p^/q)`` is then exact. Reverse is ``sum_k q log(q/p^)`` plus, for the
      student's mass outside the k, ``sum_rest q (log q - OUTSIDE_TOPK_LOG_FLOOR)``; that needs
      ``student_neg_entropy`` ``[B, T]``, the student's ``sum_v q log q`` over the whole vocabulary.

    Returns ``(kl, stats)``: the chosen direction's per-token KL (0 outside ``mask``), and the token-means of both
    directions (``kl_forward``, ``kl_reverse``) for the step metrics.
    """
    _check_direction(direction, mix)
    m = mask.bool()
    q_log = student_topk_logprobs.float()
    p_log = teacher_topk_logprobs.detach().float()
    p_log = p_log - torch.logsumexp(p_log, dim=-1, keepdim=True)
    if not zero_outside_topk:
        q_log = q_log - torch.logsumexp(q_log, dim=-1, keepdim=True)
    q = q_log.exp()
    forward = (p_log.exp() * (p_log - q_log)).sum(-1)
    reverse = (q * (q_log - p_log)).sum(-1)
    if zero_outside_topk:
        if student_neg_entropy is None:
            raise ValueError("topk_kl: zero_outside_topk needs the student's negative entropy over its vocabulary")
        rest_neg_entropy = student_neg_entropy.float() - (q * q_log).sum(-1)  # sum of q log q outside the k
        reverse = reverse + rest_neg_entropy - OUTSIDE_TOPK_LOG_FLOOR * (1 - q.sum(-1))
    chosen = {"forward": forward, "reverse": reverse}.get(direction)
    if chosen is None:
        chosen = mix * forward + (1 - mix) * reverse
    with torch.no_grad():
        stats = {"kl_forward": masked_mean(forward, m), "kl_reverse": masked_mean(reverse, m)}
    return torch.where(m, chosen, 0), stats


def opd_reverse_kl_loss(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """On-policy distillation (Thinking Machines; GKD-style) by per-token reverse KL on the sampled-token form.

    On tokens sampled from the current student, ``adv = -(student_lp - teacher_lp)`` (detached, less its
    token-mean: ``sampled_token_kl``) is a policy-gradient reward; ``loss = -token_mean(adv * student_lp)`` has
    the gradient of KL(student || teacher). Stats: ``reverse_kl``, the token-mean of ``student_lp - teacher_lp``.
    """
    surrogate, kl = sampled_token_kl(student_logprobs, teacher_logprobs, student_logprobs, mask, "reverse")
    return masked_mean(surrogate, mask), {"reverse_kl": masked_mean(kl, mask)}
