"""The teacher's signal in the trainer: distillation alone (``--loss opd``) or with the reward (``ppo+opd``,
``ppo+opd-sum``), on either feedback form, with λ on a schedule over versions.

- ``opd``: the distillation KL alone.
- ``ppo+opd`` (slime): the per-token advantage becomes ``A_t - λ·KL_t`` (``KL_t`` the teacher KL at token t,
  detached) inside decoupled PPO: the teacher's signal is a dense per-token reward next to the sequence reward.
- ``ppo+opd-sum``: ``loss = PPO(A) + λ·KL``, a weighted sum of the two losses.

The form is the batch's: the top-k form where every sample carries the teacher's top-k (the exact KL over the k
tokens, ``losses.topk_kl``), else the sampled-token form (``losses.sampled_token_kl``). Each term goes into the
step's stats, and so into the PolicyVersion's metrics.

Which samples a step may take (feedback that fits, the staleness bound per loss) is the gate's: ``trainer/gate.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlstream.models.logprobs import logprobs_at
from rlstream.trainer.losses import KL_DIRECTIONS, masked_mean, ppo_clip_loss, sampled_token_kl, topk_kl

#: ``--loss`` values.
LOSSES = ("ppo", "opd", "ppo+opd", "ppo+opd-sum")


@dataclass(frozen=True)
class DistillConfig:
    """How the teacher's signal is turned into a loss (the λ of a step rides on its batch: ``Batch.opd_coef``)."""

    kl: str = "reverse"  # reverse | forward | mixed
    kl_mix: float = 0.5  # the forward KL's weight in ``mixed``
    zero_outside_topk: bool = False  # top-k form: no renormalisation, terms outside the k are 0

    def __post_init__(self) -> None:
        if self.kl not in KL_DIRECTIONS:
            raise ValueError(f"--opd-kl {self.kl!r}: expected one of {', '.join(KL_DIRECTIONS)}")
        if not 0.0 <= self.kl_mix <= 1.0:
            raise ValueError(f"--opd-kl-mix must be in [0, 1], got {self.kl_mix}")


def uses_teacher(loss: str) -> bool:
    """Whether a ``--loss`` needs the teacher's signal on every sample."""
    return loss != "ppo"


def coef_at(version: int, start: float, end: float = -1.0, over_versions: int = 0) -> float:
    """λ at ``version``: constant ``start``, or linear from ``start`` at version 0 to ``end`` at ``over_versions``
    and ``end`` after (``end < 0`` or ``over_versions <= 0``: constant)."""
    if end < 0 or over_versions <= 0:
        return start
    frac = min(1.0, max(0, version) / over_versions)
    return start + (end - start) * frac


def teacher_terms(logits: torch.Tensor, logp: torch.Tensor, batch, cfg: DistillConfig, is_cap: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(surrogate, kl, stats)``: per-token ``[B, T]``; ``surrogate``'s gradient is the KL's, ``kl`` is detached.

    ``logits`` are the student's over all L positions at the batch's temperature, ``logp`` its ``[B, L-1]``
    log-probs of the sampled tokens.
    """
    if batch.teacher_logprobs is None:
        raise ValueError("this loss needs teacher feedback: point the trainer at the feedback topic "
                         "(--source feedback) and run the teacher stage")
    mask = batch.loss_mask
    if batch.teacher_topk_ids is None:
        surrogate, kl = sampled_token_kl(logp, batch.teacher_logprobs, batch.behaviour_logprobs, mask,
                                         cfg.kl, cfg.kl_mix, is_cap, batch.opd_baseline)
        stats = {"opd_kl": masked_mean(kl, mask)}
        if cfg.kl == "reverse":
            stats["reverse_kl"] = stats["opd_kl"]  # the name the sampled reverse KL has always had
        return surrogate, kl, stats
    # Gathered over all L positions (a slice of the [B, L, V] logits would be copied whole), the last dropped.
    ids = F.pad(batch.teacher_topk_ids, (0, 0, 0, 1))
    student = logprobs_at(logits, ids)[:, :-1]
    neg_entropy = _neg_entropy(logits)[:, :-1] if cfg.zero_outside_topk else None
    kl, stats = topk_kl(student, batch.teacher_topk_logprobs, mask, cfg.kl, cfg.kl_mix, cfg.zero_outside_topk,
                        neg_entropy)
    with torch.no_grad():
        stats["opd_kl"] = masked_mean(kl, mask)
        # Top-1 agreement: the student's most likely token is the teacher's.
        student_top1 = logits.detach().argmax(-1)[:, :-1]
        stats["teacher_top1_agreement"] = masked_mean((student_top1 == batch.teacher_topk_ids[..., 0]).float(), mask)
    return kl, kl.detach(), stats


def _neg_entropy(logits: torch.Tensor, chunk_tokens: int = 256) -> torch.Tensor:
    """``sum_v q log q`` at each position, over the whole vocabulary (chunked like ``token_logprobs``)."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_tokens):
        lsm = torch.log_softmax(chunk.float(), dim=-1)
        parts.append((lsm.exp() * lsm).sum(-1))
    return torch.cat(parts).view(logits.shape[:-1])


def distill_loss(loss: str, logits: torch.Tensor, logp: torch.Tensor, batch, clip_eps: float,
                 is_cap: float | None, cfg: DistillConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-mean loss of ``batch`` under ``--loss`` ``loss`` (one of ``opd``, ``ppo+opd``, ``ppo+opd-sum``)."""
    if loss not in LOSSES[1:]:
        raise ValueError(f"distill_loss: unknown loss {loss!r}; valid: {list(LOSSES[1:])}")
    mask = batch.loss_mask
    surrogate, kl, stats = teacher_terms(logits, logp, batch, cfg, is_cap)
    coef = float(batch.opd_coef)
    if loss == "opd":
        total = masked_mean(surrogate, mask)
        stats["loss_opd"] = total.detach()
    elif loss == "ppo+opd":
        adv = batch.advantages.detach()
        if adv.dim() == 1:
            adv = adv.unsqueeze(-1)
        shaped = adv - coef * kl
        total, ppo_stats = ppo_clip_loss(logp, logp.detach(), batch.behaviour_logprobs, shaped, mask,
                                         clip_eps=clip_eps, is_cap=is_cap)
        stats.update(ppo_stats)
        stats["loss_rl"] = total.detach()
        stats["opd_shaping"] = masked_mean(coef * kl, mask)  # the mean of what λ·KL took off the advantage
    else:
        rl, ppo_stats = ppo_clip_loss(logp, logp.detach(), batch.behaviour_logprobs, batch.advantages, mask,
                                      clip_eps=clip_eps, is_cap=is_cap)
        opd = masked_mean(surrogate, mask)
        total = rl + coef * opd
        stats.update(ppo_stats)
        stats["loss_rl"], stats["loss_opd"] = rl.detach(), opd.detach()
    if loss != "opd":
        stats["opd_coef"] = torch.tensor(coef)
    return total, {k: float(v) for k, v in stats.items()}
