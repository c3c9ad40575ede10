"""One policy update from a batch of complete groups: tensors, advantages, loss, optimizer step."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from rlstream.models.logprobs import pack_rows, token_logprobs, unpack_rows
from rlstream.schemas.records import ScoredTrajectory, TeacherFeedback
from rlstream.trainer.advantages import compute_advantages, token_row, turn_advantages
from rlstream.trainer.distill import DistillConfig, distill_loss
from rlstream.trainer.losses import kl_penalty, ppo_clip_loss


@dataclass
class Batch:
    """Right-padded sequences (prompt + response) with per-target-token masks and log-probs."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1], aligned with targets input_ids[:, 1:]
    behaviour_logprobs: torch.Tensor  # [B, L-1]
    teacher_logprobs: torch.Tensor | None  # [B, L-1]
    advantages: torch.Tensor  # [B, L-1], per target token (per-turn scores make them differ within a row)
    rewards: torch.Tensor  # [B]
    temperature: float
    # The top-k form of the teacher's feedback, where every sample carries it (trainer/distill.py).
    teacher_topk_ids: torch.Tensor | None = None  # [B, L-1, K]
    teacher_topk_logprobs: torch.Tensor | None = None  # [B, L-1, K]
    opd_coef: float = 1.0  # λ of this step (the trainer sets it from its version's schedule)
    # The sampled reverse KL's baseline over the whole step (losses.reverse_kl_baseline), set before the batch is
    # split into micro-batches; None: each loss call takes that of its own tensors (the whole batch, unsplit).
    opd_baseline: torch.Tensor | None = None

    def to(self, device: torch.device) -> "Batch":
        """This batch on ``device`` (the same tensors when they are there already)."""
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return Batch(move(self.input_ids), move(self.attention_mask), move(self.loss_mask),
                     move(self.behaviour_logprobs), move(self.teacher_logprobs), move(self.advantages),
                     move(self.rewards), self.temperature, move(self.teacher_topk_ids),
                     move(self.teacher_topk_logprobs), self.opd_coef, move(self.opd_baseline))


def build_batch(groups: list[list[ScoredTrajectory | TeacherFeedback]], advantage: str, pad_id: int) -> Batch:
    """Flatten complete groups into one padded batch; advantages are computed within each group."""
    samples = [s for group in groups for s in group]
    scored = [s.scored if isinstance(s, TeacherFeedback) else s for s in samples]
    rewards = torch.tensor([s.reward.total for s in scored], dtype=torch.float32)
    per_sample, per_turn = _advantages(scored, [len(g) for g in groups], rewards, advantage)
    width = max(len(s.trajectory.task.prompt_token_ids) + len(s.trajectory.token_ids) for s in scored)
    ids, attn, mask, behaviour, adv = [], [], [], [], []
    teacher = [] if isinstance(samples[0], TeacherFeedback) else None
    # Rows are padded as Python lists and become one tensor each: a tensor per row cost more than the rest.
    for i, (s, sc) in enumerate(zip(samples, scored)):
        traj = sc.trajectory
        prompt = traj.task.prompt_token_ids
        n, pad = len(prompt), width - len(prompt) - len(traj.token_ids)
        ids.append(prompt + traj.token_ids + [pad_id] * pad)
        attn.append([1] * (width - pad) + [0] * pad)
        mask.append([0] * n + traj.loss_mask + [0] * pad)
        behaviour.append([0.0] * n + traj.behaviour_logprobs + [0.0] * pad)
        adv.append(token_row(per_sample[i], per_turn[i],
                             [(t.token_start, t.token_end) for t in traj.turns if t.role == "action"], n, width))
        if teacher is not None:
            # A sample without feedback (status timeout) reaches a batch only under a loss that ignores the teacher.
            teacher.append([0.0] * n + (s.teacher_logprobs or [0.0] * len(traj.token_ids)) + [0.0] * pad)
    ids = torch.tensor(ids, dtype=torch.long)
    attn = torch.tensor(attn, dtype=torch.long)
    mask = torch.tensor(mask, dtype=torch.float32)
    behaviour = torch.tensor(behaviour, dtype=torch.float32)
    teacher = torch.tensor(teacher, dtype=torch.float32) if teacher is not None else None
    first = samples[0].scored.trajectory if isinstance(samples[0], TeacherFeedback) else samples[0].trajectory
    temperature = first.task.sampling.temperature or 1.0
    topk_ids, topk_lps = _teacher_topk(samples, scored, width) if teacher is not None else (None, None)
    # Token t is predicted from position t-1: masks and log-probs shift by one against the logits.
    return Batch(ids, attn, mask[:, 1:], behaviour[:, 1:], teacher[:, 1:] if teacher is not None else None,
                 torch.tensor(adv, dtype=torch.float32)[:, 1:], rewards, temperature, topk_ids, topk_lps)


def _advantages(scored: list[ScoredTrajectory], sizes: list[int], rewards: torch.Tensor,
                advantage: str) -> tuple[list[float], list[list[float]]]:
    """Per sample: its advantage from its total, and its action turns' advantages (empty without turn scores)."""
    # One estimator call per group: an estimator may normalise over all it is given (reinforce_pp whitens).
    per_sample = [compute_advantages(advantage, r[None])[0] for r in rewards.split(sizes)]
    per_turn, start = [], 0
    for a, size in zip(per_sample, sizes):
        per_turn += turn_advantages(a, [s.reward.turn_scores for s in scored[start:start + size]])
        start += size
    return torch.cat(per_sample).tolist(), per_turn


def _teacher_topk(samples: list[TeacherFeedback], scored: list[ScoredTrajectory], width: int):
    """The top-k form as ``[B, L-1, K]`` tensors, K the smallest k in the batch (each sample's first K are its top
    K: they are stored most likely first); (None, None) when a sample has none."""
    k = min(s.teacher_top_k for s in samples)
    if k <= 0:
        return None, None
    ids = torch.zeros((len(samples), width, k), dtype=torch.long)
    lps = torch.zeros((len(samples), width, k), dtype=torch.float32)
    for row, (s, sc) in enumerate(zip(samples, scored)):
        start, n = len(sc.trajectory.task.prompt_token_ids), len(sc.trajectory.token_ids)
        ids[row, start:start + n] = torch.tensor(s.teacher_topk_ids, dtype=torch.long).view(n, -1)[:, :k]
        lps[row, start:start + n] = torch.tensor(s.teacher_topk_logprobs, dtype=torch.float32).view(n, -1)[:, :k]
    return ids[:, 1:], lps[:, 1:]


@dataclass(frozen=True)
class UpdateConfig:
    loss: str = "ppo"  # ppo | opd | ppo+opd | ppo+opd-sum (trainer/distill.py)
    clip_eps: float = 0.2
    is_cap: float = 5.0
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    distill: DistillConfig = DistillConfig()
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


def sequence_logprobs(forward, batch: Batch, packed: bool = False, with_logits: bool = False):
    """``[B, L-1]`` log-probs of each row's next tokens under ``forward`` (an engine's or a model's) at the batch's
    temperature: the rows side by side with their padding, or ``packed`` into one sequence without it
    (``models/logprobs.py``; a row's last token then predicts the next row's first, a position its loss mask
    excludes as it does the padding's). ``with_logits``: also the tempered ``[B, L, V]`` logits in the rows' padded
    layout (else None), for losses that read the whole distribution.

    Without ``with_logits`` only the positions some row's loss mask counts get logits (``logits_to_keep``, where the
    model takes it): the prompt's positions are computed through the layers, which the loss's gradient needs, but
    not through the vocabulary head and its log-softmax, which nothing reads there. Positions no row counts get
    log-prob 0 (every loss and statistic reads log-probs through the mask). On SmolLM2-135M (vocabulary 49,152, prompts
    of 60 tokens before 48-96 new ones) a CPU training step was 1.07x faster for it (benchmarks/trainer_step_cpu);
    the kept values are the same computation on the same hidden states, so equal to the last bits a matmul's shape
    allows."""
    keep_positions = not with_logits and _takes_logits_to_keep(forward)
    if packed:
        ids, positions, keep = pack_rows(batch.input_ids, batch.attention_mask)
        targets = _next_tokens(ids)
        if keep_positions:
            # The packed positions whose next token some loss counts: the [B, L-1] mask, back in row layout, packed.
            counted = torch.cat([batch.loss_mask, batch.loss_mask.new_zeros((keep.shape[0], 1))], dim=1)
            at = counted[keep].nonzero().squeeze(-1)
            out = forward(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=at)
            flat = torch.zeros(ids.shape[1], dtype=torch.float32, device=ids.device)
            flat[at] = token_logprobs(_tempered(out.logits, batch.temperature), targets[:, at])[0]
            return unpack_rows(flat, keep)[:, :-1], None
        tempered = _tempered(forward(input_ids=ids, position_ids=positions, use_cache=False).logits, batch.temperature)
        logp = unpack_rows(token_logprobs(tempered, targets)[0], keep)[:, :-1]
        if not with_logits:
            return logp, None
        rows = tempered.new_zeros((*keep.shape, tempered.shape[-1]))
        rows[keep] = tempered[0]
        return logp, rows
    if keep_positions:
        at = batch.loss_mask.bool().any(0).nonzero().squeeze(-1)
        out = forward(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=at)
        logp = torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=batch.input_ids.device)
        logp[:, at] = token_logprobs(_tempered(out.logits, batch.temperature), batch.input_ids[:, at + 1])
        return logp, None
    logits = forward(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    tempered = _tempered(logits, batch.temperature)
    return token_logprobs(tempered, _next_tokens(batch.input_ids))[:, :-1], tempered if with_logits else None


def _takes_logits_to_keep(forward) -> bool:
    """Whether the model behind ``forward`` (a module, or an engine's bound ``forward`` whose ``model`` is one)
    takes transformers' ``logits_to_keep``: every causal LM of transformers does, a wrapper (DDP, DeepSpeed, PEFT)
    passes it on through its keyword arguments; a hand-written module may not."""
    model = forward if isinstance(forward, torch.nn.Module) else getattr(getattr(forward, "__self__", None), "model",
                                                                          None)
    if not isinstance(model, torch.nn.Module):
        return False
    params = inspect.signature(model.forward).parameters
    return "logits_to_keep" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


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
    # The distillation losses read the student's whole distribution (the teacher's top-k tokens), PPO its log-probs.
    logp, tempered = sequence_logprobs(engine.forward, batch, cfg.packed, with_logits=cfg.loss != "ppo")
    stats: dict[str, float] = {}
    if cfg.loss != "ppo":
        loss, s = distill_loss(cfg.loss, tempered, logp, batch, cfg.clip_eps,
                               cfg.is_cap, cfg.distill)
    else:
        # One step per batch: the proximal policy is the current one before the step (decoupled PPO),
        # and the truncated weight exp(proximal - behaviour) corrects samples from older versions.
        loss, s = ppo_clip_loss(logp, logp.detach(), batch.behaviour_logprobs, batch.advantages,
                                batch.loss_mask, clip_eps=cfg.clip_eps, is_cap=cfg.is_cap)
    stats.update({k: float(v) for k, v in s.items()})
    if cfg.kl_coef > 0 and ref_model is not None:
        with torch.no_grad():
            ref_logp, _ = sequence_logprobs(ref_model, batch, cfg.packed)
        kl = kl_penalty(logp, ref_logp, batch.loss_mask)
        loss = loss + cfg.kl_coef * kl
        stats["kl_ref"] = float(kl.detach())
    return loss, stats
