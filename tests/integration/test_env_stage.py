"""The env stage as a real process against the broker: trajectories, observations, failures, dead letters."""
from __future__ import annotations

import collections

import pytest

from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Episode, SamplingParams, Task, Turn
from tests.helpers.kafka import produce, read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def episode(i: int, env: str, *actions: str, max_turns: int = 4, version: int = 0) -> Episode:
    """An episode as rollout writes it to ``actions``; observations between actions are already tokenized."""
    task = Task(task_id=f"task-{i}", group_id=f"group-{i}", task_name=env, env_name=env, env_version="1",
                prompt="what is 12+34? use calc", sampling=SamplingParams(), created_at=hdr.now_ms(), answer="46",
                max_turns=max_turns if env != "single" else 1)
    ep = Episode(episode_id=f"group-{i}:0", group_id=task.group_id, sample_index=0, task=task, trace_id=f"tr{i}")
    for n, text in enumerate(actions):
        if n:
            start = len(ep.token_ids)
            ep.turns.append(Turn("observation", "=46\n", start, start + 3))
            ep.token_ids += [9, 9, 9]
            ep.loss_mask += [0, 0, 0]
            ep.behaviour_logprobs += [0.0, 0.0, 0.0]
        start = len(ep.token_ids)
        ep.token_ids += [1, 2, 3, 4]
        ep.loss_mask += [1, 1, 1, 1]
        ep.behaviour_logprobs += [-1.0] * 4
        ep.turns.append(Turn("action", text, start, len(ep.token_ids), policy_version=version + n,
                             finish_reason="stop"))
    return ep


@pytest.mark.timeout(330)
def test_env_stage_end_to_end(bootstrap, run_name, tmp_path, start_stage):
    singles = [episode(i, "single", "cba", version=2) for i in range(5)]
    tool_calls = [episode(10 + i, "calculator", f"calc({i}+{40 + i})") for i in range(4)]
    finals = [episode(20 + i, "calculator", "calc(12+34)", "46", version=3) for i in range(2)]
    hangs = [episode(30, "python", "```python\nimport time\ntime.sleep(60)\n```"),
             episode(31, "calculator", "calc(9**9**9)")]
    bad_last_turn = episode(40, "calculator", "calc(1+1)")
    bad_last_turn.turns.append(Turn("observation", "=2\n", 4, 4))
    unknown_env = episode(41, "nosuchenv", "x")
    bad = [bad_last_turn, unknown_env]
    everything = singles + tool_calls + finals + hangs + bad
    produce(bootstrap, run_name, "actions",
            [(ep.episode_id.encode(), ep, hdr.build(min(t.policy_version for t in ep.turns if t.role == "action"),
                                                    hdr.new_traceparent())) for ep in everything])
    log = tmp_path / "env.log"
    proc = start_stage("env", bootstrap, run_name, "--tool-timeout-s", "2", "--sandbox", "subprocess",
                       "--handler-timeout-s", "20", "--batch-size", "8", log_path=log)
    n_traj = len(singles) + len(finals) + len(hangs)
    try:
        trajectories = read_all(bootstrap, run_name, "trajectories", expect=n_traj, timeout=120)
        observations = read_all(bootstrap, run_name, "observations", expect=len(tool_calls), timeout=60)
        letters = read_all(bootstrap, run_name, "dead-letters", expect=len(bad), timeout=60)
    finally:
        assert proc.stop(timeout=30) == 0, proc.log_tail()

    # Counts reconcile: every input became exactly one output or one dead letter.
    assert len(trajectories) + len(observations) + len(letters) == len(everything), log.read_text()[-3000:]
    by_id = {t.record.trajectory_id: t for t in trajectories}
    assert len(by_id) == n_traj

    for ep in singles:
        t = by_id[ep.episode_id]
        assert t.key == ep.group_id.encode() and t.headers["policy_version"] == b"2"
        traj = t.record
        assert traj.status == "ok" and traj.response == "cba" and traj.min_policy_version == 2
        assert "env.end" in traj.stage_times and traj.trace_id == ep.trace_id

    obs = {o.record.episode_id: o for o in observations}
    for i, ep in enumerate(tool_calls):
        o = obs[ep.episode_id]
        assert o.key == ep.task.task_id.encode()  # every record of an episode: its task id
        last = o.record.turns[-1]
        assert last.role == "observation" and last.text == f"={i + 40 + i}\n"
        assert last.token_start == last.token_end == len(o.record.token_ids)
        assert o.record.turns[0].tool_call.arguments == f"{i}+{40 + i}"

    for ep in finals:
        traj = by_id[ep.episode_id].record
        assert traj.status == "ok" and (traj.min_policy_version, traj.max_policy_version) == (3, 4)
        assert by_id[ep.episode_id].headers["policy_version"] == b"3"
        assert traj.turns[-1].text == "46" and traj.response == "calc(12+34)=46\n46"

    for ep in hangs:
        traj = by_id[ep.episode_id].record
        assert traj.status == "failed", traj
        assert (traj.failure.failure_class, traj.failure.stage) == ("timeout", "env")
        assert traj.turns[-1].tool_result.failure_class == "timeout"

    reasons = collections.Counter(letter.record.reason for letter in letters)
    assert reasons == {"invalid": 2}
    assert {letter.key for letter in letters} == {ep.episode_id.encode() for ep in bad}
