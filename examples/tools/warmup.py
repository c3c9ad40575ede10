"""The supervised warm-up on tool-task episodes: next-token loss on the action tokens only.

Counted in optimizer steps (not seconds) so that a seed gives the same model on any machine.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import Qwen2ForCausalLM

from examples.arithmetic.model import IGNORE, lr_at


def collate(batch: Sequence[tuple[list[int], list[int]]], pad_id: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and labels that are the ids where the loss mask is 1."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for i, (row, mask) in enumerate(batch):
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
        labels[i, :len(row)] = torch.where(torch.tensor(mask) == 1, torch.tensor(row), IGNORE)
    return ids, attention, labels


def sft(model: Qwen2ForCausalLM, examples: Sequence[tuple[list[int], list[int]]], pad_id: int, steps: int,
        batch_size: int = 32, lr: float = 1e-3, seed: int = 0, log_every: int = 100) -> float:
    """``steps`` AdamW steps on (ids, loss mask) examples drawn with ``seed``; the seconds it took."""
    if steps <= 0:
        return 0.0
    started = time.perf_counter()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    order = torch.Generator().manual_seed(seed)
    warmup = min(30, max(1, steps // 10))
    for step in range(steps):
        rows = torch.randint(len(examples), (batch_size,), generator=order).tolist()
        ids, attention, labels = collate([examples[r] for r in rows], pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"  sft step {step + 1}/{steps}  loss {loss.item():.3f}  {time.perf_counter() - started:.0f}s",
                  flush=True)
    model.eval()
    return time.perf_counter() - started
