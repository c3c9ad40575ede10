"""Static group membership against the real broker: a fenced member replaces its consumer and keeps reading."""
from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer

from rlstream.config import KafkaSettings
from rlstream.kafka.group import GroupMember, group_consumer_config
from rlstream.kafka.topics import topic_name
from tests.helpers.kafka import make_task, produce


def _drain(member: GroupMember, want: int, timeout: float) -> set[int]:
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < want and time.monotonic() < deadline:
        for m in member.consume(100, 0.3):
            seen.add(m.offset() * 10 + m.partition())
    return seen


@pytest.mark.timeout(300)
def test_a_member_fenced_by_its_own_instance_id_rejoins_and_reads_on(bootstrap, run_name):
    kafka = KafkaSettings(bootstrap=bootstrap, run=run_name)
    group = f"{run_name}.members"
    produce(bootstrap, run_name, "prompts", [(f"k{i}", make_task(i), None) for i in range(6)])
    topic = topic_name(run_name, "prompts")
    member = GroupMember(kafka, group, [topic], instance="w0", session_timeout_ms=6000, who="test").subscribe()
    try:
        assert len(_drain(member, 6, 60)) == 6
        first = member.consumer

        # A second consumer with the same group.instance.id: the broker fences the first one's member id,
        # exactly what a static member meets after outliving its own session.
        intruder = Consumer(group_consumer_config(kafka, group, "w0", 6000))
        intruder.subscribe([topic])
        deadline = time.monotonic() + 60
        while member.consumer is first and time.monotonic() < deadline:
            intruder.poll(0.2)
            member.consume(10, 0.2)
        assert member.consumer is not first, "the fenced consumer was not replaced"
        intruder.close()

        # The replacement starts from the committed offsets (none were committed): it reads everything again,
        # and then new records as they come.
        produce(bootstrap, run_name, "prompts", [(f"n{i}", make_task(100 + i), None) for i in range(4)])
        assert len(_drain(member, 10, 60)) == 10
    finally:
        member.close()


def test_static_membership_only_with_a_stable_instance(bootstrap):
    kafka = KafkaSettings(bootstrap=bootstrap, run="r")
    assert "group.instance.id" not in group_consumer_config(kafka, "r.reward")
    assert group_consumer_config(kafka, "r.reward", "3")["group.instance.id"] == "r.reward.3"
