"""Per-token log-probs of given tokens under a model's logits: what the trainer's losses and the teacher's
feedback are both computed from, so that they agree to the bit on the same model and tokens."""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, chunk_tokens: int = 256) -> torch.Tensor:
    """Log-prob of ``target_ids[..., t]`` under ``logits[..., t, :]`` (caller shifts), as float32.

    Works in chunks of tokens so the float32 copy of a bf16 vocabulary never exists whole. Chunks of 256 rather
    than 1024 tokens made a whole training step 3-5 % faster on the CPU (a 2048-word vocabulary: each chunk's
    log-softmax and backward work on a smaller set); each row's log-softmax is its own, so any chunking gives the
    same values to the bit. Pass ``logits`` contiguous: a strided slice is copied whole to be flattened.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    targets = target_ids.reshape(-1, 1)
    parts = [
        torch.log_softmax(chunk.float(), dim=-1).gather(-1, tgt).squeeze(-1)
        for chunk, tgt in zip(flat.split(chunk_tokens), targets.split(chunk_tokens))
    ]
    return torch.cat(parts).view(target_ids.shape)
