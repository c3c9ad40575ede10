"""Multi-turn agent episodes through the real stages: rollout (a real Llama folder on transformers) ⇄ env (a tool
plugin by dotted path, in process or behind ``rlstream env-server``) over actions and observations, then reward.

Every episode runs 4 actions: write a file (the model's own text), read it back with the shell in the next step
(the workspace persisted), a malformed call (answered with its parse error), a final answer. Checked on the
rewards topic: every turn's tokens, mask, log-probs, version, tool call and result, and latency; on prompts,
actions and observations: one key and one partition for all of an episode's records.
"""
from __future__ import annotations

import collections
import json
import shutil
import socket

import pytest

from rlstream.envs.tools import ToolCallError, parse_tool_call
from rlstream.infra.supervisor import StageProc, stage_env
from rlstream.policy.weights import WeightStore
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion, SamplingParams, Task
from tests.agent_envs import MALFORMED
from tests.helpers import ROOT
from tests.helpers.kafka import produce, read_all
from tests.helpers.models import llama_folder

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TASKS, GROUP, TURNS, MAX_TOKENS = 3, 2, 4, 6


def publish_v0(bootstrap: str, run: str, folder, root) -> None:
    """Version 0 of the policy, as the trainer announces it (no trainer needed to generate)."""
    uri = WeightStore(str(root)).put("policy", 0, lambda out: shutil.copytree(folder, out, dirs_exist_ok=True))
    now = hdr.now_ms()
    produce(bootstrap, run, "policy-versions", [(b"policy", PolicyVersion("policy", 0, uri, created_at=now,
                                                                          published_at=now),
                                                 hdr.build(0, hdr.new_traceparent()))])


def tasks() -> list[Task]:
    out = []
    for i in range(TASKS):
        messages = [{"role": "user", "content": f"Task {i}: keep notes with the tools, then answer."}]
        out.append(Task(task_id=f"agent-{i}", group_id=f"agent-{i}", task_name="agent", env_name="agent",
                        env_version="", prompt=messages[0]["content"], created_at=hdr.now_ms(),
                        sampling=SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i),
                        metadata={"messages": json.dumps(messages), "observation_role": "tool"},
                        group_size=GROUP, max_turns=TURNS))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["plugin", "remote"])
def test_multi_turn_tool_episodes_through_the_stages(where, bootstrap, run_name, tmp_path, start_stage):
    folder = llama_folder(tmp_path / "llama", max_positions=512)
    publish_v0(bootstrap, run_name, folder, tmp_path / "weights")
    produce(bootstrap, run_name, "prompts", [(t.task_id.encode(), t, None) for t in tasks()])
    workspaces = tmp_path / "workspaces"
    workspaces.mkdir()
    server = None
    if where == "plugin":
        env_args = ("--env", "agent=tests.agent_envs:scripted")
    else:
        port = free_port()
        server = StageProc("env-server", ["env-server", "--env", "tests.agent_envs:scripted", "--port", str(port),
                                          "--sandbox", "subprocess", "--workspace-root", str(workspaces)],
                           stage_env(bootstrap, run_name), tmp_path / "env-server.log", cwd=ROOT).start()
        env_args = ("--env-url", f"agent=http://127.0.0.1:{port}")
    procs = {"rollout": start_stage("rollout", bootstrap, run_name, "--backend", "transformers",
                                    "--wait-policy-s", "120"),
             "env": start_stage("env", bootstrap, run_name, *env_args, "--sandbox", "subprocess",
                                "--workspace-root", str(workspaces)),
             "reward": start_stage("reward", bootstrap, run_name, "--reward", "tests.reward_fns:token_checksum")}
    n = TASKS * GROUP
    try:
        rewards = read_all(bootstrap, run_name, "rewards", expect=n, timeout=300)
        prompts = read_all(bootstrap, run_name, "prompts", expect=TASKS)
        actions = read_all(bootstrap, run_name, "actions", expect=n * TURNS, timeout=30)
        observations = read_all(bootstrap, run_name, "observations", expect=n * (TURNS - 1), timeout=30)
    finally:
        if server is not None:
            procs["env-server"] = server
        codes = {name: p.stop(timeout=60) for name, p in procs.items()}
    assert set(codes.values()) == {0}, {name: p.log_tail(3000) for name, p in procs.items()}
    assert len(rewards) == n and len(actions) == n * TURNS and len(observations) == n * (TURNS - 1)
    # Every workspace went with its episode (and the server's with the server).
    assert not list(workspaces.iterdir())

    # One key, one partition, for every record of an episode: the prefix cache's worker sees every turn.
    where_task = {p.record.task_id: (p.key, p.partition) for p in prompts}
    turns_seen = collections.Counter()
    for seen in actions + observations:
        task_id = seen.record.task.task_id
        assert (seen.key, seen.partition) == where_task[task_id] == (task_id.encode(), where_task[task_id][1])
        turns_seen[seen.record.episode_id] += 1
    assert set(turns_seen.values()) == {TURNS + TURNS - 1}

    for seen in rewards:
        traj = seen.record.trajectory
        assert traj.failure is None and traj.status in ("ok", "truncated"), traj.failure
        assert traj.task.env_version == ("remote" if where == "remote" else "1")
        roles = [t.role for t in traj.turns]
        assert roles == ["action", "observation"] * (TURNS - 1) + ["action"]
        assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.behaviour_logprobs)
        position = 0
        for t in traj.turns:
            assert t.token_start == position < t.token_end, "turns tile the tokens, each with some"
            position = t.token_end
            span = slice(t.token_start, t.token_end)
            mine = t.role == "action"
            assert set(traj.loss_mask[span]) == {int(mine)}
            assert all(lp < 0 for lp in traj.behaviour_logprobs[span]) if mine else \
                set(traj.behaviour_logprobs[span]) == {0.0}
            assert 0 < t.started_at <= t.finished_at, f"{t.role} turn latency recorded"
            if mine:
                assert t.policy_version == 0 and t.token_end - t.token_start <= MAX_TOKENS
                # Its version segments, as the engine reported them: one version, every token of the turn.
                assert (t.segment_versions, t.segment_tokens) == ([0], [t.token_end - t.token_start])
            else:
                assert (t.segment_versions, t.segment_tokens) == ([], [])
        assert position == len(traj.token_ids)
        a1, o1, a2, o2, a3, o3, a4 = traj.turns
        # Turn 1: the model's text went into a file of the workspace.
        assert (a1.tool_call.name, json.loads(a1.tool_call.arguments)) == (
            "write_file", {"path": "notes/turn1.txt", "content": a1.text})
        assert a1.tool_result.exit_code == 0 and o1.text.startswith("<tool_response>\nwrote ")
        # Turn 2: the shell, in a later step, read it back: the file persisted across steps.
        assert a2.tool_call.name == "shell" and a2.tool_result.exit_code == 0
        assert a2.tool_result.output == f"{a1.text}|\nturn1.txt\n" and a2.tool_result.duration_ms > 0
        assert o2.text == f"<tool_response>\n{a1.text}|\nturn1.txt\n</tool_response>\n"
        # Turn 3: a malformed call is answered with its parse error, and the episode goes on.
        with pytest.raises(ToolCallError) as parse_error:
            parse_tool_call(MALFORMED)
        assert a3.tool_call.name == "invalid" and a3.tool_result.exit_code == 2
        assert o3.text == f"<tool_error>{parse_error.value}</tool_error>\n"
        # Turn 4: the final answer ends it.
        assert a4.tool_call is None and seen.record.reward.total >= 0
