"""The reward stage: trajectories in, scored trajectories out, through a reward function (``rlstream.rewards``
documents its one signature) that may be ``async``: one process then keeps many judgements in flight at once.

A judge that raises or runs past ``judge_timeout_s`` still scores the trajectory: its Reward carries the failure
class (``rlstream.rewards.JUDGE_FAILURES``) instead of the trajectory going to dead-letters, so the trainer's group
completes without it rather than waiting out its head timeout.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from rlstream.config import knob
from rlstream.rewards import as_result, check_turn_scores, judging, load_reward
from rlstream.runtime.stage import Incoming, InvalidRecord, Output, Stage, SyncHandler, each_alone
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import Reward, ScoredTrajectory, Trajectory, scored_topic
from rlstream.schemas.splice import Splice

log = logging.getLogger(__name__)
#: How much of a judge's error message its Reward keeps (in ``violations``).
_ERROR_CHARS = 500


def to_reward(raw: Any, reward_version: str, latency_ms: float) -> Reward:
    """Check a reward function's return value and turn it into the Reward record."""
    raw = as_result(raw)
    values = [raw.total, *raw.breakdown.values(), *raw.turn_scores]
    if not all(math.isfinite(v) for v in values):
        raise InvalidRecord(f"reward is not finite: total={raw.total} breakdown={raw.breakdown} "
                            f"turn_scores={raw.turn_scores}")
    return Reward(total=float(raw.total), reward_version=reward_version, breakdown=raw.breakdown,
                  violations=list(raw.violations), verifier_version=raw.verifier_version,
                  judge_version=raw.judge_version, latency_ms=latency_ms, scored_at=now_ms(),
                  turn_scores=[float(v) for v in raw.turn_scores])


@dataclass(frozen=True)
class RewardSettings:
    """The reward stage's knobs."""

    ROLE: ClassVar[str] = "REWARD"

    reward: str = knob("rlstream.rewards:exact_match", "Reward function: a built-in verifier (math, exact, "
                       "normalized, regex, format, length, code, calculator, calculator_turns), a dotted path (module:function), or "
                       "weighted parts like math:1.0,format:0.2,length:0.1 (see rlstream.rewards)")
    reward_version: str = knob("v1", "Version written on every reward; replay scores again under a new one")
    judge_timeout_s: float = knob(20.0, "A reward function running longer gives a judge_timeout reward (keep it "
                                        "under --handler-timeout-s, past which the trajectory is dead-lettered)")


class RewardStage(Stage):
    """Scores each trajectory with the configured reward function."""

    name = "reward"
    inputs = ("trajectories",)
    token_views = True  # a judge reads a trajectory's tokens; the scored trajectory carries them on unchanged

    def __init__(self, settings: RewardSettings = RewardSettings(), start_stamp: str = ""):
        """``start_stamp``: a stage time to stamp on each trajectory when its judgement starts (a replay's
        ``replay.start``). It is written with the reward stage's own, after the arrived bytes are kept: stamped
        before, it would change the tail, and the scored trajectory could no longer be written over them."""
        self.settings = settings
        self._start_stamp = start_stamp
        self.fn = load_reward(settings.reward)
        self._splice = Splice("ScoredTrajectory", carried="trajectory", tail_from="stage_times")
        self._async = inspect.iscoroutinefunction(self.fn)

    @property
    def judges_in_batches(self) -> bool:
        """Whether ``handle_batch`` scores a batch in one call (a sync reward function) rather than declining."""
        return not self._async

    @property
    def batched(self) -> bool:
        # Per record by default (pipelined: judgements overlap and none waits for a slower one); handle_batch
        # serves the unpipelined runs (--no-pipeline, replays).
        return False

    async def handle(self, item: Incoming) -> list[Output]:
        traj: Trajectory = item.record
        started, started_ms = time.perf_counter(), now_ms() if self._start_stamp else 0
        reward = self._failed(traj) if traj.status == "failed" else await self._judge(traj, started)
        return self._scored(item, reward, started_ms)

    def sync_handler(self) -> SyncHandler | None:
        """A sync reward function is called straight on a pool thread (``handle`` awaits it through the event loop,
        for a chain and for async functions): given up on at ``judge_timeout_s``, as ``handle`` gives up on it,
        with the same judge_timeout reward."""
        if self._async:
            return None
        timeout_s = self.settings.judge_timeout_s
        return SyncHandler(self._handle_sync, timeout_s,
                           lambda item: self._scored(item, self._timed_out(time.perf_counter() - timeout_s),
                                                     now_ms() - round(timeout_s * 1000)))

    def _handle_sync(self, item: Incoming) -> list[Output]:
        """One trajectory through a sync function on this thread (the pool's, or a batch's)."""
        traj: Trajectory = item.record
        started_ms = now_ms() if self._start_stamp else 0  # a clock read per record only where it is written
        return self._scored(item, self._failed(traj) if traj.status == "failed" else self._judge_sync(traj),
                            started_ms)

    def handle_batch(self, items: list[Incoming]) -> list[list[Output] | Exception] | None:
        """A whole unpipelined batch in one call when the reward function is sync: an exact-match judge costs
        microseconds, less than the thread hop and event-loop turn per trajectory of the per-record path. An async
        function keeps that path (None), where its judgements overlap.

        A sync judgement that runs past ``judge_timeout_s`` is recorded as ``judge_timeout``, as on the per-record
        path, but the batch waits for it: a sync judge that can hang belongs on the pipelined default, where its
        thread is left behind."""
        return each_alone(self._handle_sync, items) if self.judges_in_batches else None

    def _scored(self, item: Incoming, reward: Reward, started_ms: int) -> list[Output]:
        """The scored trajectory, written over the bytes its trajectory arrived as where they can be reused
        (schemas.splice: the stage times it adds are in the tail, which is encoded again)."""
        traj: Trajectory = item.record
        kept = self._splice.keep(item.wire, traj)  # before the tail changes
        if self._start_stamp:
            traj.stage_times[self._start_stamp] = started_ms
        traj.stage_times["reward.end"] = now_ms()
        scored = ScoredTrajectory(traj, reward)
        # Eval-lane results go where no trainer reads (records.is_eval).
        return [Output(scored_topic(traj.task), item.key, scored, reward_version=self.settings.reward_version,
                       value=None if kept is None else partial(self._splice.encode, kept, scored))]

    def _failed(self, traj: Trajectory) -> Reward:
        """A failed episode is recorded with zero reward and its class, not silently dropped."""
        return Reward(total=0.0, reward_version=self.settings.reward_version,
                      failure_class=traj.failure.failure_class if traj.failure else "failed", scored_at=now_ms())

    async def _judge(self, traj: Trajectory, started: float) -> Reward:
        """The reward function's Reward, or one carrying the judge's failure class (total 0.0, never trained on)."""
        try:
            # asyncio.timeout rather than wait_for, which would run the call in a task of its own per trajectory.
            with judging(self.settings.reward_version):  # the judge's idempotency_key: the context goes with the call
                async with asyncio.timeout(self.settings.judge_timeout_s):
                    raw = await (self.fn(traj) if self._async else asyncio.to_thread(self.fn, traj))
        except InvalidRecord:
            raise  # the trajectory cannot be judged: dead-lettered with its reason
        except TimeoutError:
            # A sync function's thread cannot be stopped: it finishes in the background and its result is dropped.
            return self._timed_out(started)
        except Exception as exc:
            return self._judge_failure("judge_error", f"{type(exc).__name__}: {exc}", started)
        return self._checked(traj, raw, started)

    def _judge_sync(self, traj: Trajectory) -> Reward:
        """``_judge`` for a sync function called on this thread (handle_batch)."""
        started = time.perf_counter()
        try:
            with judging(self.settings.reward_version):
                raw = self.fn(traj)
        except InvalidRecord:
            raise
        except Exception as exc:
            return self._judge_failure("judge_error", f"{type(exc).__name__}: {exc}", started)
        if time.perf_counter() - started > self.settings.judge_timeout_s:
            return self._timed_out(started)  # its result is dropped, as the per-record path drops a late one
        return self._checked(traj, raw, started)

    def _checked(self, traj: Trajectory, raw: Any, started: float) -> Reward:
        try:
            check_turn_scores(traj, as_result(raw).turn_scores)
        except ValueError as exc:  # the judge's mistake, not the trajectory's: its group goes on without it
            return self._judge_failure("judge_error", str(exc), started)
        return to_reward(raw, self.settings.reward_version, (time.perf_counter() - started) * 1000)

    def _timed_out(self, started: float) -> Reward:
        return self._judge_failure("judge_timeout", f"no judgement within {self.settings.judge_timeout_s}s", started)

    def _judge_failure(self, failure_class: str, error: str, started: float) -> Reward:
        """Total 0.0 with the failure class and the error; the error made encodable (a lone surrogate in an
        exception's message would otherwise send the trajectory to dead-letters after all)."""
        error = error.encode("utf-8", "replace").decode("utf-8")
        log.warning("reward %s: %s", failure_class, error)
        return Reward(total=0.0, reward_version=self.settings.reward_version, failure_class=failure_class,
                      violations=[f"{failure_class}: {error}"[:_ERROR_CHARS]],
                      latency_ms=(time.perf_counter() - started) * 1000, scored_at=now_ms())
