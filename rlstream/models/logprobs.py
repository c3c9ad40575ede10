"""Per-token log-probs of given tokens under a model's logits: what the trainer's losses and the teacher's
feedback are both computed from, so that they agree to the bit on the same model and tokens."""
from __future__ import annotations

import torch

from rlstream.errors import UsageError


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


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor, chunk_tokens: int = 256) -> torch.Tensor:
    """Log-probs of several ids per position: ``ids[..., t, k]`` under ``logits[..., t, :]``, as float32 ``[..., T, K]``.

    The top-k form of the teacher's feedback: the student's log-probs of the teacher's k tokens. Chunked over
    positions like ``token_logprobs``, for the same reason.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    index = ids.reshape(-1, ids.shape[-1])
    parts = [torch.log_softmax(chunk.float(), dim=-1).gather(-1, idx)
             for chunk, idx in zip(flat.split(chunk_tokens), index.split(chunk_tokens))]
    return torch.cat(parts).view(ids.shape)


def top_k(logits: torch.Tensor, k: int, chunk_tokens: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely ids at each position and their log-probs (most likely first), float32 ``[..., T, k]``."""
    flat = logits.reshape(-1, logits.shape[-1])
    values, indices = [], []
    for chunk in flat.split(chunk_tokens):
        v, i = torch.log_softmax(chunk.float(), dim=-1).topk(k, dim=-1)
        values.append(v)
        indices.append(i)
    shape = tuple(logits.shape[:-1]) + (k,)
    return torch.cat(indices).view(shape), torch.cat(values).view(shape)


# -- padding-free: a batch's rows packed into one sequence -----------------------------------------------------------
#
# Transformers models that build their masks through ``masking_utils`` (Llama, Qwen2, Mistral, Gemma, ... in
# transformers 5) treat ``position_ids`` that restart at 0 with no attention mask as packed sequences: eager and SDPA
# attention get a block-diagonal causal mask, flash-attention its variable-length kernel. So packed rows attend only
# within themselves, as padded ones do, and no pad token is computed. Only without a KV cache (``use_cache=False``):
# with one, position ids are read as continuing a cached sequence. ``check_packing`` proves it for a given model.


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Right-padded ``[B, L]`` rows as one ``[1, T]`` sequence of their tokens end to end; returns (ids, position ids
    restarting at 0 for each row, the ``[B, L]`` mask of real tokens that ``unpack_rows`` puts values back by)."""
    keep = attention_mask.bool()
    lengths = attention_mask.sum(-1).tolist()
    positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])
    return input_ids[keep][None], positions[None], keep


def unpack_rows(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-token ``values`` of a packed sequence (``[T]``) back in the ``[B, L]`` rows, 0 at padding."""
    return values.new_zeros(keep.shape).masked_scatter(keep, values)


def check_packing(model, atol: float | None = None) -> None:
    """UsageError unless ``model`` keeps packed rows apart: two rows' logits, packed and padded, must agree (to
    ``atol``: 1e-3 in float32, 5e-2 in half precision, kernel rounding only; attention across rows moves them far
    more)."""
    param = next(model.parameters())
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (2, 7), generator=g).to(param.device)
    attn = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], device=param.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            padded = model(input_ids=ids, attention_mask=attn).logits.float()
            packed_ids, positions, keep = pack_rows(ids, attn)
            packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits.float()[0]
    finally:
        model.train(was_training)
    atol = atol if atol is not None else (1e-3 if param.dtype == torch.float32 else 5e-2)
    worst = float((padded[keep] - packed).abs().max())
    if worst > atol:
        raise UsageError(f"--packed-sequences: {type(model).__name__} does not keep packed rows apart (packed and "
                         f"padded logits differ by {worst:.3g}; its attention does not restart at each row's "
                         "position 0): train it without --packed-sequences")


def pack_by_length(lengths: list[int], max_tokens: int, packed: bool = False) -> list[list[int]]:
    """Row indices sorted by length (longest first) and packed greedily into chunks whose padded size (rows x the
    longest; their tokens alone where rows are ``packed`` into one sequence) stays within ``max_tokens``; a row
    longer than that is a chunk alone: the trainer's micro-batches and the teacher's chunks alike."""
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    chunks, current, size = [], [], 0
    for row in order:
        longest = lengths[current[0]] if current else lengths[row]
        grown = size + lengths[row] if packed else (len(current) + 1) * longest
        if current and grown > max_tokens:
            chunks.append(current)
            current, grown = [], lengths[row]
        current.append(row)
        size = grown
    if current:
        chunks.append(current)
    return chunks
