"""``rlstream env-server`` as its own process against the env stage's ``--env-url`` client: the same results as the
plugin in process for the same seeded actions; a server that is down, killed or restarted mid-episode."""
from __future__ import annotations

import json
import random
import socket
import threading
import urllib.request

import pytest

from rlstream.envs.api import Env, StepResult
from rlstream.envs.remote import idempotency_key
from rlstream.envs.server import EnvServerSettings, EnvService, serve
from rlstream.infra.supervisor import StageProc
from rlstream.runtime.stage import Incoming
from rlstream.schemas import headers as hdr
from rlstream.stages.env import EnvSettings, EnvStage
from tests.agent_envs import MALFORMED, call
from tests.helpers import ROOT
from tests.helpers.episodes import episode
from tests.helpers.kafka import wait_for

pytestmark = [pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return json.loads(r.read())["ok"]
    except OSError:
        return False


def start_server(tmp_path, port: int, n: int = 0) -> StageProc:
    proc = StageProc("env-server", ["env-server", "--env", "rlstream.envs.tools:make", "--port", str(port),
                                    "--sandbox", "subprocess", "--workspace-root", str(tmp_path)],
                     {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, tmp_path / f"server-{n}.log",
                     cwd=ROOT).start()
    wait_for(lambda: healthy(f"http://127.0.0.1:{port}") or not proc.alive(), 60, "the env server to answer")
    assert proc.alive(), proc.log_tail()
    return proc


def seeded_text(seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij \n") for _ in range(rng.randint(5, 40)))


def seeded_actions(seed: int) -> list[str]:
    text, name = seeded_text(seed), f"f{seed}.txt"
    return [call("write_file", path=name, content=text), call("shell", command=f"wc -c {name}; rev {name}"),
            call("python", code=f"print(open({name!r}).read()[::-1].upper()); print(sum(range({seed})))"),
            MALFORMED, call("read_file", path=name), call("read_file", path="../escape"), "done"]


def play(stage: EnvStage, actions: list[str], seed: int) -> list[tuple]:
    """Drive one episode through ``stage`` as rollout would; what each step answered (durations left out)."""
    seen, given = [], []
    for action in actions:
        given.append(action)
        ep = episode(*given, max_turns=len(actions))
        ep.episode_id = f"g{seed}:0"
        for turn, obs in zip([t for t in ep.turns if t.role == "observation"], seen):
            turn.text = obs[0]
        [out] = stage.handle(Incoming("actions", 0, 0, b"t1", {}, 0, ep))
        last = out.record.turns[-1] if out.topic == "observations" else None
        action_turn = out.record.turns[-2] if last else out.record.turns[-1]
        result = action_turn.tool_result
        seen.append((last.text if last else out.record.status, action_turn.tool_call and action_turn.tool_call.to_dict(),
                     result and (result.output, result.exit_code, result.truncated, result.failure_class)))
        if out.topic == "trajectories":
            break
    return seen


def test_the_server_gives_the_plugins_results_for_the_same_seeds(tmp_path):
    port = free_port()
    server = start_server(tmp_path, port)
    local = EnvStage(EnvSettings(sandbox="subprocess", env=("rlstream.envs.tools:make",)))
    remote = EnvStage(EnvSettings(sandbox="subprocess", env_url=(f"http://127.0.0.1:{port}",)))
    try:
        for seed in range(3):
            actions = seeded_actions(seed)
            here, there = play(local, actions, seed), play(remote, actions, seed)
            assert here == there
            assert len(here) == len(actions) and here[-1][0] == "ok"
            assert here[3][0].startswith("<tool_error>") and "exit code 2" in here[5][0]
    finally:
        local.close()
        remote.close()
        assert server.stop(30) == 0, server.log_tail()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("rlstream-ws")] == [], "workspaces removed"


def test_a_server_down_killed_or_restarted_mid_episode(tmp_path):
    port = free_port()
    stage = EnvStage(EnvSettings(sandbox="subprocess", env_url=(f"http://127.0.0.1:{port}",), env_retries=1))
    actions = seeded_actions(7)
    try:
        # Down from the start: the episode fails with its class after the retries (and its task is sent back to
        # prompts, once); the stage goes on.
        [out, retry] = stage.handle(Incoming("actions", 0, 0, b"t1", {}, 0, episode(actions[0])))
        assert (out.topic, out.record.failure.failure_class) == ("trajectories", "env_unreachable")
        assert (retry.topic, retry.record.task_id) == ("prompts", "t1.retry1")
        assert "tried 2 times" in out.record.failure.message
        server = start_server(tmp_path, port, 1)
        first = stage.handle(Incoming("actions", 0, 0, b"t1", {}, 0, episode(actions[0])))[0]
        assert first.topic == "observations"
        # Restarted between steps: it lost the episode; the stage rebuilds it there by replay and goes on.
        server.kill()
        server = start_server(tmp_path, port, 2)
        ep = episode(*actions[:2])
        ep.turns[1].text = first.record.turns[-1].text
        [out] = stage.handle(Incoming("actions", 0, 0, b"t1", {}, 0, ep))
        assert out.topic == "observations" and stage.live.rebuilt == 1
        # The file written before the restart is there again (replayed), so the shell counts its bytes.
        assert out.record.turns[-2].tool_result.output.startswith(f"{len(seeded_text(7))} f7.txt\n")
        # Killed for good mid-episode: the next step fails as unreachable.
        server.kill()
        [out] = stage.handle(Incoming("actions", 0, 0, b"t1", {}, 0, episode(*actions[:3])))
        assert (out.topic, out.record.failure.failure_class) == ("trajectories", "env_unreachable")
    finally:
        stage.close()


def test_a_task_whose_server_is_down_is_retried_as_a_new_task_up_to_the_limit():
    port = free_port()  # nothing listens there: the server is down
    stage = EnvStage(EnvSettings(sandbox="subprocess", env_url=(f"http://127.0.0.1:{port}",), env_retries=0,
                                 env_task_retries=2))
    try:
        first = episode(seeded_actions(1)[0])
        failed, again = stage.handle(Incoming("actions", 0, 0, b"t1", {}, 0, first))
        assert (failed.topic, failed.record.status, failed.record.failure.failure_class) == (
            "trajectories", "failed", "env_unreachable")
        assert (again.topic, again.key, again.record.task_id, again.record.group_id) == (
            "prompts", "t1.retry1", "t1.retry1", "g1.retry1")
        assert again.record.metadata["env.retry_of"] == "t1" and again.record.metadata["env.attempt"] == "1"
        # Another episode of the same task (its group's sample 1) fails too: the task is retried once, not twice.
        sibling = episode(seeded_actions(1)[0])
        sibling.episode_id, sibling.sample_index = "g1:1", 1
        assert [o.topic for o in stage.handle(Incoming("actions", 0, 1, b"t1", {}, 0, sibling))] == ["trajectories"]
        # The retry fails again (still down): a second retry; the third failure is the last.
        tasks = [again.record]
        for attempt in (2, 3):
            retried = episode(seeded_actions(1)[0])
            retried.task = tasks[-1]
            outs = stage.handle(Incoming("actions", 0, attempt, tasks[-1].task_id.encode(), {}, 0, retried))
            assert outs[0].record.failure.failure_class == "env_unreachable"
            tasks += [o.record for o in outs[1:]]
        assert [t.task_id for t in tasks] == ["t1.retry1", "t1.retry2"]
        assert tasks[-1].metadata["env.retry_of"] == "t1" and tasks[-1].group_id == "g1.retry2"
    finally:
        stage.close()


@pytest.mark.kafka
@pytest.mark.timeout(360)
def test_the_env_stage_sends_a_task_back_to_prompts_when_its_server_is_killed(bootstrap, run_name, tmp_path,
                                                                             start_stage):
    from tests.helpers.kafka import produce, read_all
    port = free_port()
    server = start_server(tmp_path, port)
    start_stage("env", bootstrap, run_name, "--env-url", f"http://127.0.0.1:{port}", "--env-retries", "1",
                "--env-task-retries", "1", "--sandbox", "subprocess", "--workspace-root", str(tmp_path))
    actions = seeded_actions(3)
    produce(bootstrap, run_name, "actions", [(b"t1", episode(actions[0]), None)])
    [obs] = read_all(bootstrap, run_name, "observations", expect=1, timeout=60)
    assert obs.record.turns[-1].text.startswith("<tool_response>")
    server.kill()  # killed mid-episode, and not coming back
    second = episode(*actions[:2])
    second.turns[1].text = obs.record.turns[-1].text
    produce(bootstrap, run_name, "actions", [(b"t1", second, None)])
    [traj] = read_all(bootstrap, run_name, "trajectories", expect=1, timeout=60)
    [task] = read_all(bootstrap, run_name, "prompts", expect=1, timeout=20)
    assert (traj.record.status, traj.record.failure.failure_class) == ("failed", "env_unreachable")
    assert "tried 2 times" in traj.record.failure.message
    assert (task.key, task.record.task_id, task.record.metadata["env.attempt"]) == (b"t1.retry1", "t1.retry1", "1")
    # Rollout would start the retried task's episodes; its first one fails too, and the limit (1) is reached.
    retried = episode(actions[0])
    retried.task = task.record
    produce(bootstrap, run_name, "actions", [(b"t1.retry1", retried, None)])
    trajs = read_all(bootstrap, run_name, "trajectories", expect=2, timeout=60)
    assert {t.record.task.task_id for t in trajs} == {"t1", "t1.retry1"}
    assert len(read_all(bootstrap, run_name, "prompts", timeout=20)) == 1, "no retry past the limit"


class Gated(Env):
    """An env whose step on ``hold`` waits at a gate the test opens; it notes every action it really stepped."""

    def __init__(self, stepped: list, entered: threading.Event, gate: threading.Event):
        self.stepped, self.entered, self.gate = stepped, entered, gate

    def step(self, action):
        if action == "hold":
            self.entered.set()
            assert self.gate.wait(120), "the test never opened the gate"
        self.stepped.append(action)
        return StepResult(done=False, observation=f"stepped {action}")


class Recording(EnvService):
    """The env server's service as it is, noting the key of every request it receives (route, key)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.received: list[tuple[str, str | None]] = []

    def reset(self, body, key=None):
        self.received.append(("reset", key))
        return super().reset(body, key)

    def step(self, body, key=None):
        self.received.append(("step", key))
        return super().step(body, key)


@pytest.mark.kafka
@pytest.mark.timeout(240)
def test_an_env_stage_killed_mid_step_is_redone_under_the_same_keys_and_nothing_is_duplicated(
        bootstrap, run_name, tmp_path, start_stage):
    from tests.helpers.kafka import produce, read_all, wait_consumed
    stepped, entered, gate = [], threading.Event(), threading.Event()
    service = Recording(lambda task, workspace: Gated(stepped, entered, gate),
                        EnvServerSettings(sandbox="subprocess", workspace_root=str(tmp_path)))
    httpd = serve(service, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    args = ("--env-url", url, "--sandbox", "subprocess", "--workspace-root", str(tmp_path), "--instance", "w0")
    try:
        stage = start_stage("env", bootstrap, run_name, *args)
        first = episode("one")
        first.task.trace_id = hdr.new_traceparent()
        produce(bootstrap, run_name, "actions", [(b"t1", first, None)])
        [obs] = read_all(bootstrap, run_name, "observations", expect=1, timeout=90)
        second = episode("one", "hold")
        second.task = first.task
        second.turns[1].text = obs.record.turns[-1].text
        produce(bootstrap, run_name, "actions", [(b"t1", second, None)])
        assert entered.wait(60), stage.log_tail()
        stage.kill()  # SIGKILL mid-step: the server is stepping the episode's second action
        gate.set()
        wait_for(lambda: stepped == ["one", "hold"], 30, "the server to finish the step it was given")
        before = list(service.received)
        stage.start()  # its successor redoes the uncommitted record: reset, the first action again, the second
        wait_consumed(bootstrap, f"{run_name}.env", run_name, "actions", timeout=120)
        observations = read_all(bootstrap, run_name, "observations")
    finally:
        gate.set()
        httpd.shutdown()
        service.live.close_all()
    key = lambda call: idempotency_key(first.task, "g1:0", call)  # noqa: E731
    # The killed worker held the episode's env: the second action was one step on it.
    assert before == [("reset", key("reset")), ("step", key("step/1")), ("step", key("step/2"))]
    assert service.received[len(before):] == [("reset", key("reset")), ("step", key("step/1")),
                                              ("step", key("step/2"))]
    assert service.received.count(("step", key("step/2"))) == 2, "the repeated step came with the same key"
    # The server recognised the repeats: the plugin stepped each action once, and the redo got the first answers.
    assert stepped == ["one", "hold"] and service.repeats == 3
    assert [len([t for t in o.record.turns if t.role == "action"]) for o in observations] == [1, 2], \
        "one observation per action on the topic: none lost, none duplicated"
    assert observations[1].record.turns[-1].text == "stepped hold"
