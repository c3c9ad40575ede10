"""The local Kafka broker: idempotent up, records and topics surviving down and up again, and its jars fetched
with Maven into a cache outside any source checkout, then reused."""

import os
import shutil
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from rlstream.infra import broker, broker_jars
from rlstream.kafka.topics import TOPICS, create_topics, delete_topics, topic_name
from tests.helpers.kafka import free_base_port, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _consume_one(bootstrap: str, topic: str, group: str):
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "fetch.max.bytes": 32 * 1024 * 1024})
    try:
        consumer.subscribe([topic])
        for _ in range(60):
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            consumer.commit(message=msg, asynchronous=False)
            return msg
        raise AssertionError(f"no record on {topic} within 60 s")
    finally:
        consumer.close()


@pytest.fixture
def home(tmp_path):
    yield tmp_path / "home"
    broker.down(tmp_path / "home")


@pytest.mark.timeout(540)
def test_up_is_idempotent_and_data_survives_restart(home):
    port = free_base_port(2)
    bootstrap = broker.up(home, port=port)
    assert bootstrap == f"127.0.0.1:{port}"
    pid = broker.status(home)[1]["pid"]
    assert broker.up(home, port=port) == bootstrap
    assert broker.status(home)[1]["pid"] == pid

    topic = f"t-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)

    # Over the 1 MiB broker default, to check the 16 MiB message limit is in force.
    value = b"x" * (3 * 1024 * 1024)
    producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 16 * 1024 * 1024,
                         "enable.idempotence": True})
    producer.produce(topic, key=b"k", value=value)
    assert producer.flush(30) == 0

    msg = _consume_one(bootstrap, topic, "g1")
    assert (msg.key(), msg.value()) == (b"k", value)

    broker.down(home)
    assert broker.status(home) == {}
    broker.down(home)

    assert broker.up(home, port=port) == bootstrap
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert topic in admin.list_topics(timeout=10).topics
    msg = _consume_one(bootstrap, topic, "g2")
    assert (msg.key(), msg.value(), msg.offset()) == (b"k", value, 0)

    # The first group's committed offset lives in __consumer_offsets, which must survive too.
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "g1"})
    try:
        committed = consumer.committed([TopicPartition(topic, 0)], timeout=10)
        assert committed[0].offset == 1
    finally:
        consumer.close()

    broker.down(home)
    assert broker.status(home) == {}


def test_jars_are_fetched_into_the_cache_once_and_reused(tmp_path, monkeypatch):
    """A fetch lands whole under $RLSTREAM_HOME/cache/kafka/<pom hash>; a copy there or in the user's cache is
    then used without Maven (which is taken off PATH to show it)."""
    monkeypatch.delenv("RLSTREAM_KAFKA_LIB", raising=False)
    monkeypatch.setenv("RLSTREAM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    cache = tmp_path / "home" / "cache" / "kafka"

    lib = broker_jars.kafka_lib()
    assert lib == cache / broker_jars.pom_hash()
    assert any(lib.glob("kafka_2.13-*.jar")) and any(lib.glob("log4j-slf4j-impl-*.jar"))
    assert os.listdir(cache) == [lib.name]  # Maven's work directory is gone

    no_maven = tmp_path / "bin"
    no_maven.mkdir()
    monkeypatch.setenv("PATH", str(no_maven))
    assert broker_jars.kafka_lib() == lib

    user_copy = tmp_path / "user-cache" / "rlstream" / "kafka" / lib.name
    user_copy.parent.mkdir(parents=True)
    shutil.move(lib, user_copy)
    assert broker_jars.kafka_lib() == user_copy
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(broker.BrokerError, match="Maven"):
        broker_jars.kafka_lib()


def test_a_runs_topics_are_created_and_deleted_together(bootstrap):
    run = "del" + uuid.uuid4().hex[:8]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = set(create_topics({"bootstrap.servers": bootstrap}, run, partitions=1))
    assert names == {topic_name(run, t) for t in TOPICS}
    other = "keep" + uuid.uuid4().hex[:8]
    create_topics({"bootstrap.servers": bootstrap}, other, partitions=1)
    delete_topics({"bootstrap.servers": bootstrap}, run)
    wait_for(lambda: not names & set(admin.list_topics(timeout=10).topics), 30, f"{run}'s topics to go")
    assert topic_name(other, "weights") in admin.list_topics(timeout=10).topics  # another run's stay
    delete_topics({"bootstrap.servers": bootstrap}, other)
    delete_topics({"bootstrap.servers": bootstrap}, run)  # none left: nothing to do, no error
