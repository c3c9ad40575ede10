"""Held-out accuracy as the loop would score it: chat prompt in, sampled answer out, rlstream's ``math`` verifier.

The response is decoded the way the rollout stage decodes it (special tokens skipped) and judged by the very
function ``--reward math`` runs, through a Trajectory, so the numbers here and the loop's reward agree.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from rlstream.recipes.arithmetic.data import Problem
from rlstream.recipes.arithmetic.tokenizer import chat_prompt
from rlstream.rewards.verifiers import VERIFIERS
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import SamplingParams, Task, Trajectory, Turn

#: Most tokens of a response: the longest answer (a two-step one) is 27 with its <|im_end|>.
MAX_NEW_TOKENS = 32


def math_reward(response: str, answer: str) -> float:
    """The ``math`` verifier's score of ``response`` against the gold ``answer`` (GSM8K style)."""
    task = Task(task_id="t", group_id="g", task_name="arithmetic", env_name="single", env_version="1", prompt="",
                sampling=SamplingParams(max_tokens=MAX_NEW_TOKENS), created_at=hdr.now_ms(), answer=answer)
    trajectory = Trajectory(trajectory_id="g:0", group_id="g", sample_index=0, task=task, response=response,
                            min_policy_version=0, max_policy_version=0, token_ids=[], loss_mask=[],
                            behaviour_logprobs=[], turns=[Turn("action", response, 0, 0)])
    return VERIFIERS["math"](trajectory).total


@torch.inference_mode()
def generate(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, questions: Sequence[str],
             temperature: float, batch_size: int = 256, max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """The generated ids (``<|im_end|>`` and padding cut off) of each question; temperature 0 is greedy.

    Sampling is plain: no top-k or top-p, which is what the loop's default sampling parameters ask vLLM for.
    """
    out: list[list[int]] = []
    for start in range(0, len(questions), batch_size):
        prompts = [chat_prompt(tokenizer, q) for q in questions[start:start + batch_size]]
        batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False)
        ids = model.generate(**batch, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, **sampling)
        for row in ids[:, batch["input_ids"].shape[1]:].tolist():
            end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            out.append(row[:end])
    return out


@dataclass(frozen=True)
class Accuracy:
    """Held-out accuracy: greedy, and sampled at temperature 1 (``samples`` per problem)."""

    greedy: float
    sampled: float
    samples: int
    mixed_groups: float  # share of problems whose samples hold both a right and a wrong answer

    def __str__(self) -> str:
        return (f"greedy {self.greedy:.3f}, sampled(T=1) {self.sampled:.3f} over {self.samples} per problem, "
                f"mixed groups {self.mixed_groups:.2f}")


def rewards(tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem], responses: Sequence[list[int]]
            ) -> list[float]:
    """The math reward of each response (decoded as the rollout decodes it) against its problem's answer."""
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return [math_reward(text, p.answer) for text, p in zip(texts, problems)]


def accuracy(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem],
             samples: int = 8, seed: int = 0, max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 256
             ) -> Accuracy:
    """Greedy and temperature-1 accuracy on ``problems`` (``samples`` 0: greedy only); sampling seeded by
    ``seed``."""
    questions = [p.question for p in problems]
    greedy = rewards(tokenizer, problems, generate(model, tokenizer, questions, 0.0, batch_size, max_new_tokens))
    if samples == 0:
        return Accuracy(sum(greedy) / len(greedy), float("nan"), 0, float("nan"))
    torch.manual_seed(seed)
    repeated = [p for p in problems for _ in range(samples)]
    sampled = rewards(tokenizer, repeated, generate(model, tokenizer, [p.question for p in repeated], 1.0,
                                                    batch_size, max_new_tokens))
    groups = [sampled[i:i + samples] for i in range(0, len(sampled), samples)]
    mixed = sum(0 < sum(g) < samples for g in groups) / len(groups)
    return Accuracy(sum(greedy) / len(greedy), sum(sampled) / len(sampled), samples, mixed)
