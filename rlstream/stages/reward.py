"""The reward stage: trajectories in, scored trajectories out, through a reward function (``rlstream.rewards``
documents its one signature) that may be ``async``: one process then keeps many judgements in flight at once.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from rlstream.config import knob
from rlstream.rewards import RewardResult, load_reward
from rlstream.runtime.stage import Incoming, InvalidRecord, Output, Stage
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import Reward, ScoredTrajectory, Trajectory


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

    reward: str = knob("rlstream.rewards:exact_match", "Reward function as a dotted path (module:function)")
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
