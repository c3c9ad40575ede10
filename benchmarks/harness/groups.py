"""A consumer group's committed offsets: a stage's progress as the broker records it."""
from __future__ import annotations

from confluent_kafka import ConsumerGroupTopicPartitions
from confluent_kafka.admin import AdminClient


def group_offsets(admin: AdminClient, group: str, timeout: float = 10.0) -> dict[tuple[str, int], int]:
    """The committed offsets of a consumer group ({} when it has none, or the broker did not answer)."""
    return {tp: offset for tp, (offset, _) in committed_with_metadata(admin, group, timeout).items()}


def advanced(before: dict[tuple[str, int], int], now: dict[tuple[str, int], int]) -> bool:
    """Whether any partition's committed offset moved past ``before``."""
    return any(offset > before.get(tp, -1) for tp, offset in now.items())


def committed_with_metadata(admin: AdminClient, group: str, timeout: float = 10.0) -> dict[tuple[str, int], tuple]:
    """(offset, metadata) per partition the group has committed ({} when none, or the broker did not answer)."""
    try:
        future = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                   request_timeout=timeout)[group]
        parts = future.result(timeout + 5).topic_partitions or []
    except Exception:
        return {}
    return {(tp.topic, tp.partition): (tp.offset, tp.metadata) for tp in parts if tp.offset >= 0 and tp.error is None}

