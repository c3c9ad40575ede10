"""The trainer on teacher feedback against the real broker: RL + OPD in one step with each term in the version's
metrics, feedback whose arrays do not fit dead-lettered with both lengths, and a timed-out sample never trained on
(its group trains without it)."""
from __future__ import annotations

import threading

import pytest

from rlstream.config import KafkaSettings, LoopSettings
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Reward, ScoredTrajectory, TeacherFeedback
from rlstream.trainer.service import TrainerService, TrainerSettings
from tests.helpers.kafka import make_trajectory, produce, read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
G = 4


class SpyTrainer(TrainerService):
    """The real trainer; the spy records how many samples of each group reached the update."""

    def __init__(self, settings, loop):
        super().__init__(settings, loop)
        self.trained: list[dict[str, int]] = []

    def _step(self, groups):
        self.trained.append({g.group_id: len(g.items) for g in groups})
        super()._step(groups)


def feedback(gid: int, i: int, reward: float) -> TeacherFeedback:
    """A sample of group ``gid`` with the teacher's sampled-token log-probs and its top-2."""
    traj = make_trajectory(gid * 100 + i, group=gid, response="cba" if reward else "abc", n_tokens=4)
    traj.task.group_size = G
    traj.task.prompt_token_ids = [1, 5, 6, 7, 40]
    traj.token_ids = [7, 6, 5, 2]
    fb = TeacherFeedback(ScoredTrajectory(traj, Reward(total=reward, reward_version="v1")), "t1",
                         [-0.5, -1.0, -0.2, -0.1], teacher_top_k=2)
    fb.teacher_topk_ids = [7, 8, 6, 9, 5, 4, 2, 3]
    fb.teacher_topk_logprobs = [-0.5, -1.5, -1.0, -1.2, -0.2, -2.0, -0.1, -3.0]
    return fb


@pytest.mark.timeout(300)
def test_rl_plus_opd_step_with_bad_and_timed_out_feedback(bootstrap, run_name, tmp_path):
    good = [feedback(1, i, r) for i, r in enumerate((1.0, 0.0, 0.0, 1.0))]
    short = [feedback(2, i, r) for i, r in enumerate((1.0, 0.0, 1.0, 0.0))]
    short[3].teacher_logprobs = [-0.5, -1.0, -0.2]  # one short of the trajectory's 4 tokens
    late = [feedback(3, i, r) for i, r in enumerate((0.0, 1.0, 1.0, 0.0))]
    late[2] = TeacherFeedback(late[2].scored, "t1", [], status="timeout")  # the teacher ran out of time
    produce(bootstrap, run_name, "feedback", [(f"task-{fb.scored.trajectory.group_id}".encode(), fb,
                                               hdr.build(0, hdr.new_traceparent(), "v1"))
                                              for fb in good + short + late])
    settings = TrainerSettings(weights=str(tmp_path / "weights"), warmup_steps=0, window_groups=4,
                               source="feedback", loss="ppo+opd", opd_coef=0.5, max_steps=1)
    trainer = SpyTrainer(settings, LoopSettings(groups_per_step=3, eta=1))
    thread = threading.Thread(target=trainer.serve, args=(KafkaSettings(bootstrap=bootstrap, run=run_name),
                                                          RuntimeSettings(poll_timeout_s=0.1)), daemon=True)
    thread.start()
    thread.join(240)
    assert not thread.is_alive(), "the trainer did not take its step"
    # The groups with a dead-lettered and a timed-out sample completed without them.
    assert trainer.trained == [{"task-1": 4, "task-2": 3, "task-3": 3}]
    versions = read_all(bootstrap, run_name, "policy-versions", expect=2, timeout=30)
    v1 = [v.record for v in versions if v.record.version == 1][0]
    assert v1.samples_trained == 10
    for key in ("loss_rl", "opd_kl", "opd_shaping", "opd_coef", "kl_forward", "kl_reverse", "teacher_top1_agreement"):
        assert key in v1.metrics, sorted(v1.metrics)
    assert v1.metrics["opd_coef"] == 0.5
    letters = [d.record for d in read_all(bootstrap, run_name, "dead-letters", expect=1, timeout=30)]
    assert [(d.stage, d.reason) for d in letters] == [("trainer", "invalid")]
    assert "teacher_logprobs has 3 entries but the trajectory has 4 tokens" in letters[0].error
