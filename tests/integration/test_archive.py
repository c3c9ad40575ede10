"""The archive sink against the real broker and embedded chDB: every topic once, replays add nothing, SQL access."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from rlstream.archive.query import ENDPOINT_FILE, ArchiveError, open_archive, read_endpoint
from rlstream.kafka.topics import TOPICS, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import (DeadLetter, Episode, Failure, PolicyVersion, Reward, ScoredTrajectory,
                                      TeacherFeedback, ToolCall, ToolResult, Turn)
from tests.helpers import ROOT
from tests.helpers.kafka import make_task, make_trajectory, produce
from tests.helpers.kafka import wait_for as _wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

EXPECTED = {"trajectories": 40, "rewards": 20, "feedback": 3, "policy_versions": 3, "tasks": 5, "episodes": 4,
            "dead_letters": 2 + 2}  # two real dead letters, two undecodable trajectories




def _scored(i: int) -> ScoredTrajectory:
    return ScoredTrajectory(make_trajectory(100 + i, group=i % 5),
                            Reward(total=float(i % 2), reward_version="v1",
                                   breakdown={"exact": float(i % 2), "len": -0.5},
                                   violations=["too_long"] if i % 3 == 0 else [], verifier_version="ver1",
                                   latency_ms=1.5, failure_class=None if i % 4 else "timeout", scored_at=hdr.now_ms(),
                                   turn_scores=[0.5 * i] * (i % 2)))


def _produce_everything(bootstrap: str, run: str) -> None:
    codec = default_codec()
    trajectories = [(f"g{i % 7}".encode(), make_trajectory(i, n_tokens=6, group=i % 7), None) for i in range(40)]
    trajectories.insert(10, (b"bad1", b"\x00not avro", None))
    trajectories.insert(25, (b"bad2", codec.encode("Trajectory", make_trajectory(999).to_dict())[:30], None))
    produce(bootstrap, run, "trajectories", trajectories)
    produce(bootstrap, run, "rewards", [(f"g{i % 5}".encode(), _scored(i), hdr.build(2, hdr.new_traceparent(), "v1"))
                                        for i in range(20)])
    produce(bootstrap, run, "feedback", [(b"g", TeacherFeedback(_scored(i), teacher_version="t1",
                                                                 teacher_logprobs=[-0.5] * 4), None) for i in range(3)])
    produce(bootstrap, run, "policy-versions", [(b"policy", PolicyVersion(
        policy="policy", version=v, weights_uri=f"file:///w/{v}", created_at=hdr.now_ms(), published_at=hdr.now_ms(),
        step=v * 10, metrics={"loss": 1.0 / (v + 1)}), hdr.build(v, hdr.new_traceparent())) for v in range(3)])
    produce(bootstrap, run, "prompts", [(f"task-{i}".encode(), make_task(i), None) for i in range(5)])
    turn = Turn("action", "calc(1+1)", 0, 4, policy_version=1, tool_call=ToolCall("calc", "1+1"),
                tool_result=ToolResult("2", duration_ms=3.0))
    episode = Episode(episode_id="e1", group_id="g1", sample_index=0, task=make_task(1), token_ids=[1, 2, 3, 4],
                      loss_mask=[1, 1, 0, 0], behaviour_logprobs=[-0.1, -0.2, 0.0, 0.0], turns=[turn],
                      failure=Failure("tool_error", "boom", "env"))
    produce(bootstrap, run, "actions", [(b"e1", episode, None), (b"e1", episode, None)])
    produce(bootstrap, run, "observations", [(b"e1", episode, None), (b"e1", episode, None)])
    produce(bootstrap, run, "dead-letters", [(b"k", DeadLetter(
        stage="reward", reason="handler_error", error="RuntimeError: judge crashed", topic=f"{run}.trajectories",
        partition=0, offset=i, failed_at=hdr.now_ms(), key=b"k", value=b"\xc3\x01raw", headers={"x": b"y"}), None)
        for i in range(2)])


def _counts(url: str) -> dict[str, int]:
    with open_archive(url) as archive:
        sql = " UNION ALL ".join(f"SELECT '{t}', count() FROM rlstream.{t}" for t in EXPECTED)
        return {t: n for t, n in archive.query(sql)[1]}


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _reset_offsets(bootstrap: str, run: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    group = f"{run}.archive"
    parts = []
    for logical in TOPICS:
        name = topic_name(run, logical)
        meta = admin.list_topics(name, timeout=10).topics[name]
        parts += [TopicPartition(name, p, 0) for p in meta.partitions]
    # The group's last member may still be leaving: altering offsets needs it empty.
    _wait_for(lambda: str(admin.describe_consumer_groups([group])[group].result(timeout=10).state).endswith("EMPTY"),
              60, "the archive group to empty")
    admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(group, parts)],
                                       request_timeout=30)[group].result(timeout=60)


def _caught_up(bootstrap: str, run: str) -> bool:
    """Whether the archive group has committed every partition up to its end."""
    from confluent_kafka import Consumer
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{run}.archive", "enable.auto.commit": False})
    try:
        parts = []
        for logical in TOPICS:
            name = topic_name(run, logical)
            meta = consumer.list_topics(name, timeout=10).topics[name]
            parts += [TopicPartition(name, p) for p in meta.partitions]
        for tp in consumer.committed(parts, timeout=10):
            _, high = consumer.get_watermark_offsets(tp, timeout=10)
            if high > 0 and tp.offset < high:
                return False
        return True
    finally:
        consumer.close()


@pytest.mark.timeout(1200)
def test_archives_every_topic_and_replayed_offsets_add_no_rows(bootstrap, run_name, tmp_path, start_stage):
    """(c) Rows land typed; the same offsets consumed again add nothing; SQL through the endpoint and directly."""
    path = tmp_path / "archive"
    url = f"chdb://{path}"
    _produce_everything(bootstrap, run_name)
    log = tmp_path / "archive.log"
    proc = start_stage("archive", bootstrap, run_name, "--archive", url, "--archive-flush-s", "0.3", log_path=log)
    try:
        _wait_for(lambda: read_endpoint(str(path)) or not proc.alive(), 60, "the SQL endpoint")
        assert proc.alive(), proc.log_tail()
        _wait_for(lambda: _counts(url) == EXPECTED, 90, f"archived counts {EXPECTED}")
        with open_archive(url) as archive:
            # Typed columns: arrays are arrays, maps are maps, headers and failures are columns.
            _, rows = archive.query("SELECT token_ids, loss_mask, behaviour_logprobs, `turns.role`, n_tokens, "
                                    "header_policy_version, prompt, temperature FROM rlstream.trajectories "
                                    "WHERE trajectory_id = 'traj-3'")
            assert rows == [[list(range(6)), [1] * 6, [-1.0] * 6, ["action"], 6, 0, "abc>", 1.0]]
            _, rows = archive.query("SELECT reward_breakdown, reward_version, header_reward_version, "
                                    "reward_failure_class, violations FROM rlstream.rewards "
                                    "WHERE trajectory_id = 'traj-104'")
            assert rows == [[{"exact": 0.0, "len": -0.5}, "v1", "v1", "timeout", []]]
            _, rows = archive.query("SELECT direction, count(), any(`turns.tool_name`), any(failure_class) "
                                    "FROM rlstream.episodes GROUP BY direction ORDER BY direction")
            assert rows == [["action", 2, ["calc"], "tool_error"], ["observation", 2, ["calc"], "tool_error"]]
            _, rows = archive.query("SELECT stage, reason, original_offset, topic FROM rlstream.dead_letters "
                                    "ORDER BY stage, topic, original_offset")
            assert [r[:2] for r in rows] == [["archive", "malformed"]] * 2 + [["reward", "handler_error"]] * 2
            _, rows = archive.query("SELECT version, metrics, published_at > '2020-01-01' "
                                    "FROM rlstream.policy_versions ORDER BY version")
            assert rows == [[v, {"loss": 1.0 / (v + 1)}, True] for v in range(3)]
            assert archive.query("SELECT length(teacher_logprobs) FROM rlstream.feedback LIMIT 1")[1] == [[4]]
            with pytest.raises(ArchiveError, match="(?i)unknown table|doesn't exist|does not exist"):
                archive.query("SELECT * FROM rlstream.nope")
        # `rlstream sql` reaches the running archive through its endpoint.
        out = _cli("sql", "SELECT topic, count() AS n FROM rlstream.trajectories GROUP BY topic", "--archive", url)
        assert out.returncode == 0, out.stderr
        assert re.search(r"topic\s+n\n-+\s+-+\ntrajectories\s+40\n\(1 row\)", out.stdout), out.stdout
        out = _cli("sql", "SELECT trajectory_id, token_ids FROM rlstream.trajectories ORDER BY offset LIMIT 1",
                   "--archive", url, "--format", "json")
        assert json.loads(out.stdout.splitlines()[0])["token_ids"] == list(range(6)), out.stdout
        out = _cli("sql", "SELEC nonsense", "--archive", url)
        assert out.returncode != 0 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert not (path / ENDPOINT_FILE).exists(), "the endpoint file is removed at exit"

    # The very same offsets again, same group: the watermark skips every record before any insert.
    _reset_offsets(bootstrap, run_name)
    assert not _caught_up(bootstrap, run_name)
    proc = start_stage("archive", bootstrap, run_name, "--archive", url, "--archive-flush-s", "0.3", log_path=log)
    try:
        _wait_for(lambda: _caught_up(bootstrap, run_name), 90, "the replay to commit every partition")
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert "archive stopped: 0 rows inserted, 79 records skipped" in log.read_text(), log.read_text()[-3000:]

    # No archive process now: `rlstream sql` opens chDB itself. No FINAL: duplicates would show.
    out = _cli("sql", " UNION ALL ".join(f"SELECT '{t}' AS t, count() AS rows, uniqExact(topic, partition, offset) "
                                         f"AS uniq_rows FROM rlstream.{t}" for t in EXPECTED), "--archive", url,
               "--format", "csv")
    assert out.returncode == 0, out.stderr
    got = {t: (int(n), int(u)) for t, n, u in (line.split(",") for line in out.stdout.splitlines()[1:])}
    assert got == {t: (n, n) for t, n in EXPECTED.items()}
    out = _cli("sql", "SELECT 1", "--archive", f"chdb://{tmp_path / 'missing'}")
    assert out.returncode != 0 and "no archive at" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "missing").exists()


class _Msg:
    """A stand-in for a consumed Kafka message."""

    def __init__(self, topic, partition, offset, value, key=b"k", headers=None):
        self._t, self._p, self._o, self._v, self._k, self._h = topic, partition, offset, value, key, headers

    def topic(self): return self._t
    def partition(self): return self._p
    def offset(self): return self._o
    def value(self): return self._v
    def key(self): return self._k
    def headers(self): return self._h
    def timestamp(self): return (1, 1_700_000_000_123)
    def __len__(self): return len(self._v or b"")


def test_clickhouse_and_python_decoding_store_identical_rows(tmp_path):
    """The chDB fast path (ClickHouse decodes the Avro) and the Python path give the same rows, bad records included."""
    from rlstream.archive.sink import ArchiveSettings, ArchiveSink
    from rlstream.archive.tables import TABLES
    from rlstream.config import LoopSettings
    codec = default_codec()
    heads = [hdr.build(3, hdr.new_traceparent(), "v2", produced_at=1_700_000_000_500), None,
             [("policy_version", b"99999999999"), ("produced_at", b"soon")]]
    records = {
        "prompts": [make_task(i) for i in range(3)],
        "trajectories": [make_trajectory(i, n_tokens=i) for i in range(3)],
        "rewards": [_scored(i) for i in range(4)],
        "feedback": [TeacherFeedback(_scored(i), teacher_version="t", teacher_logprobs=[-0.25] * i) for i in range(2)],
        "actions": [Episode(episode_id="e", group_id="g", sample_index=0, task=make_task(0), token_ids=[7],
                            loss_mask=[1], behaviour_logprobs=[-0.5], failure=Failure("x", "y", "z"),
                            turns=[Turn("action", "t", 0, 1, tool_result=ToolResult("o", failure_class="oom"))])],
        "policy-versions": [PolicyVersion(policy="p", version=1, weights_uri="u", created_at=1, published_at=2)],
        "dead-letters": [DeadLetter(stage="s", reason="r", error="e", topic="t", partition=0, offset=1, failed_at=3,
                                    key=None, value=b"\xff", headers={"h": b"\x00"})],
    }
    good = codec.encode("Trajectory", make_trajectory(9).to_dict())

    def messages(run):
        out = []
        for topic, recs in records.items():
            for j, r in enumerate(recs):
                out.append(_Msg(f"{run}.{topic}", 0, 10 + j, codec.encode(TOPICS[topic].record, r.to_dict()),
                                key=None if j == 1 else b"key", headers=heads[j % 3]))
        # Corrupt bodies behind a valid fingerprint, and a tombstone, among good ones.
        out += [_Msg(f"{run}.trajectories", 1, 5, good), _Msg(f"{run}.trajectories", 1, 6, good[:-3]),
                _Msg(f"{run}.trajectories", 1, 7, good + b"\x00"), _Msg(f"{run}.trajectories", 1, 8, good),
                _Msg(f"{run}.trajectories", 1, 9, None)]
        return out

    sink = ArchiveSink(ArchiveSettings(), LoopSettings(archive=f"chdb://{tmp_path / 'db'}"))
    sink.open()
    try:
        for run, native in (("py", False), ("ch", True)):
            sink._native, sink.watermarks = native, {}
            assert sink.ingest(run, messages(run))
        for table in TABLES:
            cols = ", ".join(f"`{n}`" for n in TABLES[table].names if n != "run")
            py, ch = ([list(r) for r in sink.client.query(f"SELECT {cols} FROM rlstream.{table} WHERE run = '{run}' "
                                                          f"ORDER BY topic, partition, offset").result_rows]
                      for run in ("py", "ch"))
            assert py, table
            if table == "dead_letters":  # failed_at is when the archive saw it; topics carry the run
                names = [n for n in TABLES[table].names if n != "run"]
                at, topic = names.index("failed_at"), names.index("original_topic")
                for rows in (py, ch):
                    for r in rows:
                        r[at], r[topic] = None, r[topic].split(".")[-1]
            assert py == ch, table
        _, rows = sink.sql("SELECT offset, reason FROM rlstream.dead_letters WHERE run = 'ch' AND stage = 'archive' "
                           "ORDER BY offset")
        assert rows == [[6, "malformed"], [7, "malformed"], [9, "tombstone"]]
        assert sink.sql("SELECT groupArray(offset) FROM rlstream.trajectories WHERE run = 'ch' AND partition = 1")[1] \
            == [[[5, 8]]]
    finally:
        sink.close()
