"""Replay against the real broker and archive: N trajectories re-scored give exactly N new rows, old rows untouched."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlstream.archive.query import open_archive, read_endpoint
from rlstream.config import KafkaSettings
from rlstream.rewards import exact_match
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Reward, ScoredTrajectory
from rlstream.stages.replay import ReplaySettings, parse_since, parse_versions, replay
from tests.helpers import ROOT
from tests.helpers.kafka import make_trajectory, produce, read_all, wait_consumed, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

N = 30
RESPONSES = ["cba", "cbx", "abc", "c"]
#: The new reward, by dotted path: loaded in this process (topic replay) and in the CLI's (archive replay).
NEW_REWARD = "tests.reward_fns:partial_credit"


def _expected(i: int) -> float:
    return sum(a == b for a, b in zip("cba", RESPONSES[i % 4])) / 3




def _rows(url: str, run: str, version: str) -> list[list]:
    with open_archive(url) as archive:
        return archive.query(
            f"SELECT trajectory_id, reward_total, reward_version, header_reward_version, topic, partition, offset, "
            f"archived_at, traceparent FROM rlstream.rewards WHERE run = '{run}' AND reward_version = '{version}' "
            f"ORDER BY trajectory_id")[1]


@pytest.mark.timeout(630)
def test_replay_adds_exactly_one_row_per_trajectory_and_keeps_the_old(bootstrap, run_name, tmp_path, start_stage):
    """Topic replay, a resumed (no-op) replay, a policy-version filter, and an archive replay after 'retention'."""
    trajectories, scored = [], []
    for i in range(N):
        traj = make_trajectory(i, response=RESPONSES[i % 4], version=i % 3)
        traj.stage_times = {"prompt.created": hdr.now_ms() - 50, "env.end": hdr.now_ms()}
        heads = hdr.build(i % 3, hdr.new_traceparent())
        trajectories.append((traj.group_id.encode(), traj, heads))
        # The v1 rows, as the reward stage wrote them: exact match, with the trajectory's trace continued.
        reward = Reward(total=exact_match(traj).total, reward_version="v1", scored_at=hdr.now_ms())
        scored.append((traj.group_id.encode(), ScoredTrajectory(traj, reward),
                       hdr.build(i % 3, hdr.child_traceparent(heads[1][1]), "v1")))
    produce(bootstrap, run_name, "trajectories", trajectories)
    produce(bootstrap, run_name, "rewards", scored)

    path = tmp_path / "archive"
    url = f"chdb://{path}"
    log = tmp_path / "archive.log"
    archive = start_stage("archive", bootstrap, run_name, "--archive", url, "--archive-flush-s", "0.3", log_path=log)
    try:
        wait_for(lambda: read_endpoint(str(path)) or not archive.alive(), 60, "the SQL endpoint")
        assert archive.alive(), archive.log_tail()
        wait_for(lambda: len(_rows(url, run_name, "v1")) == N, 60, "the v1 rows")
        before = _rows(url, run_name, "v1")

        kafka = KafkaSettings(bootstrap=bootstrap, run=run_name)
        runtime = RuntimeSettings(batch_size=16, poll_timeout_s=0.1)
        new = ReplaySettings(reward=NEW_REWARD, reward_version="v2", progress=False)
        result = replay(new, kafka, runtime)
        assert (result.scored, result.skipped) == (N, 0)
        print(f"topic replay: {result.rate:.0f} trajectories/s")

        # The archive commits offsets only after their rows are in: past every reward, every row is there.
        wait_consumed(bootstrap, f"{run_name}.archive", run_name, "rewards", timeout=60)
        rows = _rows(url, run_name, "v2")
        assert len(rows) == N and len({r[0] for r in rows}) == N
        assert all(r[2] == r[3] == "v2" for r in rows)
        assert sorted((r[0], round(r[1], 6)) for r in rows) == sorted(
            (f"traj-{i}", round(_expected(i), 6)) for i in range(N))
        assert _rows(url, run_name, "v1") == before, "the old reward rows are untouched"

        # The trace goes on: each v2 record continues the trace of the trajectory it scores.
        topic = {r.record.trajectory.trajectory_id: r for r in read_all(bootstrap, run_name, "rewards", expect=2 * N)
                 if r.headers.get("reward_version") == b"v2"}
        for key, traj, heads in trajectories:
            parent = dict(heads)["traceparent"]
            assert hdr.trace_id(topic[traj.trajectory_id].headers["traceparent"]) == hdr.trace_id(parent)
            assert topic[traj.trajectory_id].key == key
        # ... and the archive stores each record's traceparent as it travelled.
        assert {r[0]: r[8] for r in rows} == {t: r.headers["traceparent"].decode() for t, r in topic.items()}

        # Run again: the group's committed offsets say it is all done.
        again = replay(new, kafka, runtime)
        assert again.scored == 0

        # Only policy version 2, under another version.
        part = replay(ReplaySettings(reward=NEW_REWARD, reward_version="v2b", policy_version="2..2", progress=False),
                      kafka, runtime)
        assert (part.scored, part.skipped) == (N // 3, N - N // 3)

        # After retention: rebuild the trajectories from the archive (through the CLI, as a user would).
        out = subprocess.run([sys.executable, "-m", "rlstream.cli", "replay", "--bootstrap", bootstrap, "--run",
                              run_name, "--reward-version", "v3", "--reward", NEW_REWARD,
                              "--source", "archive", "--archive", url, "--no-progress"],
                             capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"replayed {N} trajectories from the archive" in out.stdout, out.stdout
        wait_consumed(bootstrap, f"{run_name}.archive", run_name, "rewards", timeout=60)
        rows3 = _rows(url, run_name, "v3")
        assert len(rows3) == N and [(r[0], r[1]) for r in rows3] == [(r[0], r[1]) for r in rows]
        with open_archive(url) as db:
            # The rebuilt trajectories are the archived ones: tokens, turns, task, stage stamps.
            same = db.query(
                f"SELECT count() FROM rlstream.rewards AS a INNER JOIN rlstream.trajectories AS t "
                f"ON a.run = t.run AND a.trajectory_id = t.trajectory_id WHERE a.run = '{run_name}' "
                f"AND a.reward_version = 'v3' AND a.token_ids = t.token_ids AND a.`turns.text` = t.`turns.text` "
                f"AND a.prompt = t.prompt AND a.answer = t.answer AND a.behaviour_logprobs = t.behaviour_logprobs "
                f"AND a.stage_times['env.end'] = t.stage_times['env.end']")[1][0][0]
            assert same == N
        assert _rows(url, run_name, "v1") == before
    finally:
        assert archive.stop() == 0, archive.log_tail()


def test_replay_arguments():
    """--since takes ISO times, epoch ms and ages; --policy-version takes ranges."""
    assert parse_since("") is None
    assert parse_since("1700000000000") == 1_700_000_000_000
    assert parse_since("2023-11-14T22:13:20") == 1_700_000_000_000
    assert parse_since("2h", now=10_000.0) == (10_000 - 7200) * 1000
    assert parse_versions("3..7") == (3, 7) and parse_versions("3..") == (3, None)
    assert parse_versions("..7") == (None, 7) and parse_versions("4") == (4, 4)
    with pytest.raises(ValueError):
        parse_since("yesterday-ish")
    with pytest.raises(ValueError):
        replay(ReplaySettings(), KafkaSettings())
