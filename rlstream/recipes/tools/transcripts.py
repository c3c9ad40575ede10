"""The tool task's episodes as the loop tokenizes them, for the tokenizer, the warm-up and the build's check.

The task is rlstream's built-in ``calculator`` tool task (``rlstream.sources.tool_tasks``): "what is 37*91? use
calc", answer "3367", env ``calculator``, up to 4 turns. A solved episode is two actions::

    what is 37*91? use calc | calc(37*91)<|im_end|> | =3367\n | 3367<|im_end|>
    prompt                  | action 1 (trained)    | observation (context) | action 2 (trained)

The ids are built exactly as the rollout stage builds them: the prompt tokenized alone, each observation tokenized
alone without special tokens, each action ending in the end-of-turn token the engine samples. A warm-up on other
ids would teach the policy sequences the loop never shows it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from rlstream.envs.builtin import Calculator


@dataclass(frozen=True)
class Problem:
    question: str  # "what is 37*91? use calc"
    answer: str  # "3367"

    @property
    def expression(self) -> str:
        return self.question.removeprefix("what is ").split("?", 1)[0]


def tool_turns(p: Problem) -> list[tuple[str, str]]:
    """The solved episode after the prompt: (role, text) pairs, actions and the env's observation."""
    return [("action", f"calc({p.expression})"), ("observation", f"={p.answer}\n"), ("action", p.answer)]


def direct_turns(p: Problem) -> list[tuple[str, str]]:
    """An answer without the tool: right in the warm-up data, but the model cannot learn 8,000 products, and the
    ``calculator`` reward scores any answer without a successful call 0."""
    return [("action", p.answer)]


def text(p: Problem, turns: Sequence[tuple[str, str]]) -> str:
    """The episode as one text, for the tokenizer to learn its merges from."""
    return p.question + "".join(t + ("<|im_end|>" if role == "action" else "") for role, t in turns)


def encode(tokenizer: PreTrainedTokenizerFast, p: Problem, turns: Sequence[tuple[str, str]]
           ) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of an episode as the rollout tokenizes it: 1 on action tokens (and their end token)."""
    ids = list(tokenizer(p.question)["input_ids"])
    mask = [0] * len(ids)
    for role, t in turns:
        part = list(tokenizer(t, add_special_tokens=False)["input_ids"])
        if role == "action":
            part.append(tokenizer.eos_token_id)
        ids += part
        mask += [1 if role == "action" else 0] * len(part)
    return ids, mask


def calc_observation(action: str) -> str | None:
    """The observation the ``calculator`` env gives ``action`` (None: no call, the episode ends), for the build's
    in-process check. The loop runs the real env, in the sandbox; this evaluates the same digits-and-``*`` calls."""
    expr = Calculator.find_call(action)
    if expr is None:
        return None
    a, op, b = expr.partition("*")
    if not op or not a.strip().isdigit() or not b.strip().isdigit():
        return "=error: calc takes numbers and + - * / // % ** ( )\n"
    return f"={int(a) * int(b)}\n"
