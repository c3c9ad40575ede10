"""A step's batch as micro-batches under a token budget, spread over the ranks, with gradients accumulated into one
optimizer step that equals the whole batch's.

The loss is a token-mean over the whole batch's loss-mask tokens. A micro-batch's loss is a token-mean over its own,
so it is weighted by its share of the batch's tokens: the weighted sum is the whole-batch loss, and so is the sum of
the gradients (exactly, in exact arithmetic; to float rounding in practice). Across ranks the engines average the
gradients, so each rank's share is multiplied by the world size to make that average the sum.

Every rank holds the whole batch (rank 0 broadcasts it, ``trainer/distributed.py``) and plans the same split, so
the ranks need no exchange to agree on who trains what; each trains its own micro-batches.

The budget's default (``--micro-batch-tokens -1``) is sized from the memory this rank has left once its model is
placed (``default_budget``): on CUDA the device's, on the CPU the machine's available memory (``cpu_room``). The
first step of a real model otherwise runs its whole batch (16 groups x 8 samples, full-vocabulary logits) in one
forward and runs out of memory: the smollm2 recipe's first step (64 samples of about 250 tokens) took 20 GB and was
OOM-killed on this project's 24 GB CPU machine while the CPU default was the whole batch. A model built in code (the
demo's) gets the bound, 64k tokens, more than its steps have: for it nothing changes. A whole-batch step (``0``)
whose estimate does not fit is refused before its forward, and an out-of-memory error in any step becomes one line
naming the flag (``train_step``). The sizing is a pure
function of the numbers it is given, unit-tested on the CPU; it has not run on a GPU in this project.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from rlstream.errors import UserError
from rlstream.models.logprobs import pack_by_length
from rlstream.models.resources import ModelShape, activation_bytes_per_token, available_memory, gib
from rlstream.trainer.losses import reverse_kl_baseline
from rlstream.trainer.update import Batch, UpdateConfig, batch_loss, policy_update

log = logging.getLogger(__name__)


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


#: ``--micro-batch-tokens``: -1 is the device's default (``default_budget``), 0 the whole batch at once.
AUTO = -1
#: Bounds of the sized default. Below 1024 tokens a step is launch-bound; above 64k a bigger micro-batch buys little
#: once the GPU is busy, and the bound keeps an estimate's error from becoming one huge forward.
MIN_BUDGET, MAX_BUDGET = 1024, 65536
#: Share of the estimated room the default fills: the estimate leaves out the allocator's fragmentation and the
#: backward's transient buffers.
MARGIN = 0.6


def default_budget(device_type: str, room: int | None, shape: ModelShape, dtype_bytes: int = 2,
                   checkpointing: bool = False) -> int:
    """The default budget: as many tokens as ``MARGIN`` of ``room`` (bytes left for activations) holds at
    ``activation_bytes_per_token``, in multiples of 1024 within the bounds; 0 (whole batch) off CUDA when the room
    is not known (None).

    Sized rather than fixed: a fixed 16k would be 29 GB of logits alone for a 152k-vocabulary model (16k x 152k x
    12 bytes), past a 24 GB card, and a tenth of what a 135 M model can take on an H200.
    """
    if device_type != "cuda" and room is None:
        return 0
    per_token = activation_bytes_per_token(shape, dtype_bytes, checkpointing)
    tokens = int(max(0, room or 0) * MARGIN) // per_token
    return max(MIN_BUDGET, min(MAX_BUDGET, tokens // 1024 * 1024))


def resolve_budget(requested: int, device_type: str, room: int | None, shape: ModelShape, dtype_bytes: int = 2,
                   checkpointing: bool = False) -> int:
    """``--micro-batch-tokens`` as given (0 or a budget), or for -1 the device's default."""
    if requested < AUTO:
        raise UserError(f"--micro-batch-tokens {requested}: expected -1 (the device's default), 0 (the whole batch) "
                        "or a token budget")
    return default_budget(device_type, room, shape, dtype_bytes, checkpointing) if requested == AUTO else requested


def activation_room(total: int, free: int, held: int, fraction: float, pending: int) -> int:
    """Bytes a rank has for activations: its share of the GPU (``fraction`` of ``total``; 1: all of it) less what
    it holds (``held``), within what is ``free`` on the device, less the state its first step allocates still
    (``pending``: gradients and AdamW's moments)."""
    cap = int(total * fraction) if 0 < fraction < 1 else total
    return min(cap - held, free) - pending


def cuda_room(device, fraction: float, pending: int) -> int | None:
    """``activation_room`` of a CUDA device as its driver reports it now; None off CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return activation_room(total, free, torch.cuda.memory_reserved(device), fraction, pending)


def cpu_room(pending: int) -> int:
    """Bytes a CPU trainer has for activations: the memory still available to it (which already leaves out what it
    and every other process hold) less the state its first step allocates still (``pending``)."""
    return available_memory() - pending


def step_tokens(batch: Batch, packed: bool = False) -> int:
    """Tokens a whole-batch forward computes: rows x the longest row, or the real tokens where rows are packed."""
    lengths = batch.attention_mask.sum(-1)
    return int(lengths.sum()) if packed else int(batch.attention_mask.shape[0] * lengths.max())


def check_whole_batch(tokens: int, per_token: int, room: int | None, rows: int) -> None:
    """UserError naming ``--micro-batch-tokens`` when a whole-batch step's activations (``tokens`` x ``per_token``)
    are estimated past the ``room`` it has (None: not on a GPU, nothing to check)."""
    if room is None or tokens * per_token <= room:
        return
    fits = max(0, room) * MARGIN // per_token // 1024 * 1024
    raise UserError(f"this step's whole batch ({rows} rows, {tokens} padded tokens, about {gib(tokens * per_token)} "
                    f"of activations) does not fit the {gib(max(0, room))} left on the GPU: set "
                    f"--micro-batch-tokens {max(MIN_BUDGET, fits)} (or -1, the default sized from memory)")


@dataclass(frozen=True)
class StepBudget:
    """A trainer's micro-batching: its ``tokens`` budget (0: whole batch), and on a GPU the bytes per token and
    the room that a whole-batch step is checked against."""

    tokens: int = 0
    per_token: int = 0
    room: int | None = None
    world: int = 1  # ranks sharing a whole batch (each forwards about 1/world of its rows)


def step_budget(requested: int, device, shape: ModelShape | None, half: bool, checkpointing: bool, fraction: float,
                world: int = 1, pending: int = 0) -> StepBudget:
    """A trainer's ``StepBudget`` on ``device`` for ``--micro-batch-tokens`` ``requested``: activations in 16 bits
    where ``half`` (bf16 autocast or a half dtype), room from the driver (on the CPU: the memory available) less
    the ``pending`` state. Without the model's shape (None) the budget is as given, the whole batch for -1. On the
    CPU the room sizes the default only: a whole-batch step asked for (0) is not checked against it, since other
    processes on the machine come and go."""
    dtype_bytes = 2 if half else 4
    if shape is None:
        return StepBudget(max(0, resolve_budget(requested, "cpu", None, shape)), world=world)
    if device.type != "cuda":
        # The machine's memory is shared by its ranks (CPU ranks are a host's processes): each sizes within its part.
        room = cpu_room(pending) // max(1, world) if requested == AUTO else None
        return StepBudget(max(0, resolve_budget(requested, "cpu", room, shape, dtype_bytes, checkpointing)),
                          world=world)
    room = cuda_room(device, fraction, pending)
    return StepBudget(resolve_budget(requested, device.type, room, shape, dtype_bytes, checkpointing),
                      activation_bytes_per_token(shape, dtype_bytes, checkpointing), room, world)


def train_step(engine, batch: Batch, cfg: UpdateConfig, ref_model=None, max_tokens: int | StepBudget = 0,
               rank: int = 0, world: int = 1) -> dict[str, float]:
    """The step a trainer takes: on one rank, with no budget or one the whole batch fits in, the whole-batch
    ``policy_update`` (the same to the bit as before micro-batches existed: a small model's steps under the CPU's
    sized default are); otherwise micro-batches accumulated over the ranks. Running out of GPU memory is a UserError
    that names the budget to set."""
    budget = max_tokens if isinstance(max_tokens, StepBudget) else StepBudget(max_tokens)
    tokens = step_tokens(batch, cfg.packed)
    if budget.tokens <= 0:
        check_whole_batch(tokens // budget.world, budget.per_token, budget.room, batch.input_ids.shape[0])
    try:
        if (budget.tokens <= 0 or tokens <= budget.tokens) and world == 1:
            return policy_update(engine, batch, cfg, ref_model)
        return accumulated_update(engine, batch, cfg, ref_model, budget.tokens, rank, world)
    except torch.OutOfMemoryError as exc:
        now = f"--micro-batch-tokens {budget.tokens}" if budget.tokens > 0 else "the whole batch at once"
        smaller = max(MIN_BUDGET // 4, budget.tokens // 2) if budget.tokens > 0 else MIN_BUDGET * 4
        raise UserError(f"out of GPU memory in a training step with {now} ({str(exc).splitlines()[0][:160]}): "
                        f"set --micro-batch-tokens {smaller} or lower, or --gradient-checkpointing") from None


def trainer_budget(s, device, shape: ModelShape | None, sharded: bool, world: int) -> StepBudget:
    """The trainer's step budget for its settings ``s`` on ``device``; the gradients and AdamW's moments are
    allocated only by the first step, so their bytes are kept out of the room now."""
    half = s.autocast == "bf16" or s.dtype in ("bf16", "fp16")
    budget = step_budget(s.micro_batch_tokens, device, shape, half, s.gradient_checkpointing, s.gpu_memory_fraction,
                         world, pending=12 * shape.params // (world if sharded else 1) if shape else 0)
    if budget.room is not None:
        log.info("micro-batches of %s tokens (%s left for activations, %.2f MiB a token)",
                 budget.tokens or "all the step's", gib(budget.room), budget.per_token / 2**20)
    elif budget.tokens:
        log.info("micro-batches of at most %d tokens (--micro-batch-tokens)", budget.tokens)
    return budget
