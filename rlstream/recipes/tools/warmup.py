"""The supervised warm-up on tool-task episodes: next-token loss on the action tokens only.

Counted in optimizer steps (not seconds) so that a seed gives the same model on any machine.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Qwen2ForCausalLM

from rlstream.recipes.arithmetic.model import IGNORE
from rlstream.recipes.arithmetic.model import sft as arithmetic_sft


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
    """``steps`` AdamW steps on (ids, loss mask) examples drawn with ``seed``; the seconds it took (the arithmetic
    recipe's loop, with this recipe's collate)."""
    return arithmetic_sft(model, examples, pad_id, steps, batch_size=batch_size, lr=lr, seed=seed,
                          log_every=log_every, collate_fn=collate)
