"""The one process lifecycle (rlstream/runtime/lifecycle.py) on real processes against the real broker: a SIGTERM
finishes and commits what is open and exits 0; a stop that cannot finish ends at its deadline (124); a second
SIGINT stops at once (130); an unreachable broker is waited for, said so, then a non-zero exit."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from rlstream.schemas import headers as hdr
from tests.helpers import ROOT
from tests.helpers.kafka import committed_offsets, make_trajectory, produce, read_all, wait_for
from tests.helpers.servers import free_port

pytestmark = [pytest.mark.kafka]


def _exit_within(proc, seconds: float) -> tuple[int, float]:
    """(exit code, seconds it took) of a process that must exit within ``seconds``."""
    started = time.monotonic()
    try:
        code = proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {seconds} s after the signal:\n{proc.log_tail()}", pytrace=False)
    return code, time.monotonic() - started


def _consumed(port: int, stage: str) -> float:
    """The ``rlstream_records_in_total`` of ``stage`` on a process's /metrics (0 while it does not answer)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return 0.0
    return sum(float(m) for m in re.findall(rf'rlstream_records_in_total{{stage="{stage}",[^}}]*}} (\S+)', text))


def _hung_reward(start_stage, bootstrap, run, *flags: str):
    """A reward stage whose one record's judge hangs for an hour, once that record is in its handler."""
    produce(bootstrap, run, "trajectories", [(b"hangs", make_trajectory(1, response="hang"), None)])
    port = free_port()
    proc = start_stage("reward", bootstrap, run, "--reward", "tests.reward_fns:picky", "--judge-timeout-s", "3600",
                       "--handler-timeout-s", "3600", "--metrics-port", str(port), *flags)
    wait_for(lambda: _consumed(port, "reward") >= 1 or not proc.alive(), 60, "the record in the stage's handler")
    assert proc.alive(), proc.log_tail()
    return proc


@pytest.mark.timeout(90)
def test_a_stop_that_cannot_finish_ends_at_its_deadline(bootstrap, run_name, start_stage):
    proc = _hung_reward(start_stage, bootstrap, run_name, "--stop-timeout-s", "2")
    proc.proc.send_signal(signal.SIGTERM)
    code, took = _exit_within(proc, 20)
    assert code == 124, proc.log_tail()
    assert took >= 1.5, "it left before its deadline although its handler never finished"
    assert "did not stop within --stop-timeout-s 2 s of the SIGTERM" in proc.log_tail()
    assert committed_offsets(bootstrap, f"{run_name}.reward", run_name, "trajectories") == {}


@pytest.mark.timeout(90)
def test_a_second_sigint_stops_at_once(bootstrap, run_name, start_stage):
    proc = _hung_reward(start_stage, bootstrap, run_name)  # the default deadline: a minute
    proc.proc.send_signal(signal.SIGINT)
    time.sleep(2)  # past SAME_SIGNAL_S: the same Ctrl-C reaching the process twice is one request
    assert proc.alive(), "the first SIGINT stopped it although its handler never finished:\n" + proc.log_tail()
    proc.proc.send_signal(signal.SIGINT)
    code, took = _exit_within(proc, 10)
    assert code == 130, proc.log_tail()
    assert "second signal (SIGINT): stopping now" in proc.log_tail()


@pytest.mark.timeout(150)
def test_a_sigtermed_archive_inserts_and_commits_what_it_holds_then_exits_0(bootstrap, run_name, tmp_path,
                                                                         start_stage):
    from rlstream.archive.query import open_archive
    n = 6
    # One key, so one partition: the archive's first poll then holds all six, and the SIGTERM below finds them held
    # (over two partitions a first poll could hold one partition's records, and the stop commit only those).
    produce(bootstrap, run_name, "trajectories",
            [(b"g", make_trajectory(i, group=i), hdr.build(0, hdr.new_traceparent())) for i in range(n)])
    url = f"chdb://{tmp_path / 'archive'}"
    # Held, not inserted: a batch waits ten minutes or 100000 rows; only the stop inserts and commits it.
    proc = start_stage("archive", bootstrap, run_name, "--archive", url, "--archive-flush-s", "600",
                       "--archive-batch-rows", "100000", "--stop-timeout-s", "30")
    wait_for(lambda: f"first {n} records consumed" in proc.log_tail() or not proc.alive(), 90,
             f"the archive to consume all {n} records in its first poll")
    assert proc.alive(), proc.log_tail()
    assert committed_offsets(bootstrap, f"{run_name}.archive", run_name, "trajectories") == {}
    proc.proc.send_signal(signal.SIGTERM)
    code, took = _exit_within(proc, 30)
    assert code == 0, proc.log_tail()
    assert sum(committed_offsets(bootstrap, f"{run_name}.archive", run_name, "trajectories").values()) == n
    with open_archive(url) as archive:
        assert archive.query("SELECT count() FROM rlstream.trajectories")[1] == [[n]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigtermed_trainer_exits_0_with_what_it_trained_committed(bootstrap, run_name, tmp_path, start_stage):
    from rlstream.schemas.records import Reward, ScoredTrajectory
    group = 2
    proc = start_stage("trainer", bootstrap, run_name, "--weights", str(tmp_path / "weights"), "--home",
                       str(tmp_path), "--warmup-steps", "0", "--window-groups", "2", "--groups-per-step", "1",
                       "--stop-timeout-s", "60")
    read_all(bootstrap, run_name, "policy-versions", expect=1, timeout=150)  # v0: the trainer is up
    samples = []
    for g in range(3):
        for i in range(group):
            traj = make_trajectory(g * 10 + i, group=g, response="cba" if i else "abc", n_tokens=4)
            traj.task.group_size = group
            samples.append((f"g{g}".encode(), ScoredTrajectory(traj, Reward(total=float(i), reward_version="v1")),
                            hdr.build(0, hdr.new_traceparent(), "v1")))
    produce(bootstrap, run_name, "rewards", samples)
    read_all(bootstrap, run_name, "policy-versions", expect=2, timeout=90)  # v1 is out: v2 and v3 may be on the way
    proc.proc.send_signal(signal.SIGTERM)
    code, _ = _exit_within(proc, 60)
    assert code == 0, proc.log_tail()
    versions = read_all(bootstrap, run_name, "policy-versions")
    trained = sum(v.record.samples_trained for v in versions)
    committed = sum(committed_offsets(bootstrap, f"{run_name}.trainer", run_name, "rewards").values())
    # Every version announced committed its samples with it, and nothing else was committed.
    assert trained == committed and trained >= group, (trained, committed, proc.log_tail())


def test_a_sigtermed_paced_prompt_source_flushes_and_exits_0(bootstrap, run_name, tmp_path):
    """An orchestrator stops `rlstream prompts --paced` (which never ends by itself) with SIGTERM."""
    from rlstream.infra.supervisor import StageProc, stage_env
    proc = StageProc("prompts", ["prompts", "--task", "reverse", "--count", "0", "--paced"],
                     stage_env(bootstrap, run_name), tmp_path / "prompts.log", cwd=ROOT).start()
    try:
        wait_for(lambda: read_all(bootstrap, run_name, "prompts", timeout=2), 90, "the first prompts")
        proc.proc.send_signal(signal.SIGTERM)
        code, _ = _exit_within(proc, 60)
    finally:
        proc.kill()
    assert code == 0, proc.log_tail()
    said = re.search(r"produced (\d+) train tasks", proc.log_tail())
    assert said and int(said.group(1)) == len(read_all(bootstrap, run_name, "prompts")), proc.log_tail()


def test_an_unreachable_broker_is_waited_for_then_a_non_zero_exit(tmp_path):
    from rlstream.infra.supervisor import StageProc, stage_env
    port = free_port()
    proc = StageProc("monitor", ["run", "monitor", "--bootstrap", f"127.0.0.1:{port}", "--broker-wait-s", "5"],
                     stage_env(f"127.0.0.1:{port}", "never"), tmp_path / "monitor.log", cwd=ROOT).start()
    code, _ = _exit_within(proc, 40)
    out = proc.log_tail()
    assert code == 1, out
    assert f"waiting for the Kafka broker at 127.0.0.1:{port} to answer" in out
    assert f"no Kafka broker answered at 127.0.0.1:{port}" in out and "Traceback" not in out


SUPERVISOR = """
import sys, time
from pathlib import Path
from rlstream.infra.supervisor import StageProc, stage_env
bootstrap, run, log = sys.argv[1:4]
stage = StageProc("reward", ["run", "reward", "--reward", "tests.reward_fns:picky"], stage_env(bootstrap, run),
                  Path(log), cwd=Path.cwd()).start()
print(stage.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for whoever adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_a_stage_stops_and_commits_when_its_supervisor_is_sigkilled(bootstrap, run_name, tmp_path):
    """A supervisor killed without a word (SIGKILL: no cleanup runs) leaves no stage working on, orphaned."""
    log = tmp_path / "reward.log"
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, bootstrap, run_name, str(log)], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
    try:
        stage = int(supervisor.stdout.readline())
        produce(bootstrap, run_name, "trajectories", [(b"k", make_trajectory(1, response="ok"), None)])
        assert read_all(bootstrap, run_name, "rewards", expect=1), "the stage never scored the record"
    finally:
        supervisor.kill()
        supervisor.wait()
    wait_for(lambda: not _running(stage), 30, "the orphaned stage to stop")
    out = log.read_text()
    assert f"its supervisor (pid {supervisor.pid}) is gone: stopping" in out, out[-3000:]
    assert committed_offsets(bootstrap, f"{run_name}.reward", run_name, "trajectories"), out[-3000:]
