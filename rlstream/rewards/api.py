"""The reward function's contract: its return type, how a return value becomes one, how a function is found by its
dotted path, the failure classes a judgement that could not be made carries, and the idempotency key a judge that
calls a service sends with its request."""
from __future__ import annotations

import contextlib
import hashlib
import importlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable

from rlstream.schemas.records import Trajectory

#: ``Reward.failure_class`` of a judgement the reward function could not make: it raised (``judge_error``) or ran
#: past the reward stage's judge timeout (``judge_timeout``). Its total (0.0) is no reward: the trainer must not
#: train on it. A failed episode's class (timeout, crash, env_error, ...) is not among these: that 0.0 is earned.
JUDGE_FAILURES = ("judge_error", "judge_timeout")

#: Every ``Reward.failure_class`` whose 0.0 is no verdict on the policy, so never trained on: the judge's own failures,
#: and episodes the infrastructure failed (a remote env server that never answered, whose task the env stage sends
#: again; a gateway stopped before its session closed). The reward stage carries an episode's class into the Reward.
NO_VERDICT = JUDGE_FAILURES + ("env_unreachable", "gateway_stopped")


#: The reward version of the judgement in progress: set by the reward stage around each call of the reward function
#: (a context variable: the judgement's own thread or task sees it, its neighbours in flight see theirs).
_REWARD_VERSION: ContextVar[str] = ContextVar("rlstream_reward_version", default="")


@contextlib.contextmanager
def judging(reward_version: str):
    """Within it, ``idempotency_key`` names judgements under ``reward_version`` (the reward stage's own use)."""
    token = _REWARD_VERSION.set(reward_version)
    try:
        yield
    finally:
        _REWARD_VERSION.reset(token)


def idempotency_key(trajectory: Trajectory) -> str:
    """The ``Idempotency-Key`` of this judgement, for a judge that calls a service (send it as that HTTP header).

    The same every time the reward stage judges this trajectory under this reward version: a redo after a SIGKILL
    or an aborted transaction, and a replay under the same ``--reward-version``, send the same key; a replay under
    a new version is a new judgement with a new key. What is in it: the task as its source produced it (its trace
    id and creation time, so two runs over one dataset never share a key), the trajectory id and the reward
    version. Outside a reward stage (a test calling the function) the version part is empty.
    """
    task = trajectory.task
    identity = "\x1f".join(("rlstream-judge/1", task.trace_id, str(task.created_at), trajectory.trajectory_id,
                            _REWARD_VERSION.get()))
    return hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass
class RewardResult:
    """What a reward function may return when it has more to say than a number."""

    total: float
    breakdown: dict[str, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    verifier_version: str = ""
    judge_version: str = ""
    #: One score per action turn of the trajectory, in order (empty: none). The trainer adds them to that turn's
    #: tokens' advantages (``rlstream.trainer.advantages.turn_advantages``); they need not add up to the total.
    turn_scores: list[float] = field(default_factory=list)


def action_turn_count(trajectory: Trajectory) -> int:
    """How many turns of ``trajectory`` the model produced: what ``turn_scores`` must give one score each."""
    return sum(1 for t in trajectory.turns if t.role == "action")


def check_turn_scores(trajectory: Trajectory, scores: list[float]) -> None:
    """Per-turn scores fit their trajectory: one per action turn, or none. ValueError saying what to return."""
    wanted = action_turn_count(trajectory)
    if scores and len(scores) != wanted:
        raise ValueError(f"turn_scores has {len(scores)} scores but the trajectory has {wanted} action turns: "
                         "return one score per action turn, in order (or none)")


def as_result(raw: Any) -> RewardResult:
    """A reward function's return value as a RewardResult: a number is the total, a dict a breakdown that sums to it."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, dict, RewardResult)):
        raise TypeError(f"reward function returned {type(raw).__name__}; expected float, dict or RewardResult")
    if isinstance(raw, (int, float)):
        return RewardResult(float(raw))
    if isinstance(raw, dict):
        return RewardResult(float(sum(raw.values())), {k: float(v) for k, v in raw.items()})
    return raw


def final_text(trajectory: Trajectory) -> str:
    """The text a verifier judges: the last turn's (a multi-turn episode's final answer), else the response."""
    return trajectory.turns[-1].text if trajectory.turns else trajectory.response


def import_reward(spec: str) -> Callable[[Trajectory], Any]:
    """Import a reward function from ``module:function`` or ``module.function``."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r} is not a dotted path like package.module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load reward {spec!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn
