"""One policy update from a batch of complete groups: tensors, advantages, loss, optimizer step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlstream.models.logprobs import pack_rows, token_logprobs, unpack_rows
from rlstream.schemas.records import ScoredTrajectory, TeacherFeedback
from rlstream.trainer.advantages import compute_advantages
from rlstream.trainer.losses import kl_penalty, opd_reverse_kl_loss, ppo_clip_loss


@dataclass
class Batch:
    """Right-padded sequences (prompt + response) with per-target-token masks and log-probs."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1], aligned with targets input_ids[:, 1:]
    behaviour_logprobs: torch.Tensor  # [B, L-1]
    teacher_logprobs: torch.Tensor | None  # [B, L-1]
    advantages: torch.Tensor  # [B]
    rewards: torch.Tensor  # [B]
    temperature: float

    def to(self, device: torch.device) -> "Batch":
        """This batch on ``device`` (the same tensors when they are there already)."""
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return Batch(move(self.input_ids), move(self.attention_mask), move(self.loss_mask),
                     move(self.behaviour_logprobs), move(self.teacher_logprobs), move(self.advantages),
                     move(self.rewards), self.temperature)


def build_batch(groups: list[list[ScoredTrajectory | TeacherFeedback]], advantage: str, pad_id: int) -> Batch:
    """Flatten complete groups into one padded batch; advantages are computed within each group."""
    samples = [s for group in groups for s in group]
    scored = [s.scored if isinstance(s, TeacherFeedback) else s for s in samples]
    rewards = torch.tensor([s.reward.total for s in scored], dtype=torch.float32)
    # One estimator call per group: an estimator may normalise over all it is given (reinforce_pp whitens).
    advantages = torch.cat([compute_advantages(advantage, r[None])[0] for r in rewards.split([len(g) for g in groups])])
    width = max(len(s.trajectory.task.prompt_token_ids) + len(s.trajectory.token_ids) for s in scored)
    ids, attn, mask, behaviour = [], [], [], []
    teacher = [] if isinstance(samples[0], TeacherFeedback) else None
    # Rows are padded as Python lists and become one tensor each: a tensor per row cost more than the rest.
    for s, sc in zip(samples, scored):
        traj = sc.trajectory
        prompt = traj.task.prompt_token_ids
        n, pad = len(prompt), width - len(prompt) - len(traj.token_ids)
        ids.append(prompt + traj.token_ids + [pad_id] * pad)
        attn.append([1] * (width - pad) + [0] * pad)
        mask.append([0] * n + traj.loss_mask + [0] * pad)
        behaviour.append([0.0] * n + traj.behaviour_logprobs + [0.0] * pad)
        if teacher is not None:
            teacher.append([0.0] * n + s.teacher_logprobs + [0.0] * pad)
    ids = torch.tensor(ids, dtype=torch.long)
    attn = torch.tensor(attn, dtype=torch.long)
    mask = torch.tensor(mask, dtype=torch.float32)
    behaviour = torch.tensor(behaviour, dtype=torch.float32)
    teacher = torch.tensor(teacher, dtype=torch.float32) if teacher is not None else None
    first = samples[0].scored.trajectory if isinstance(samples[0], TeacherFeedback) else samples[0].trajectory
    temperature = first.task.sampling.temperature or 1.0
    # Token t is predicted from position t-1: masks and log-probs shift by one against the logits.
    return Batch(ids, attn, mask[:, 1:], behaviour[:, 1:], teacher[:, 1:] if teacher is not None else None,
                 advantages, rewards, temperature)


@dataclass(frozen=True)
class UpdateConfig:
    loss: str = "ppo"  # ppo | opd
    clip_eps: float = 0.2
    is_cap: float = 5.0
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    packed: bool = False  # rows packed into one sequence, no padding computed (sequence_logprobs)


def _next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """Position t's target, token t + 1; the last position's (it predicts past the row) is a stand-in, dropped.

    Log-probs are taken over every position and the last column dropped from the small ``[B, L]`` result, not
    from the ``[B, L, V]`` logits: a slice of the logits is copied whole to be flattened, and its backward writes a
    zero-filled ``[B, L, V]`` gradient. Per-row log-softmax, so the kept values are the same to the bit.
    """
    return input_ids.roll(-1, dims=1)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits at ``temperature``; at 1 no division (x / 1 is x to the bit, and it cost a pass each way)."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def sequence_logprobs(forward, batch: Batch, packed: bool = False) -> torch.Tensor:
    """``[B, L-1]`` log-probs of each row's next tokens under ``forward`` (an engine's or a model's) at the batch's
    temperature: the rows side by side with their padding, or ``packed`` into one sequence without it
    (``models/logprobs.py``; a row's last token then predicts the next row's first, a position its loss mask
    excludes as it does the padding's)."""
    if packed:
        ids, positions, keep = pack_rows(batch.input_ids, batch.attention_mask)
        logits = forward(input_ids=ids, position_ids=positions, use_cache=False).logits
        return unpack_rows(token_logprobs(_tempered(logits, batch.temperature), _next_tokens(ids))[0], keep)[:, :-1]
    logits = forward(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(_tempered(logits, batch.temperature), _next_tokens(batch.input_ids))[:, :-1]


def policy_update(engine, batch: Batch, cfg: UpdateConfig, ref_model=None) -> dict[str, float]:
    """One gradient step on the whole batch at once, on any engine; returns scalar stats for PolicyVersion.metrics.

    (Micro-batches with gradient accumulation, and several ranks: ``trainer/microbatch.py``.)
    """
    engine.model.train()
    batch = batch.to(engine.device)
    loss, stats = batch_loss(engine, batch, cfg, ref_model)
    stats["grad_norm"] = engine.step(loss)
    engine.model.eval()
    stats["loss"] = float(loss.detach())
    stats["reward_mean"] = float(batch.rewards.mean())
    stats["samples"] = float(batch.input_ids.shape[0])
    return stats


def batch_loss(engine, batch: Batch, cfg: UpdateConfig, ref_model=None) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-mean loss of ``batch`` (over its loss-mask tokens) and its token-mean stats."""
    # Behaviour log-probs were sampled at this temperature, so the ratio must be taken at it too.
    logp = sequence_logprobs(engine.forward, batch, cfg.packed)
    stats: dict[str, float] = {}
    if cfg.loss == "opd":
        if batch.teacher_logprobs is None:
            raise ValueError("loss opd needs teacher feedback: point the trainer at the feedback topic")
        loss, s = opd_reverse_kl_loss(logp, batch.teacher_logprobs, batch.loss_mask)
    else:
        # One step per batch: the proximal policy is the current one before the step (decoupled PPO),
        # and the truncated weight exp(proximal - behaviour) corrects samples from older versions.
        loss, s = ppo_clip_loss(logp, logp.detach(), batch.behaviour_logprobs, batch.advantages,
                                batch.loss_mask, clip_eps=cfg.clip_eps, is_cap=cfg.is_cap)
    stats.update({k: float(v) for k, v in s.items()})
    if cfg.kl_coef > 0 and ref_model is not None:
        with torch.no_grad():
            ref_logp = sequence_logprobs(ref_model, batch, cfg.packed)
        kl = kl_penalty(logp, ref_logp, batch.loss_mask)
        loss = loss + cfg.kl_coef * kl
        stats["kl_ref"] = float(kl.detach())
    return loss, stats
