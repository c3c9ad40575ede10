"""Short supervised warm-up so RL starts from a policy that sometimes succeeds, and its greedy check."""

from __future__ import annotations

import time

import torch

from rlstream.sources.tasks import clean_response, get_task


def encode_prompts(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids (with <bos>) and attention mask."""
    enc = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def sft_batch(tok, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `<bos> prompt answer <eos>` ids, attention mask, and labels on answer + <eos> only."""
    rows, labels = [], []
    for prompt, answer in pairs:
        p = tok(prompt)["input_ids"]
        a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, rows))
    pad = tok.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, mask, lab


def supervised_warmup(
    model,
    tok,
    task: str,
    fraction: float = 0.005,
    seconds: float | None = 15.0,
    seed: int = 0,
    lr: float = 1e-3,
    steps: int | None = 300,
) -> dict:
    """Full-batch SFT on a seeded `fraction` of the training pairs: `steps` steps or `seconds`, whichever ends first.

    Returns {"steps", "seconds", "pairs", "loss"}. Held-out pairs are never used.
    """
    pairs = get_task(task).warmup_pairs(fraction, seed=seed)
    ids, mask, labels = sft_batch(tok, pairs)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    start, done, loss = time.perf_counter(), 0, float("nan")
    if steps is None and seconds is None:
        raise ValueError("give steps, seconds, or both")
    # Held-out greedy plateaus near 0.1 after ~100 steps, so the step cap keeps runs alike under CPU load.
    while (steps is None or done < steps) and (seconds is None or time.perf_counter() - start < seconds):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        loss, done = out.loss.item(), done + 1
    model.eval()
    return {"steps": done, "seconds": time.perf_counter() - start, "pairs": len(pairs), "loss": loss}


@torch.no_grad()
def greedy_exact_match(model, tok, task: str, split: str = "heldout", limit: int | None = None) -> float:
    """Mean exact match of greedy completions over the task's held-out (or first `limit` train) pairs."""
    t = get_task(task)
    train, heldout = t.split()
    pairs = heldout if split == "heldout" else train
    if limit is not None:
        pairs = pairs[:limit]
    ids, mask = encode_prompts(tok, [p for p, _ in pairs])
    was_training = model.training
    model.eval()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=t.max_new_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model.train(was_training)
    texts = tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=False)
    return sum(clean_response(x) == a for x, (_, a) in zip(texts, pairs)) / len(pairs)
