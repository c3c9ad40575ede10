"""Scoring the student's tokens under the teacher: the sampled token's log-prob and the teacher's top-k, per
response token, packed the way TeacherFeedback carries them. Pure torch (or vLLM), no Kafka.

A batch is scored in chunks of at most ``batch_tokens`` padded tokens, packed by length as the trainer's
micro-batches are (``models.logprobs.pack_by_length``). Before each chunk the deadline is checked, and rows not
scored by then come back as None: the stage sends them on without teacher feedback (status ``timeout``) rather
than with a half-filled signal. A chunk that has started is not interrupted.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from rlstream.models.logprobs import token_logprobs, top_k
from rlstream.models.logprobs import pack_by_length


@dataclass
class Scored:
    """One sample's feedback arrays, aligned with its response tokens (0 where the student did not act)."""

    logprobs: list[float]
    topk_ids: list[int]  # token-major, k per token
    topk_logprobs: list[float]


def response_feedback(seq_logprobs: list[float], seq_topk_ids: list[list[int]] | None,
                      seq_topk_logprobs: list[list[float]] | None, prompt_len: int, loss_mask: list[int],
                      k: int) -> Scored:
    """A sample's arrays from its whole-sequence ones (position t predicts token t + 1): response token j sits at
    ``prompt_len + j`` and was predicted at ``prompt_len + j - 1``; zeros where ``loss_mask`` is 0."""
    lps, ids, tlps = [], [], []
    zeros_i, zeros_f = [0] * k, [0.0] * k
    for j, m in enumerate(loss_mask):
        at = prompt_len + j - 1
        if m and at >= 0:
            lps.append(seq_logprobs[at])
            if k:
                ids.extend(seq_topk_ids[at])
                tlps.extend(seq_topk_logprobs[at])
        else:
            lps.append(0.0)
            if k:
                ids.extend(zeros_i)
                tlps.extend(zeros_f)
    return Scored(lps, ids, tlps)


class TorchScorer:
    """A transformers causal LM on one device, scoring rows of token ids."""

    def __init__(self, model, device: torch.device, batch_tokens: int = 4096):
        self.model = model.to(device).eval()
        self.device = device
        self.batch_tokens = max(1, batch_tokens)

    def score(self, rows: list[list[int]], temperature: float, k: int,
              deadline: float | None = None) -> list[tuple[list[float], list, list] | None]:
        """Per row: (log-prob of each next token, its top-k ids and log-probs per position or None when k = 0), at
        ``temperature`` (the student's sampling temperature, as the trainer scores the student); None for rows
        not reached by ``deadline`` (time.monotonic())."""
        out: list = [None] * len(rows)
        for chunk in pack_by_length([len(r) for r in rows], self.batch_tokens):
            if deadline is not None and time.monotonic() >= deadline:
                break
            width = max(len(rows[i]) for i in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            attn = torch.zeros((len(chunk), width), dtype=torch.long)
            for n, i in enumerate(chunk):
                ids[n, :len(rows[i])] = torch.tensor(rows[i])
                attn[n, :len(rows[i])] = 1
            ids, attn = ids.to(self.device), attn.to(self.device)
            with torch.inference_mode():
                logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
                if temperature != 1.0:
                    logits = logits / temperature
                lps = token_logprobs(logits, ids[:, 1:]).cpu()
                top = top_k(logits, k) if k else None
            # One tolist per tensor, rows sliced as lists: a tolist per row and array cost as much as the forward
            # of a small teacher (three calls a row, ~0.1 ms each, against ~0.2 ms of forward a row).
            lps = lps.tolist()
            top_ids, top_lps = (top[0].cpu().tolist(), top[1].cpu().tolist()) if top else (None, None)
            for n, i in enumerate(chunk):
                t = len(rows[i]) - 1  # the row's own positions, not the chunk's padding
                out[i] = (lps[n][:t], top_ids[n][:t] if top else None, top_lps[n][:t] if top else None)
        return out


class VllmScorer:
    """The teacher in vLLM, in process: prompt log-probs of the student's sequences (one generated token each,
    discarded). vLLM's prompt log-probs are the model's own distribution (temperature 1): a sample drawn at another
    temperature is refused by the stage (``supports``) rather than scored at the wrong one."""

    def __init__(self, folder, dtype: str = "auto", threads: int = 1, batch_tokens: int = 4096,
                 gpu_memory_utilization: float = 0.9):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if threads <= 1 else "all")
        from vllm import LLM

        from rlstream.models.loading import context_limit, dtype_name, torch_dtype

        # No tokenizer: the teacher reads the student's token ids, never text.
        self.llm = LLM(model=str(folder), dtype=dtype_name(torch_dtype(dtype, folder)),
                       max_model_len=context_limit(folder), enforce_eager=True, skip_tokenizer_init=True,
                       load_format="safetensors", seed=0, gpu_memory_utilization=gpu_memory_utilization)
        self.batch_tokens = max(1, batch_tokens)

    @staticmethod
    def supports(temperature: float) -> bool:
        return temperature == 1.0

    def reload(self, folder) -> None:
        """New weights in the running engine (a teacher following the policy); no prefix computed before is reused."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        self.llm.reset_prefix_cache()

    def score(self, rows: list[list[int]], temperature: float, k: int,
              deadline: float | None = None) -> list[tuple[list[float], list, list] | None]:
        """As ``TorchScorer.score``, at temperature 1 (ValueError otherwise)."""
        if not self.supports(temperature):
            raise ValueError(f"the vLLM teacher scores at temperature 1, not {temperature}")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)
        out: list = [None] * len(rows)
        for chunk in pack_by_length([len(r) for r in rows], self.batch_tokens):
            if deadline is not None and time.monotonic() >= deadline:
                break
            results = self.llm.generate([TokensPrompt(prompt_token_ids=rows[i]) for i in chunk], params,
                                        use_tqdm=False)
            for i, result in zip(chunk, results):
                out[i] = _from_prompt_logprobs(rows[i], result.prompt_logprobs, k)
        return out


def _from_prompt_logprobs(row: list[int], prompt_logprobs: list, k: int) -> tuple[list[float], list, list]:
    """vLLM's per-position dicts (token id -> Logprob; None at position 0; the actual token's entry besides the
    top k) as (log-prob of each next token, top-k ids and log-probs per position, by rank)."""
    lps, ids, tlps = [], [], []
    for t in range(1, len(row)):
        entries = prompt_logprobs[t]
        lps.append(float(entries[row[t]].logprob))
        if k:
            best = sorted(entries.items(), key=lambda e: e[1].rank)[:k]
            ids.append([int(token) for token, _ in best])
            tlps.append([float(lp.logprob) for _, lp in best])
    return lps, (ids if k else None), (tlps if k else None)
