"""``rlstream run env+reward`` against the real broker (rlstream/runtime/chain.py): both stages in one process and
one transaction, every topic written as the two stages write it apart, a SIGKILL losing and duplicating nothing,
each stage's dead letters under its own name, and a plain reward worker on the same run handling nothing twice."""
from __future__ import annotations

import collections

import pytest

from rlstream.runtime.chain import HANDLED_BY
from rlstream.schemas import headers as hdr
from tests.helpers.episodes import one_action_episode
from tests.helpers.kafka import produce, read_all, wait_consumed, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.parametrize("mode", [(), ("--no-pipeline",)], ids=["pipelined", "batch"])
@pytest.mark.timeout(420)
def test_env_and_reward_chained_keep_every_topic_and_a_kill_loses_and_duplicates_nothing(bootstrap, run_name,
                                                                                         start_stage, mode):
    n = 400
    eps = [one_action_episode(i, "cba" if i % 3 else "abc") for i in range(n)]
    tool_call = one_action_episode(n, "calc(2+3)", env="calculator")  # a tool call: an observation back to rollout
    unknown_env = one_action_episode(n + 1, "x", env="nosuchenv")  # env's dead letter
    unjudgeable = one_action_episode(n + 2, "nan")  # reward's dead letter (tests.reward_fns:slow_picky gives NaN)
    everything = [*eps, tool_call, unknown_env, unjudgeable]
    produce(bootstrap, run_name, "actions", [(ep.episode_id.encode(), ep, hdr.build(2, hdr.new_traceparent()))
                                             for ep in everything])
    args = ["--reward", "tests.reward_fns:slow_picky", "--concurrency", "4", "--instance", "w0", "--batch-size", "16",
            "--sandbox", "subprocess", *mode]
    proc = start_stage("env+reward", bootstrap, run_name, *args)
    wait_for(lambda: len(read_all(bootstrap, run_name, "rewards", timeout=5)) >= 40, 120, "first committed rewards")
    proc.kill()
    assert len(read_all(bootstrap, run_name, "rewards", timeout=5)) < n, "it finished before the kill; raise n"
    proc.start()  # the same --instance fences what the killed one left open
    try:
        wait_consumed(bootstrap, f"{run_name}.env", run_name, "actions", timeout=180)
    finally:
        assert proc.stop() == 0, proc.log_tail()

    trajectories = read_all(bootstrap, run_name, "trajectories")
    rewards = read_all(bootstrap, run_name, "rewards")
    letters = read_all(bootstrap, run_name, "dead-letters")
    observations = read_all(bootstrap, run_name, "observations")
    # Every topic as unchained: a trajectory per finished episode, a reward per judgeable trajectory, each once.
    per_traj = collections.Counter(t.record.trajectory_id for t in trajectories)
    assert len(per_traj) == n + 1 and max(per_traj.values()) == 1, "a trajectory lost or written twice"
    per_reward = collections.Counter(r.record.trajectory.trajectory_id for r in rewards)
    assert set(per_reward) == {ep.episode_id for ep in eps} and max(per_reward.values()) == 1
    assert [o.record.episode_id for o in observations] == [tool_call.episode_id]
    totals = {r.record.trajectory.trajectory_id: r.record.reward.total for r in rewards}
    assert all(totals[ep.episode_id] == (1.0 if ep.turns[0].text == "cba" else 0.0) for ep in eps)
    # The headers the reward stage reads and writes, as apart; the hand-over marked for the reward group.
    assert all(r.headers["policy_version"] == b"2" and r.headers["reward_version"] == b"v1" for r in rewards)
    assert all(t.headers[HANDLED_BY] == f"{run_name}.reward".encode() for t in trajectories)
    # Each stage's dead letter under its own name; the reward's was never read from its topic (offset -1).
    by_stage = {d.record.stage: d.record for d in letters}
    assert set(by_stage) == {"env", "reward"} and len(letters) == 2
    assert by_stage["env"].topic.endswith(".actions") and by_stage["env"].offset >= 0
    assert by_stage["reward"].topic.endswith(".trajectories") and by_stage["reward"].offset == -1
    assert by_stage["reward"].reason == "invalid" and "not finite" in by_stage["reward"].error

    # A plain reward worker on the same run commits past what the chain handled, and writes nothing again.
    plain = start_stage("reward", bootstrap, run_name, "--reward", "tests.reward_fns:picky")
    try:
        wait_consumed(bootstrap, f"{run_name}.reward", run_name, "trajectories", timeout=120)
    finally:
        assert plain.stop() == 0, plain.log_tail()
    assert len(read_all(bootstrap, run_name, "rewards")) == len(rewards)
    assert len(read_all(bootstrap, run_name, "dead-letters")) == 2
