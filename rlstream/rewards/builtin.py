"""Built-in reward functions (verifiers): exact match, and the calculator tool task's answer-after-tool-use."""
from __future__ import annotations

from rlstream.rewards.api import RewardResult
from rlstream.runtime.stage import InvalidRecord
from rlstream.schemas.records import Trajectory
from rlstream.sources.tasks import clean_response


def normalise_answer(text: str) -> str:
    """Compare answers without surrounding whitespace or end-of-sequence markers."""
    return text.replace("<eos>", "").strip()


def exact_match(trajectory: Trajectory) -> RewardResult:
    """1.0 when the response equals the task's answer, else 0.0 (rule-based verifier)."""
    answer = trajectory.task.answer
    if answer is None:
        raise InvalidRecord("exact_match needs task.answer")
    response = trajectory.turns[-1].text if trajectory.turns else trajectory.response
    hit = normalise_answer(response) == normalise_answer(answer)
    return RewardResult(1.0 if hit else 0.0, {"exact": 1.0 if hit else 0.0}, verifier_version="exact_match/1")


def _calc_succeeded(turn) -> bool:
    return (turn.tool_call is not None and turn.tool_call.name == "calc" and turn.tool_result is not None
            and turn.tool_result.failure_class is None)


def calculator_reward(trajectory: Trajectory):
    """1.0 for the right final answer reached after a successful ``calc`` call, else 0.0.

    Use as ``--reward rlstream.rewards:calculator_reward``.
    """
    answer = trajectory.task.answer or ""
    final = trajectory.turns[-1].text if trajectory.turns else trajectory.response
    correct = clean_response(final) == answer.strip()
    used = any(_calc_succeeded(t) for t in trajectory.turns)
    return RewardResult(1.0 if correct and used else 0.0,
                        {"correct": float(correct), "used_tool": float(used)}, verifier_version="calculator/1")


def calculator_turns(trajectory: Trajectory):
    """``calculator_reward``'s total, with one score per action turn: 1.0 for a turn whose ``calc`` call succeeded,
    and for the final turn when its answer is right (the total demands both); else 0.0.

    Use as ``--reward calculator_turns``: the call that led to the answer is credited on its own tokens.
    """
    result = calculator_reward(trajectory)
    actions = [t for t in trajectory.turns if t.role == "action"]
    scores = [float(_calc_succeeded(t)) for t in actions]
    if scores:
        scores[-1] = max(scores[-1], result.breakdown["correct"])
    result.turn_scores, result.verifier_version = scores, "calculator_turns/1"
    return result
