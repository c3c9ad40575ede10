"""The reward stage: trajectories in, scored trajectories out.

A reward function is given as a dotted path ``package.module:function`` (or
``package.module.function``) with one signature::

    def reward(trajectory: Trajectory) -> float | dict[str, float] | RewardResult

It may be ``async`` (a remote judge): one process then keeps many judgements
in flight at once. A dict is a breakdown whose values sum to the total.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from rlstream.config import knob
from rlstream.runtime.stage import Incoming, InvalidRecord, Output, Stage
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import Reward, ScoredTrajectory, Trajectory


@dataclass
class RewardResult:
    """What a reward function may return when it has more to say than a number."""

    total: float
    breakdown: dict[str, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    verifier_version: str = ""
    judge_version: str = ""


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


def load_reward(spec: str) -> Callable[[Trajectory], Any]:
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


def to_reward(raw: Any, reward_version: str, latency_ms: float) -> Reward:
    """Check a reward function's return value and turn it into the Reward record."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, dict, RewardResult)):
        raise TypeError(f"reward function returned {type(raw).__name__}; expected float, dict or RewardResult")
    if isinstance(raw, (int, float)):
        raw = RewardResult(float(raw))
    elif isinstance(raw, dict):
        raw = RewardResult(float(sum(raw.values())), {k: float(v) for k, v in raw.items()})
    values = [raw.total, *raw.breakdown.values()]
    if not all(math.isfinite(v) for v in values):
        raise InvalidRecord(f"reward is not finite: total={raw.total} breakdown={raw.breakdown}")
    return Reward(total=float(raw.total), reward_version=reward_version, breakdown=raw.breakdown,
                  violations=list(raw.violations), verifier_version=raw.verifier_version,
                  judge_version=raw.judge_version, latency_ms=latency_ms, scored_at=now_ms())


@dataclass(frozen=True)
class RewardSettings:
    """The reward stage's knobs."""

    ROLE: ClassVar[str] = "REWARD"

    reward: str = knob("rlstream.stages.reward:exact_match", "Reward function as a dotted path (module:function)")
    reward_version: str = knob("v1", "Version written on every reward; replay scores again under a new one")


class RewardStage(Stage):
    """Scores each trajectory with the configured reward function."""

    name = "reward"
    inputs = ("trajectories",)

    def __init__(self, settings: RewardSettings = RewardSettings()):
        self.settings = settings
        self.fn = load_reward(settings.reward)
        self._async = inspect.iscoroutinefunction(self.fn)

    async def handle(self, item: Incoming) -> list[Output]:
        traj: Trajectory = item.record
        started = time.perf_counter()
        if traj.status == "failed":
            # A failed episode is recorded with zero reward and its class, not silently dropped.
            reward = Reward(total=0.0, reward_version=self.settings.reward_version,
                            failure_class=traj.failure.failure_class if traj.failure else "failed",
                            scored_at=now_ms())
        else:
            raw = await (self.fn(traj) if self._async else asyncio.to_thread(self.fn, traj))
            reward = to_reward(raw, self.settings.reward_version, (time.perf_counter() - started) * 1000)
        traj.stage_times["reward.end"] = now_ms()
        return [Output("rewards", item.key, ScoredTrajectory(traj, reward),
                       reward_version=self.settings.reward_version)]
