"""The teacher's signal in the trainer: distillation alone (``--loss opd``) or with the reward (``ppo+opd``,
``ppo+opd-sum``), on either feedback form, with λ on a schedule over versions.

- ``opd``: the distillation KL alone.
- ``ppo+opd`` (slime): the per-token advantage becomes ``A_t - λ·KL_t`` (``KL_t`` the teacher KL at token t,
  detached) inside decoupled PPO: the teacher's signal is a dense per-token reward next to the sequence reward.
- ``ppo+opd-sum``: ``loss = PPO(A) + λ·KL``, a weighted sum of the two losses.

The form is the batch's: the top-k form where every sample carries the teacher's top-k (the exact KL over the k
tokens, ``losses.topk_kl``), else the sampled-token form (``losses.sampled_token_kl``). Each term goes into the
step's stats, and so into the PolicyVersion's metrics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlstream.models.logprobs import logprobs_at
from rlstream.schemas.records import MAX_TOP_K
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


# -- which feedback samples a step may take --------------------------------------------------------------------

def feedback_mismatch(fb) -> str | None:
    """Why ``fb``'s arrays do not fit its trajectory (both lengths named), or None when they do.

    A record with a teacher signal must carry one log-prob per token (and k per token in the top-k form); one
    without (a teacher that timed out) must carry none: a half-filled signal is never trained on.
    """
    n = len(fb.scored.trajectory.token_ids)
    k = fb.teacher_top_k
    if fb.status != "ok":
        filled = len(fb.teacher_logprobs) + len(fb.teacher_topk_ids) + len(fb.teacher_topk_logprobs)
        return (f"feedback with status {fb.status!r} carries {filled} teacher values; a sample without teacher "
                "feedback must carry none") if filled else None
    if len(fb.teacher_logprobs) != n:
        return (f"teacher_logprobs has {len(fb.teacher_logprobs)} entries but the trajectory has {n} tokens "
                f"(trajectory {fb.scored.trajectory.trajectory_id}, teacher {fb.teacher_version})")
    if not 0 <= k <= MAX_TOP_K:
        return f"teacher_top_k is {k}; it must be in [0, {MAX_TOP_K}]"
    for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
        got = len(getattr(fb, name))
        if got != n * k:
            return (f"{name} has {got} entries but the trajectory's {n} tokens x top-k {k} make {n * k} "
                    f"(trajectory {fb.scored.trajectory.trajectory_id}, teacher {fb.teacher_version})")
    return None


@dataclass(frozen=True)
class Admission:
    """What the trainer does with one feedback sample before the staleness check."""

    action: str  # take | skip (another teacher version: not this trainer's) | dead_letter | refuse
    reason: str = ""
    error: str = ""


TAKE = Admission("take")


def admit_feedback(fb, loss: str, teacher_version: str = "") -> Admission:
    """Whether a trainer with ``--loss`` ``loss`` (and ``--teacher-version``, '' = any) may train on ``fb``.

    Arrays that do not fit the trajectory go to dead letters; a sample without teacher feedback (status not ok)
    is refused when the loss needs the teacher, so its group completes without it.
    """
    if teacher_version and fb.teacher_version != teacher_version:
        return Admission("skip")
    problem = feedback_mismatch(fb)
    if problem is not None:
        return Admission("dead_letter", "invalid", problem)
    if fb.status != "ok" and uses_teacher(loss):
        return Admission("refuse", f"teacher_{fb.status}")
    return TAKE


def reverse_kl_bound_applies(fb, loss: str, cfg: DistillConfig) -> bool:
    """Whether ``fb`` is held to the reverse KL's own staleness bound (``--opd-reverse-eta``).

    Reverse KL on the sampled-token form takes ``log q(y) - log p(y)`` as the KL, which holds only when ``y`` was
    drawn from the current student: a stale sample biases it (AsyncOPD). Forward KL is weighted by the teacher
    over the behaviour policy, which corrects a stale sample; and the top-k form's reverse KL is recomputed over
    the k tokens under the current student. Those keep the loop's η.
    """
    return uses_teacher(loss) and cfg.kl in ("reverse", "mixed") and fb.teacher_top_k == 0
