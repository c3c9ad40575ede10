"""Kafka's own console consumer, on the jars `rlstream up` fetches, prints our records' keys and headers: the
command the README gives, run against the broker."""
import subprocess
import sys

import pytest

from rlstream.infra import broker_image
from rlstream.infra.broker_jars import kafka_lib
from rlstream.kafka.topics import TOPICS, topic_name
from rlstream.schemas import headers as hdr
from tests.helpers import ROOT
from tests.helpers.kafka import make_trajectory, produce, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(150)  # the JVM tool reads for at most 60 s, plus start-up (and a first fetch of the jars)
def test_kafka_console_consumer_prints_our_records_keys_and_headers(bootstrap, run_name):
    traceparent = hdr.new_traceparent()
    produce(bootstrap, run_name, "trajectories",
            [(f"group-{i}", make_trajectory(i), hdr.build(i + 3, traceparent, reward_version="v2")) for i in range(2)])
    done = subprocess.run(
        [sys.executable, "-m", "rlstream.infra.kafka_tools", "console-consumer",
         "--bootstrap-server", bootstrap, "--topic", topic_name(run_name, "trajectories"), "--from-beginning",
         "--max-messages", "2", "--timeout-ms", "60000",
         "--property", "print.key=true", "--property", "print.headers=true", "--property", "print.value=false",
         "--property", "print.partition=true", "--property", "print.offset=true"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines(), key=lambda line: line.rsplit("\t", 1)[-1])
    assert len(lines) == 2, done.stdout
    for i, line in enumerate(lines):
        # Partition, offset, headers (comma-separated key:value), key; tab-separated.
        partition, offset, headers, key = line.split("\t")
        assert partition.startswith("Partition:") and offset.startswith("Offset:")
        assert key == f"group-{i}"
        fields = dict(h.split(":", 1) for h in headers.split(","))
        assert fields[hdr.POLICY_VERSION] == str(i + 3)
        assert fields[hdr.TRACEPARENT] == traceparent
        assert fields[hdr.REWARD_VERSION] == "v2"
        assert int(fields[hdr.PRODUCED_AT]) > 0
    assert "Processed a total of 2 messages" in done.stderr


@pytest.mark.timeout(90)
def test_the_broker_images_tool_commands_run_on_the_same_jars(bootstrap, run_name, tmp_path):
    # The compose broker image's /opt/kafka, written here with the jars rlstream up runs from.
    broker_image.write(tmp_path)
    (tmp_path / "libs").symlink_to(kafka_lib())
    done = subprocess.run([str(tmp_path / "bin" / "kafka-topics"), "--bootstrap-server", bootstrap, "--list"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert {topic_name(run_name, t) for t in TOPICS} <= set(done.stdout.split())


def test_an_unknown_tool_names_the_known_ones():
    done = subprocess.run([sys.executable, "-m", "rlstream.infra.kafka_tools", "console-consumr"], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 2
    assert "unknown Kafka tool 'console-consumr'" in done.stderr and "console-consumer" in done.stderr


def test_rlstream_topics_creates_the_partitions_asked_for(bootstrap):
    import uuid

    from confluent_kafka.admin import AdminClient

    from rlstream.cli import main
    run = "p" + uuid.uuid4().hex[:10]
    assert main(["topics", "--run", run, "--bootstrap", bootstrap, "--partitions", "3",
                 "--topic-partitions", "rewards=5"]) == 0
    topics = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).topics
    assert len(topics[f"{run}.prompts"].partitions) == 3 and len(topics[f"{run}.observations"].partitions) == 3
    assert len(topics[f"{run}.rewards"].partitions) == 5 and len(topics[f"{run}.policy-versions"].partitions) == 1


def test_rlstream_topics_delete_removes_that_run_alone(bootstrap, capsys):
    import uuid

    from confluent_kafka.admin import AdminClient

    from rlstream.cli import main
    run, other = ("d" + uuid.uuid4().hex[:10] for _ in range(2))
    for r in (run, other):
        assert main(["topics", "--run", r, "--bootstrap", bootstrap, "--partitions", "1"]) == 0
    capsys.readouterr()
    assert main(["topics", "--run", run, "--bootstrap", bootstrap, "--delete"]) == 0
    assert f"deleted {run}.trajectories" in capsys.readouterr().out
    admin = AdminClient({"bootstrap.servers": bootstrap})
    wait_for(lambda: not any(t.startswith(run + ".") for t in admin.list_topics(timeout=10).topics), 30,
             f"{run}'s topics to go")
    assert f"{other}.trajectories" in admin.list_topics(timeout=10).topics  # another run's stay
    assert main(["topics", "--run", run, "--bootstrap", bootstrap, "--delete"]) == 0  # nothing left: said, no error
    assert f"run {run} has no topics" in capsys.readouterr().out
    assert main(["topics", "--run", other, "--bootstrap", bootstrap, "--delete"]) == 0
