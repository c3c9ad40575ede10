"""Processes of an episode persist across its steps inside the sandbox and die with it: the built-in tools env
driven step by step as the env stage does (live envs, real subprocess sandbox with namespaces where they work)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from rlstream.envs import tools
from rlstream.envs.live import LiveEnvs
from rlstream.sandbox import Sandbox, SandboxLimits
from tests.agent_envs import call
from tests.helpers import ROOT
from tests.helpers.episodes import episode


def running(marker: str) -> list[int]:
    """Host pids of processes whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def ticks_in(workspace) -> int:
    """Lines the background writer has written into its workspace's ``ticks`` file so far."""
    try:
        return (workspace / "ticks").read_text().count("\n")
    except FileNotFoundError:
        return 0


def gone(marker: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(marker)


@pytest.fixture(params=["auto", "audit"])
def live(request, tmp_path):
    """Live envs on the subprocess sandbox: with namespaces where they work (auto), and without (audit hooks and
    process groups alone)."""
    sandbox = Sandbox(SandboxLimits(timeout_s=3.0), backend="subprocess", network=request.param)
    envs = LiveEnvs(sandbox, workspace_root=str(tmp_path))
    yield envs
    envs.close_all()


def test_a_background_process_of_step_1_runs_at_step_3_and_is_gone_after_the_episode(live, tmp_path):
    seconds = f"{300 + uuid.uuid4().int % 1000}.{os.getpid() % 100}"  # a command line no other test has
    actions = [
        # Step 1: a background writer and a long sleeper, then the call returns at once.
        call("shell", command=f"(while true; do echo tick >> ticks; sleep 0.05; done) & "
                              f"sleep {seconds} >/dev/null 2>&1 & echo $! > sleeper.pid; echo started"),
        call("write_file", path="note.txt", content="step 2"),
        # Step 3: the sleeper is still alive, and the writer kept writing between the steps.
        call("shell", command="kill -0 $(cat sleeper.pid) && echo alive; wc -l < ticks"),
    ]
    results = []
    for n in range(1, len(actions) + 1):
        result = live.step(tools.make, episode(*actions[:n]))
        assert result.failure is None and not result.done, result
        results.append(result.tool_result)
        if n == 2:
            # The writer started at step 1 goes on between the steps: its file grows after step 2 returned. Waited
            # for, not slept on (a fixed 0.5 s once gave it 3 ticks on two busy cores).
            [workspace] = [p for p in tmp_path.iterdir() if p.name.startswith("rlstream-ws")]
            after_step_2 = ticks_in(workspace)
            deadline = time.monotonic() + 30
            while ticks_in(workspace) < after_step_2 + 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            before_step_3 = ticks_in(workspace)
            assert before_step_3 >= after_step_2 + 3, f"the writer stopped between the steps ({before_step_3} ticks)"
    # The call ended with its own output, not at the tool timeout: it did not wait for the sleeper it started.
    assert (results[0].output, results[0].failure_class) == ("started\n", None), results[0]
    alive, ticks = results[2].output.splitlines()
    assert alive == "alive" and int(ticks) >= before_step_3
    # The sleeper (and the writer's subshell, forked with the same command line) run, inside the sandbox.
    assert running(seconds), "the sleeper runs on the host, inside the episode's sandbox"
    live.finish("g1:0")  # the episode ended
    assert gone(seconds), "the episode's processes end with it"
    time.sleep(0.2)
    assert not workspace.exists(), "nothing is left to write ticks into it again"


def test_calls_keep_their_own_timeout_and_exit_codes_in_a_persistent_session(live):
    ep = episode(call("shell", command="exit 3"))
    assert live.step(tools.make, ep).tool_result.exit_code == 3
    ep = episode(call("shell", command="exit 3"), call("python", code="import sys; print('py'); sys.exit(4)"))
    r = live.step(tools.make, ep).tool_result
    assert (r.output, r.exit_code, r.failure_class) == ("py\n", 4, None)
    ep = episode(*[t.text for t in ep.turns if t.role == "action"], call("shell", command="sleep 30"))
    result = live.step(tools.make, ep)
    assert result.done and result.failure.failure_class == "timeout"


HOST = """
import sys, time
from rlstream.envs.workspace import Workspace
from rlstream.sandbox import Sandbox, SandboxLimits
ws = Workspace(Sandbox(SandboxLimits(timeout_s=3.0), backend="subprocess"), "host-death", sys.argv[2])
print(ws.shell("sleep %s >/dev/null 2>&1 & echo ok" % sys.argv[1]).output, flush=True)
time.sleep(600)
"""


def test_an_env_process_killed_mid_episode_leaves_no_process_of_the_episode(tmp_path):
    seconds = f"{300 + uuid.uuid4().int % 1000}.{os.getpid() % 100 + 1}"
    host = subprocess.Popen([sys.executable, "-c", HOST, seconds, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert host.stdout.readline() == b"ok\n"
        assert running(seconds)
    finally:
        host.kill()
        host.wait(30)
    # The server's calls FIFO lost its only writer: it ends its calls' groups and exits, the namespace with it.
    assert gone(seconds), "a sandbox outlived the env process that started it"
