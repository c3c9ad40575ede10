"""The trainer's η rules through its window, against the real broker: ``--stale-rule sample`` drops a sample whose
oldest token is too old; ``--stale-rule token`` keeps it with only those tokens masked out. Both are counted in the
published version's metrics. An eval-lane sample found on the rewards topic never reaches the window, and turn
scores that do not fit their trajectory are dead-lettered."""
from __future__ import annotations

import threading

import pytest

from rlstream.config import KafkaSettings, LoopSettings
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Reward, ScoredTrajectory, Turn
from rlstream.trainer.service import TrainerService, TrainerSettings
from tests.helpers.kafka import make_trajectory, produce, read_all, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
G = 2


class SpyTrainer(TrainerService):
    """The real trainer; the spy records each group's loss masks as they reached an update."""

    def __init__(self, settings, loop):
        super().__init__(settings, loop)
        self.trained: dict[str, list[list[int]]] = {}

    def _step(self, groups):
        for g in groups:
            self.trained[g.group_id] = [it.payload.trajectory.loss_mask for it in g.items]
        super()._step(groups)


def group(gid: str, version: int, spans_two: bool = False, split: str = "train") -> list[tuple]:
    """G samples of 4 tokens under ``version``; ``spans_two``: the first 2 tokens under ``version`` (turn 1), the
    last 2 under ``version + 1`` (turn 2: its first segment carries the newer version)."""
    out = []
    for i in range(G):
        traj = make_trajectory(i, group=0, version=version)
        traj.trajectory_id, traj.group_id = f"{gid}:{i}", gid
        traj.task.task_id = traj.task.group_id = gid
        traj.task.group_size, traj.task.split = G, split
        traj.task.prompt_token_ids = [1, 5, 6, 7, 40]
        if spans_two:
            traj.turns = [Turn("action", "a", 0, 2, policy_version=version, segment_versions=[version],
                               segment_tokens=[2]),
                          Turn("action", "b", 2, 4, policy_version=version + 1, segment_versions=[version + 1],
                               segment_tokens=[2])]
        # One key for all: one partition, so the trainer reads the groups in the order they are produced.
        out.append((b"k", ScoredTrajectory(traj, Reward(total=float(i), reward_version="v1")),
                    hdr.build(version, hdr.new_traceparent(), "v1")))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rule", ["sample", "token"])
def test_stale_rule_through_the_window(rule, bootstrap, run_name, tmp_path):
    settings = TrainerSettings(weights=str(tmp_path / "weights"), warmup_steps=0, window_groups=4, stale_rule=rule)
    trainer = SpyTrainer(settings, LoopSettings(groups_per_step=2, eta=0))
    thread = threading.Thread(target=trainer.serve, args=(KafkaSettings(bootstrap=bootstrap, run=run_name),
                                                          RuntimeSettings(poll_timeout_s=0.1)), daemon=True)
    thread.start()
    try:
        wait_for(lambda: trainer.version >= 0, 120, "v0")
        produce(bootstrap, run_name, "rewards", group("warm-1", 0) + group("warm-2", 0))
        wait_for(lambda: trainer.version >= 1, 180, "v1")
        # At v1 with η 0: "spans" has its first turn's tokens from v0 (stale) and its second's from v1.
        # "held" is eval-lane work on the wrong topic: never trained, never waited for.
        produce(bootstrap, run_name, "rewards", group("held", 1, split="heldout") + group("spans", 0, spans_two=True)
                + group("fresh-1", 1) + group("fresh-2", 1))
        wait_for(lambda: trainer.version >= 2, 180, "v2")
    finally:
        trainer.stop()
        thread.join(60)
    assert not thread.is_alive()
    assert "held" not in trainer.trained
    v2 = [r.record for r in read_all(bootstrap, run_name, "policy-versions", expect=3)][-1]
    if rule == "sample":
        # The whole sample goes: two stale samples, no token masked; the step trains the two fresh groups.
        assert "spans" not in trainer.trained and {"fresh-1", "fresh-2"} <= set(trainer.trained)
        assert (v2.metrics["stale_step"], v2.metrics["stale_tokens_step"]) == (G, 0)
    else:
        # Kept, with its v0 tokens masked out of the loss: two tokens of each sample.
        assert trainer.trained["spans"] == [[0, 0, 1, 1]] * G
        assert (v2.metrics["stale_step"], v2.metrics["stale_tokens_step"]) == (0, 2 * G)
        assert trainer.counter.stale_tokens == 2 * G


@pytest.mark.timeout(300)
def test_turn_scores_that_do_not_fit_their_trajectory_are_dead_lettered_by_the_trainer(bootstrap, run_name, tmp_path):
    """The reward stage checks the count of turn scores; a record from another writer that does not fit goes to
    dead-letters with its reason, and its group completes without it."""
    settings = TrainerSettings(weights=str(tmp_path / "weights"), warmup_steps=0, window_groups=4)
    trainer = SpyTrainer(settings, LoopSettings(groups_per_step=2, eta=1))
    thread = threading.Thread(target=trainer.serve, args=(KafkaSettings(bootstrap=bootstrap, run=run_name),
                                                          RuntimeSettings(poll_timeout_s=0.1)), daemon=True)
    thread.start()
    try:
        wait_for(lambda: trainer.version >= 0, 120, "v0")
        bad = group("bad", 0)
        bad[0][1].reward.turn_scores = [1.0, 0.0]  # two scores, one action turn
        produce(bootstrap, run_name, "rewards", bad + group("good-1", 0) + group("good-2", 0))
        wait_for(lambda: trainer.version >= 1, 180, "v1")
    finally:
        trainer.stop()
        thread.join(60)
    assert {g: len(masks) for g, masks in trainer.trained.items()} == {"bad": G - 1, "good-1": G}
    [letter] = [s.record for s in read_all(bootstrap, run_name, "dead-letters", expect=1)]
    assert (letter.stage, letter.reason) == ("trainer", "invalid")
    assert "2 scores but the trajectory has 1 action turns" in letter.error
