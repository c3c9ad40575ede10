"""Processes of an episode persist under the docker sandbox: one container per episode, every tool call exec'd into
it, the container removed when the episode ends. The built-in tools env driven step by step as the env stage does
(live envs), against a real docker engine.

Needs the docker SDK, an engine (``dockerd``; see .ci/compose) and the base image ``rlstream-base:bookworm``
(infra/docker/make-base-image.sh): skipped where one is missing, failed instead under CI=true.
"""
from __future__ import annotations

import os
import time
import uuid

import pytest

from rlstream.envs import tools
from rlstream.envs.live import LiveEnvs
from rlstream.sandbox import Sandbox, SandboxLimits, docker_available
from tests.agent_envs import call
from tests.helpers.episodes import episode

pytestmark = pytest.mark.docker  # run by .ci/compose once it has an engine and the image (pyproject's addopts)

IMAGE = "rlstream-base:bookworm"


def missing(what: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {what}; the docker sandbox cannot be tested", pytrace=False)
    pytest.skip(what)


@pytest.fixture
def client():
    if not docker_available():
        missing("no docker SDK, or no docker engine answers")
    import docker
    c = docker.from_env()
    try:
        c.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        missing(f"no image {IMAGE} (infra/docker/make-base-image.sh makes it)")
    return c


@pytest.fixture
def live(client, tmp_path):
    sandbox = Sandbox(SandboxLimits(timeout_s=3.0), backend="docker", docker_image=IMAGE)
    envs = LiveEnvs(sandbox, workspace_root=str(tmp_path))
    yield envs
    envs.close_all()


def containers(client, episode_id: str) -> list:
    return client.containers.list(all=True, filters={"label": f"rlstream.episode={episode_id}"})


def test_a_background_process_of_step_1_runs_at_step_3_in_the_episodes_container_which_goes_with_it(
        live, client, tmp_path):
    seconds = f"{300 + uuid.uuid4().int % 1000}"  # a command line to find in the container
    actions = [
        call("shell", command=f"(while true; do echo tick >> ticks; sleep 0.05; done) & "
                              f"sleep {seconds} >/dev/null 2>&1 & echo $! > sleeper.pid; echo started"),
        call("write_file", path="note.txt", content="from the host"),
        call("shell", command="kill -0 $(cat sleeper.pid) && echo alive; cat note.txt; echo; wc -l < ticks; "
                              "echo more >> note.txt"),
    ]
    results = []
    for n in range(1, len(actions) + 1):
        result = live.step(tools.make, episode(*actions[:n]))
        assert result.failure is None and not result.done, result
        results.append(result.tool_result)
        if n == 1:
            time.sleep(0.5)
    # The call ended with its own output, not at the tool timeout: it did not wait for the sleeper it started.
    assert (results[0].output, results[0].failure_class) == ("started\n", None), results[0]
    alive, note, ticks = results[2].output.splitlines()
    assert (alive, note) == ("alive", "from the host") and int(ticks) >= 5
    [container] = containers(client, "g1:0")  # one container for the whole episode
    top = " ".join(" ".join(row) for row in container.top()["Processes"])
    assert f"sleep {seconds}" in top, top
    [workspace] = [p for p in tmp_path.iterdir() if p.name.startswith("rlstream-ws")]
    assert (workspace / "note.txt").read_text() == "from the hostmore\n"  # the container wrote the host's file
    live.finish("g1:0")  # the episode ended
    deadline = time.monotonic() + 20
    while containers(client, "g1:0") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not containers(client, "g1:0"), "the episode's container is removed with it"
    assert not workspace.exists()


def test_calls_keep_their_exit_codes_and_timeout_and_the_container_has_no_network(live):
    r = live.step(tools.make, episode(call("shell", command="echo out; echo err >&2; exit 3"))).tool_result
    assert (r.output, r.exit_code, r.failure_class) == ("out\nerr\n", 3, None)
    actions = [call("shell", command="exit 3"), call("shell", command="cat /sys/class/net/*/operstate 2>&1 | "
                                                     "grep -c up; ls /sys/class/net")]
    r = live.step(tools.make, episode(*actions)).tool_result
    assert r.output.split() == ["0", "lo"], r  # loopback only, and down: no way out
    actions.append(call("shell", command="sleep 30"))
    result = live.step(tools.make, episode(*actions))
    assert result.done and result.failure.failure_class == "timeout", result  # the call's timeout cut the sleep
