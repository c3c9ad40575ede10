"""A step's batch as micro-batches under a token budget, spread over the ranks, with gradients accumulated into one
optimizer step that equals the whole batch's.

The loss is a token-mean over the whole batch's loss-mask tokens. A micro-batch's loss is a token-mean over its own,
so it is weighted by its share of the batch's tokens: the weighted sum is the whole-batch loss, and so is the sum of
the gradients (exactly, in exact arithmetic; to float rounding in practice). Across ranks the engines average the
gradients, so each rank's share is multiplied by the world size to make that average the sum.

Every rank holds the whole batch (rank 0 broadcasts it, ``trainer/distributed.py``) and plans the same split, so
the ranks need no exchange to agree on who trains what; each trains its own micro-batches.
"""
from __future__ import annotations

import dataclasses

import torch

from rlstream.models.logprobs import pack_by_length
from rlstream.trainer.losses import reverse_kl_baseline
from rlstream.trainer.update import Batch, UpdateConfig, batch_loss, policy_update


def rows_of(batch: Batch, rows: list[int]) -> Batch:
    """The given rows of ``batch``, trimmed to the longest of them (the rest of each row is right padding)."""
    index = torch.tensor(rows, dtype=torch.long)
    width = int(batch.attention_mask[index].sum(-1).max())
    cut = lambda t, w: t[index, :w] if t is not None else None  # noqa: E731
    return Batch(cut(batch.input_ids, width), cut(batch.attention_mask, width), cut(batch.loss_mask, width - 1),
                 cut(batch.behaviour_logprobs, width - 1), cut(batch.teacher_logprobs, width - 1),
                 cut(batch.advantages, width - 1), batch.rewards[index], batch.temperature,
                 cut(batch.teacher_topk_ids, width - 1), cut(batch.teacher_topk_logprobs, width - 1), batch.opd_coef,
                 batch.opd_baseline)


def plan(batch: Batch, max_tokens: int, world: int = 1, packed: bool = False) -> list[list[list[int]]]:
    """Each rank's micro-batches, as lists of row indices.

    Rows are sorted by length (longest first) so a micro-batch pads little, and packed greedily while its padded
    size (rows x its longest row; its tokens alone where rows are ``packed`` into one sequence) stays within
    ``max_tokens``; a row longer than the budget is a micro-batch alone
    (a sequence is not cut). ``max_tokens`` 0 is no budget: one micro-batch per rank. Micro-batches go to the ranks
    round-robin, and are halved until every rank has one where there are rows enough; a rank left without one
    trains none (``accumulated_update`` runs zero-weight passes to match the busiest rank's count).
    """
    lengths = batch.attention_mask.sum(-1).tolist()
    if max_tokens <= 0:
        order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
        micro = [c for c in (order[i::world] for i in range(world)) if c]
    else:
        micro = pack_by_length(lengths, max_tokens, packed)
        while len(micro) < world and any(len(m) > 1 for m in micro):
            biggest = max(range(len(micro)), key=lambda i: len(micro[i]))
            rows = micro.pop(biggest)
            micro[biggest:biggest] = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
    return [micro[r::world] for r in range(world)]


def accumulated_update(engine, batch: Batch, cfg: UpdateConfig, ref_model=None, max_tokens: int = 0,
                       rank: int = 0, world: int = 1) -> dict[str, float]:
    """One optimizer step from this rank's micro-batches of ``batch``; every rank calls it with the same batch.

    Returns the whole batch's stats on every rank (summed across ranks when there are several).
    """
    engine.model.train()
    batch = batch.to(engine.device)
    if batch.teacher_logprobs is not None and batch.opd_baseline is None:
        # One baseline for the whole step, as the unsplit batch's loss takes it (losses.sampled_token_kl).
        batch = dataclasses.replace(batch, opd_baseline=reverse_kl_baseline(
            batch.behaviour_logprobs, batch.teacher_logprobs, batch.loss_mask))
    planned = plan(batch, max_tokens, world, cfg.packed)
    mine = planned[rank]
    total = float(batch.loss_mask.sum().clamp(min=1))
    # Every rank runs as many passes as the busiest one, the extra ones weighted 0: each forward and backward is a
    # collective where parameters are sharded (ZeRO-3, FSDP2), and the gradient reduction happens on every rank.
    passes = [(rows, 1.0) for rows in mine] + [([0], 0.0)] * (max(1, max(map(len, planned))) - len(mine))
    engine.zero_grad()
    sums: dict[str, float] = {}
    for i, (rows, keep) in enumerate(passes):
        micro = rows_of(batch, rows)
        share = keep * float(micro.loss_mask.sum()) / total
        with engine.accumulating(last=i == len(passes) - 1):
            loss, stats = batch_loss(engine, micro, cfg, ref_model)
            engine.backward(loss * (share * world))
        stats["loss"] = float(loss.detach())
        for k, v in stats.items():  # each is a token-mean over the micro-batch: weighted, they sum to the batch's
            sums[k] = sums.get(k, 0.0) + v * share
    if world > 1:
        import torch.distributed as dist
        keys = sorted(sums)
        summed = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=engine.device)
        dist.all_reduce(summed)
        sums = dict(zip(keys, summed.tolist()))
    sums["grad_norm"] = engine.optimizer_step()
    engine.model.eval()
    sums["reward_mean"] = float(batch.rewards.mean())
    sums["samples"] = float(batch.input_ids.shape[0])
    return sums


def train_step(engine, batch: Batch, cfg: UpdateConfig, ref_model=None, max_tokens: int = 0, rank: int = 0,
               world: int = 1) -> dict[str, float]:
    """The step a trainer takes: one rank and no budget is the whole-batch ``policy_update`` (the default, and the
    same to the bit as before micro-batches existed); otherwise micro-batches accumulated over the ranks."""
    if max_tokens <= 0 and world == 1:
        return policy_update(engine, batch, cfg, ref_model)
    return accumulated_update(engine, batch, cfg, ref_model, max_tokens, rank, world)
