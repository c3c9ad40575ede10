"""Per-episode envs without Kafka: tool-call parsing, the workspace and its tools, live envs (replay, redone
records, eviction, timeouts, crashes), and the env stage routing episodes to plugins."""
from __future__ import annotations

import json
import os

import pytest

from rlstream.envs.api import Env, StepResult, load_factory
from rlstream.envs.live import LiveEnvs
from rlstream.envs.tools import ToolCallError, parse_tool_call
from rlstream.envs.workspace import Workspace
from rlstream.runtime.stage import Incoming
from rlstream.sandbox import Sandbox, SandboxLimits
from rlstream.schemas.records import Episode
from rlstream.stages.env import EnvSettings, EnvStage
from tests.agent_envs import call
from tests.helpers.episodes import episode


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxLimits(timeout_s=2.0), backend="subprocess")


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{\"name\": \"shell\"", "is not closed"),
    ("<tool_call>{name: shell}</tool_call>", "not JSON"),
    ("<tool_call>[1, 2]</tool_call>", '{"name": ..., "arguments": {...}}'),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
    ('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>', "missing string argument(s) command"),
    ('<tool_call>{"name": "write_file", "arguments": "x"}</tool_call>', "arguments must be an object"),
])
def test_malformed_tool_calls_say_what_is_wrong(text, error):
    with pytest.raises(ToolCallError, match=None) as exc:
        parse_tool_call(text)
    assert error in str(exc.value)


def test_tool_calls_parse_and_text_without_one_is_an_answer():
    assert parse_tool_call("the answer is 4") is None
    assert parse_tool_call("ok " + call("shell", command="ls") + " then") == ("shell", {"command": "ls"})


def test_workspace_keeps_files_across_calls_confines_paths_and_is_removed(sandbox):
    ws = Workspace(sandbox, "g1:0")
    assert ws.write_file("a/b.txt", "hello").exit_code == 0
    r = ws.shell("cat a/b.txt && echo more >> a/b.txt && touch made-by-shell")
    assert (r.output, r.exit_code, r.failure_class) == ("hello", 0, None)
    assert ws.read_file("a/b.txt").output == "hellomore\n"
    r = ws.python("import os; print(sorted(os.listdir('.')))")
    assert (r.output, r.exit_code, r.failure_class) == ("['a', 'made-by-shell']\n", 0, None), r
    assert ws.shell("exit 3").exit_code == 3
    for outside in ("../x", "/etc/passwd", "a/../../x"):
        assert ws.read_file(outside).exit_code == 2 and ws.write_file(outside, "x").exit_code == 2
    os.symlink("/etc", os.path.join(ws.path, "link"))
    assert ws.read_file("link/hostname").exit_code == 2
    assert ws.shell("sleep 30").failure_class == "timeout"
    path = ws.path
    ws.close()
    assert not os.path.exists(path)


def test_a_call_answers_with_all_it_printed_while_a_child_it_left_keeps_writing(sandbox):
    """The answer comes when the call exits, with everything it wrote (read from the pipe after its exit, not by a
    reader given a fixed time), and a background child that never stops writing holds neither the answer nor the
    next call."""
    ws = Workspace(sandbox, "g1:0")
    try:
        # The writer paced so that the call's output stays under the output limit: a truncated answer would say
        # nothing about whether all of it came back.
        r = ws.shell("(while true; do echo spam; sleep 0.01; done) & seq 1 1000")
        assert (r.exit_code, r.failure_class, r.truncated) == (0, None, False), r
        numbers = [line for line in r.output.splitlines() if line != "spam"]
        assert numbers == [str(n) for n in range(1, 1001)], r.output[-200:]
        r = ws.python("print('x' * 5000)")
        assert (r.output, r.exit_code, r.failure_class) == ("x" * 5000 + "\n", 0, None), r
    finally:
        ws.close()


class Counter(Env):
    """Counts its steps; ``made`` counts envs made, ``closed`` closes (to see replay and eviction)."""

    made = closed = 0

    def __init__(self):
        Counter.made += 1
        self.n = 0

    def step(self, action):
        self.n += 1
        return StepResult(done=action == "stop", observation=f"{self.n}:{action}")

    def close(self):
        Counter.closed += 1


def counter(task, workspace):
    return Counter()


def test_live_envs_keep_state_replay_a_lost_env_and_answer_a_redone_record(sandbox):
    live = LiveEnvs(sandbox, max_live=2, step_timeout_s=2)
    Counter.made = Counter.closed = 0
    assert live.step(counter, episode("a")).observation == "1:a"
    assert live.step(counter, episode("a", "b")).observation == "2:b"
    # The same record again (its transaction aborted): the cached result, not a third step.
    assert live.step(counter, episode("a", "b")).observation == "2:b" and Counter.made == 1
    live.finish("g1:0")
    assert Counter.closed == 1 and len(live) == 0
    # Lost (restart, rebalance, eviction): rebuilt by replaying the earlier actions, then stepped.
    assert live.step(counter, episode("a", "b", "c")).observation == "3:c"
    assert (Counter.made, live.rebuilt) == (2, 1)
    for i in range(3):  # bounded: the least recently stepped is closed
        other = episode("x")
        other.episode_id = f"g{i}:9"
        live.step(counter, other)
    assert len(live) == 2 and Counter.closed == 3  # g1:0 and g0:9 went
    live.close_all()
    assert len(live) == 0 and Counter.closed == 5


def handle(stage: EnvStage, ep: Episode):
    [out] = stage.handle(Incoming("actions", 0, 0, b"t1", {}, 0, ep))
    return out


def test_a_hanging_or_crashing_plugin_ends_its_episode_with_a_class_and_the_stage_goes_on(tmp_path):
    # The timeout must let a real shell-tool step finish on a loaded 2-core machine (0.5 s did not, at load 9).
    stage = EnvStage(EnvSettings(sandbox="subprocess", step_timeout_s=3.0, workspace_root=str(tmp_path),
                                 env=("hang=tests.agent_envs:hanging", "crash=tests.agent_envs:crashing",
                                      "tests.agent_envs:scripted")))
    try:
        for env, failure in (("hang", "env_timeout"), ("crash", "env_error")):
            out = handle(stage, episode("a", env=env))
            assert out.topic == "trajectories" and out.record.status == "failed"
            assert (out.record.failure.failure_class, out.record.failure.stage) == (failure, "env")
        # Tasks of any other env_name go to the bare --env; the workspace lives until the episode ends.
        out = handle(stage, episode("hello", env="anything"))
        assert out.topic == "observations" and out.key == "t1"
        assert json.loads(out.record.turns[0].tool_call.arguments)["content"] == "hello"
        assert [p.name.startswith("rlstream-ws-g1_0-") for p in tmp_path.iterdir()] == [True]
        out = handle(stage, episode("hello", "x", env="anything", max_turns=2))
        assert out.topic == "trajectories" and out.record.turns[2].tool_result.output == "hello|\nturn1.txt\n"
        assert not list(tmp_path.iterdir()), "the workspace goes with the episode"
    finally:
        stage.close()


def test_factories_load_by_dotted_path_or_say_why_not():
    assert load_factory("rlstream.envs.tools:make").__name__ == "make"
    assert load_factory("tests.agent_envs.scripted").__name__ == "scripted"
    for bad, why in (("nosuchmodule:make", "does not load"), ("rlstream.envs.tools:nothing", "does not load"),
                     ("make", "expected a dotted path"), ("rlstream.envs.tools:TOOLS", "not callable")):
        with pytest.raises(ValueError, match=why):
            load_factory(bad)
    with pytest.raises(ValueError, match="two entries without NAME="):
        EnvStage(EnvSettings(sandbox="subprocess", env=("tests.agent_envs:scripted", "rlstream.envs.tools:make")))
