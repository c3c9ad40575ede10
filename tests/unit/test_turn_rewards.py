"""Per-turn rewards: the reward contract carries one score per action turn, and the trainer turns them into
per-token advantages under the rule of ``rlstream.trainer.advantages.turn_advantages`` (hand-computed here)."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rlstream.kafka.records import Incoming
from rlstream.rewards import RewardResult
from rlstream.rewards.compose import combine
from rlstream.schemas.records import Reward, SamplingParams, ScoredTrajectory, Task, Trajectory, Turn
from rlstream.stages.reward import RewardSettings, RewardStage
from rlstream.trainer.advantages import token_row, turn_advantages
from rlstream.trainer.update import build_batch


def test_turn_advantages_add_the_normalised_return_to_go_to_the_outcome_advantage():
    # Turn scores [1, 0] and [0, 1]: mean 0.5, std 0.5, normalised [1, -1] and [-1, 1]; return-to-go [0, -1] and
    # [0, 1]; plus the outcome advantages 1 and -1.
    out = turn_advantages(torch.tensor([1.0, -1.0]), [[1.0, 0.0], [0.0, 1.0]], eps=0.0)
    assert out == [pytest.approx([1.0, 0.0]), pytest.approx([-1.0, 0.0])]


def test_a_sample_without_turn_scores_keeps_its_outcome_advantage_and_adds_nothing_to_the_statistics():
    # Scores 2, 0, 1 (one sample): mean 1, population std sqrt(2/3); normalised s, -s, 0 with s = sqrt(1.5);
    # return-to-go 0, -s, 0. The other sample has none: its turns get nothing.
    s = math.sqrt(1.5)
    out = turn_advantages(torch.tensor([0.5, -0.5]), [[2.0, 0.0, 1.0], []], eps=0.0)
    assert out == [pytest.approx([0.5, 0.5 - s, 0.5]), []]
    # No turn scores in the group: nothing per turn.
    assert turn_advantages(torch.tensor([1.0, -1.0]), [[], []]) == [[], []]
    # All equal: the turns add nothing (std 0 is guarded by eps, not a NaN).
    assert turn_advantages(torch.tensor([0.25]), [[3.0, 3.0]]) == [pytest.approx([0.25, 0.25])]


def test_token_row_lays_each_action_turn_over_its_tokens():
    # Prompt of 2, action [0, 2), observation [2, 3), action [3, 5), one pad.
    assert token_row(0.5, [1.5, -2.0], [(0, 2), (3, 5)], offset=2, width=8) == [0.5, 0.5, 1.5, 1.5, 0.5, -2.0, -2.0,
                                                                               0.5]
    assert token_row(0.5, [], [(0, 2)], offset=1, width=4) == [0.5] * 4
    with pytest.raises(ValueError, match="2 turn advantages for 1 action turns"):
        token_row(0.0, [1.0, 2.0], [(0, 2)], offset=0, width=3)


def two_turns(i: int, total: float, scores: list[float], split: str = "train") -> ScoredTrajectory:
    """An episode of action (2 tokens), observation (1 token), action (2 tokens) after a 2-token prompt."""
    task = Task(task_id="g", group_id="g", task_name="tool", env_name="tools", env_version="1", prompt="x",
                sampling=SamplingParams(), created_at=0, prompt_token_ids=[1, 2], group_size=2, split=split,
                answer="no")
    turns = [Turn("action", "ok", 0, 2, policy_version=0), Turn("observation", "obs", 2, 3),
             Turn("action", "no", 3, 5, policy_version=0)]
    traj = Trajectory(trajectory_id=f"g:{i}", group_id="g", sample_index=i, task=task, response="", min_policy_version=0,
                      max_policy_version=0, token_ids=[5, 6, 7, 8, 9], loss_mask=[1, 1, 0, 1, 1],
                      behaviour_logprobs=[-1.0, -1.0, 0.0, -1.0, -1.0], turns=turns)
    return ScoredTrajectory(traj, Reward(total, "v1", turn_scores=scores))


def test_the_batch_carries_each_turns_advantage_on_its_tokens():
    # Totals 1, 0: GRPO advantages ~1, ~-1. Turn scores [1, 0], [0, 1]: turn advantages [1, 0], [-1, 0] (above).
    b = build_batch([[two_turns(0, 1.0, [1.0, 0.0]), two_turns(1, 0.0, [0.0, 1.0])]], "grpo", pad_id=0)
    assert b.advantages.shape == b.loss_mask.shape == (2, 6)
    # Column c is the target token c + 1: prompt token 2 (c 0), turn 1 (c 1, 2), observation (c 3), turn 2 (c 4, 5).
    assert b.loss_mask.tolist()[0] == [0, 1, 1, 0, 1, 1]
    assert b.advantages[0].tolist() == pytest.approx([1, 1, 1, 1, 0, 0], abs=1e-4)
    assert b.advantages[1].tolist() == pytest.approx([-1, -1, -1, -1, 0, 0], abs=1e-4)


def test_a_composite_adds_its_parts_turn_scores_by_weight():
    parts = [("a", 1.0, None), ("b", 0.5, None), ("c", 2.0, None)]
    out = combine(parts, [RewardResult(1.0, turn_scores=[1.0, 0.0]), RewardResult(0.0, turn_scores=[2.0, 4.0]),
                          RewardResult(1.0)])
    assert out.total == 3.0 and out.turn_scores == [2.0, 2.0]
    with pytest.raises(ValueError, match="different numbers of turn scores"):
        combine(parts[:2], [RewardResult(1.0, turn_scores=[1.0]), RewardResult(1.0, turn_scores=[1.0, 2.0])])


def score(fn: str, scored: ScoredTrajectory):
    stage = RewardStage(RewardSettings(reward=f"tests.reward_fns:{fn}"))
    [out] = asyncio.run(stage.handle(Incoming("trajectories", 0, 0, b"g", {}, 0, scored.trajectory)))
    return out


def test_the_reward_stage_carries_turn_scores_and_fails_a_judge_that_miscounts_them():
    out = score("per_turn", two_turns(0, 0.0, []))
    assert out.topic == "rewards" and out.record.reward.turn_scores == [1.0, 0.0]
    out = score("miscounted_turns", two_turns(0, 0.0, []))
    reward = out.record.reward
    assert reward.failure_class == "judge_error" and reward.turn_scores == []
    assert "3 scores but the trajectory has 2 action turns" in reward.violations[0]


def test_eval_lane_results_go_to_eval_rewards():
    assert score("per_turn", two_turns(0, 0.0, [], split="heldout")).topic == "eval-rewards"
    assert score("per_turn", two_turns(0, 0.0, [], split="eval")).topic == "eval-rewards"


def test_calculator_turns_credits_the_call_and_the_answer_on_their_own_turns():
    from rlstream.rewards import VERIFIERS
    from rlstream.schemas.records import ToolCall, ToolResult
    task = Task(task_id="c", group_id="c", task_name="calculator", env_name="calculator", env_version="1",
                prompt="what is 12*13? use calc", sampling=SamplingParams(), created_at=0, answer="156")
    call = Turn("action", "calc(12*13)", 0, 11, tool_call=ToolCall("calc", "12*13"), tool_result=ToolResult("156"))
    answer = Turn("action", "156", 14, 17)
    traj = Trajectory(trajectory_id="c:0", group_id="c", sample_index=0, task=task, response="",
                      min_policy_version=0, max_policy_version=0,
                      turns=[call, Turn("observation", "=156\n", 11, 14), answer])
    result = VERIFIERS["calculator_turns"](traj)
    assert (result.total, result.turn_scores) == (1.0, [1.0, 1.0])
    answer.text = "155"
    result = VERIFIERS["calculator_turns"](traj)
    assert (result.total, result.turn_scores) == (0.0, [1.0, 0.0])
