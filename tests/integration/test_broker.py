"""The local Kafka broker: idempotent up, records and topics surviving down and up again."""

import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from rlstream.infra import broker
from tests.helpers.kafka import free_base_port

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
