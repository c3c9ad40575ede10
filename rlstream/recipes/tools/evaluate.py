"""The build's check: held-out episodes played in-process, turn by turn as the loop plays them, scored by the
``calculator`` reward the loop runs (the right answer after a successful ``calc`` call).

The env's side is ``transcripts.calc_observation`` (the loop runs the real ``calculator`` env in the sandbox).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from rlstream.recipes.tools.transcripts import Problem, calc_observation
from rlstream.envs.builtin import Calculator
from rlstream.rewards.builtin import calculator_reward
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import SamplingParams, Task, ToolCall, ToolResult, Trajectory, Turn

#: The task's own limits (``rlstream.sources.tool_tasks``): new tokens per turn, and turns.
MAX_NEW_TOKENS, MAX_TURNS = 16, 4


@torch.inference_mode()
def _generate(model, tokenizer, contexts: list[list[int]], temperature: float) -> list[list[int]]:
    """One turn per context (left-padded batch); the new ids up to and with the end-of-turn token."""
    width = max(map(len, contexts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(c)) + c for c in contexts])
    attention = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=MAX_NEW_TOKENS,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sampling)
    rows = []
    for row in out[:, width:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        rows.append(row[:end])
    return rows


def play(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem],
         temperature: float) -> list[Trajectory]:
    """Each problem's episode, up to MAX_TURNS actions, as a Trajectory the reward function can score."""
    contexts = [list(tokenizer(p.question)["input_ids"]) for p in problems]
    turns: list[list[Turn]] = [[] for _ in problems]
    live = list(range(len(problems)))
    for n in range(MAX_TURNS):
        if not live:
            break
        gens = _generate(model, tokenizer, [contexts[i] for i in live], temperature)
        still = []
        for i, gen in zip(live, gens):
            text = tokenizer.decode(gen, skip_special_tokens=True)
            contexts[i] += gen
            turn = Turn("action", text, 0, 0)
            turns[i].append(turn)
            observation = calc_observation(text)
            if observation is None or n == MAX_TURNS - 1:
                continue
            turn.tool_call = ToolCall("calc", Calculator.find_call(text) or "")
            turn.tool_result = ToolResult(observation[1:].strip(), exit_code=2 if "error" in observation else 0)
            turns[i].append(Turn("observation", observation, 0, 0))
            contexts[i] += tokenizer(observation, add_special_tokens=False)["input_ids"]
            still.append(i)
        live = still
    return [_trajectory(p, t) for p, t in zip(problems, turns)]


def _trajectory(p: Problem, turns: list[Turn]) -> Trajectory:
    task = Task(task_id="t", group_id="g", task_name="calculator", env_name="calculator", env_version="1",
                prompt=p.question, sampling=SamplingParams(max_tokens=MAX_NEW_TOKENS), created_at=hdr.now_ms(),
                answer=p.answer, max_turns=MAX_TURNS)
    return Trajectory(trajectory_id="g:0", group_id="g", sample_index=0, task=task, response=turns[-1].text,
                      min_policy_version=0, max_policy_version=0, token_ids=[], loss_mask=[], behaviour_logprobs=[],
                      turns=turns)


@dataclass(frozen=True)
class Check:
    """Held-out reward greedy and sampled, and how often sampled episodes call the tool."""

    greedy: float
    sampled: float
    sampled_tool_rate: float
    sampled_tool_reward: float  # reward of the sampled episodes that did call the tool
    samples: int

    def as_dict(self) -> dict:
        return {f"heldout_{k}": v for k, v in asdict(self).items()}

    def __str__(self) -> str:
        return (f"reward greedy {self.greedy:.2f}, sampled {self.sampled:.2f} (tool called in "
                f"{self.sampled_tool_rate:.0%}, reward {self.sampled_tool_reward:.2f} when called)")


def evaluate(model, tokenizer, problems: Sequence[Problem], samples: int = 4, seed: int = 0) -> Check:
    torch.manual_seed(seed)
    greedy = [calculator_reward(t).total for t in play(model, tokenizer, problems, 0.0)]
    sampled = [calculator_reward(t) for t in play(model, tokenizer, list(problems) * samples, 1.0)]
    called = [r.total for r in sampled if r.breakdown["used_tool"]]
    return Check(greedy=round(sum(greedy) / len(greedy), 3),
                 sampled=round(sum(r.total for r in sampled) / len(sampled), 3),
                 sampled_tool_rate=round(len(called) / len(sampled), 3),
                 sampled_tool_reward=round(sum(called) / len(called), 3) if called else 0.0, samples=samples)
