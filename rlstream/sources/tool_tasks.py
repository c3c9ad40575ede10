"""Multi-turn tool-use tasks for the ``calculator`` env, shaped like ``tasks.py``'s generators.

Each item is ``(task_id, prompt_text, answer, split)``, e.g. ``("calculator-train-s0-00000000",
"what is 37*91? use calc", "3367", "train")``; the held-out split is fixed by ``tasks.HELDOUT_SEED``.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from rlstream.sources.tasks import TaskFamily, TaskItem


def _calculator_pairs() -> list[tuple[str, str]]:
    # Two-digit products: too many to memorise at this model size, trivial with the tool.
    return [(f"what is {a}*{b}? use calc", str(a * b)) for a in range(11, 100) for b in range(11, 100)]


@dataclass
class ToolTask(TaskFamily):
    """A task whose episodes run in a multi-turn env (``env_name``) for up to ``max_turns`` actions."""

    env_name: str = "calculator"
    max_turns: int = 4


TOOL_TASKS: dict[str, ToolTask] = {
    # Per turn: "calc(37*91)" (11 characters), then the answer "3367" + <eos>.
    "calculator": ToolTask("calculator", _calculator_pairs, max_new_tokens=16, env_name="calculator", max_turns=4),
}


def get_task(name: str) -> ToolTask:
    """Look a tool task up in TOOL_TASKS, with a clear error for unknown names."""
    try:
        return TOOL_TASKS[name]
    except KeyError:
        raise KeyError(f"unknown tool task {name!r}; known: {sorted(TOOL_TASKS)}") from None


def generate(name: str, seed: int = 0, split: str = "train", count: int | None = None) -> Iterator[TaskItem]:
    """Shorthand for ``get_task(name).stream(seed, split, count)``."""
    return get_task(name).stream(seed=seed, split=split, count=count)
