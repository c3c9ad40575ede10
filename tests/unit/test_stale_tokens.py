"""Per-token policy versions: rollout records each action turn's version segments as the engine reports them, and
the trainer's token rule masks out only the tokens older than η (``rlstream.policy.staleness``)."""
from __future__ import annotations

import pytest

from rlstream.policy.staleness import StalenessFilter, mask_stale_tokens, version_segments
from rlstream.runtime.stage import Incoming
from rlstream.schemas.records import SamplingParams, Task, Turn
from rlstream.stages.rollout import RolloutSettings, RolloutStage, run_lengths
from tests.helpers.engines import FakeBackend, FakeWatcher, pv


class FakeTokenizer:
    def __call__(self, text, **_):
        return {"input_ids": [1, 2, 3]}

    def decode(self, ids, **_):
        return "x" * len(ids)


def test_run_lengths():
    assert run_lengths([3, 3, 4, 4, 4]) == ([3, 4], [2, 3])
    assert run_lengths([7]) == ([7], [1])
    assert run_lengths([1, 2, 1]) == ([1, 2, 1], [1, 1, 1])
    assert run_lengths([]) == ([], [])


@pytest.mark.parametrize("mid_generation, segments", [(True, ([0, 1], [2, 2])), (False, ([0], [4]))])
def test_rollout_records_the_version_segments_the_engine_reports(mid_generation, segments):
    stage = RolloutStage(RolloutSettings(swap="step", retry_load_s=60, max_context=64))
    stage.follower.watcher = FakeWatcher(pv(0))
    stage.backend, stage.tokenizer, stage.follower.version = FakeBackend(mid_generation=mid_generation), FakeTokenizer(), 0
    stage.follower.watcher.pending = [(3, pv(1))]  # announced after two engine steps
    task = Task(task_id="g", group_id="g", task_name="t", env_name="e", env_version="1", prompt="abc>",
                sampling=SamplingParams(temperature=1.0, max_tokens=4), created_at=0, group_size=1)
    [[out]] = stage.handle_batch([Incoming("prompts", 0, 0, None, {}, -1, task)])
    [turn] = out.record.turns
    # A swap between engine steps splits the turn in two; a backend that swaps only between calls keeps one.
    assert (turn.segment_versions, turn.segment_tokens) == segments
    assert turn.policy_version == 0 and sum(turn.segment_tokens) == turn.token_end - turn.token_start


def turns():
    """action [0, 4) sampled 2 tokens under v0 then 2 under v1; observation [4, 6); action [6, 9), v2, no segments
    recorded (an older writer)."""
    return [Turn("action", "a", 0, 4, policy_version=0, segment_versions=[0, 1], segment_tokens=[2, 2]),
            Turn("observation", "o", 4, 6),
            Turn("action", "b", 6, 9, policy_version=2)]


def test_version_segments_fall_back_to_the_turn_then_the_header():
    a, _, b = turns()
    assert version_segments(a, 9) == [(0, 2), (1, 2)]
    assert version_segments(b, 9) == [(2, 3)]
    assert version_segments(Turn("action", "c", 0, 5), 9) == [(9, 5)]
    with pytest.raises(ValueError, match="do not cover its tokens"):
        version_segments(Turn("action", "d", 0, 5, segment_versions=[1], segment_tokens=[4]), 0)


def test_the_token_rule_masks_only_tokens_older_than_eta():
    mask = [1, 1, 1, 1, 0, 0, 1, 1, 1]
    # Trainer at v2, η 1: the v0 tokens are stale (2 - 0 > 1), v1 and v2 are not.
    new, masked, left = mask_stale_tokens(StalenessFilter(1), 2, turns(), mask, fallback_version=0)
    assert new == [0, 0, 1, 1, 0, 0, 1, 1, 1] and (masked, left) == (2, 5)
    assert mask == [1, 1, 1, 1, 0, 0, 1, 1, 1], "the caller's mask is not changed in place"
    # At v3: v0 and v1 are stale; the second turn (v2) stays.
    new, masked, left = mask_stale_tokens(StalenessFilter(1), 3, turns(), mask, fallback_version=0)
    assert new == [0, 0, 0, 0, 0, 0, 1, 1, 1] and (masked, left) == (4, 3)
    # At v4 nothing is left: the sample is dropped as stale.
    _, masked, left = mask_stale_tokens(StalenessFilter(1), 4, turns(), mask, fallback_version=0)
    assert (masked, left) == (7, 0)
    # Tokens the loss mask already left out are not counted as masked.
    _, masked, _ = mask_stale_tokens(StalenessFilter(1), 2, turns(), [0, 1, 1, 1, 0, 0, 1, 1, 1], 0)
    assert masked == 1
