"""Input sources: where a runner's records come from and whose offsets its transactions commit.

The runner asks a source for decoded records (``records.Consumed``), seeks it back after an aborted transaction,
and commits positions in the source's consumer group. ``GroupSource`` is a stage's consumer group over its input
topics, decoding each poll with the runner's ``records.Decoder`` (the batch codec); ``BoundedTopicSource`` is the
same group restricted to the offsets a topic had when it began (a replay), and a source that has records already
decoded elsewhere (replay from the archive) only has to offer the same methods and hand its records over as they
are.
"""
from __future__ import annotations

import logging
from typing import Callable, Protocol

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaException, Message, TopicPartition

from rlstream.config import KafkaSettings
from rlstream.kafka.group import GroupMember
from rlstream.kafka.records import Consumed, Decoder

log = logging.getLogger(__name__)

#: A rebalance callback: (consumer, partitions).
Listener = Callable[[Consumer, list[TopicPartition]], None]


def waiting(consumer: Consumer, parts: list[TopicPartition], starts: dict[tuple[str, int], int]) -> int:
    """Records on ``parts`` past the consumer's position, by the high watermarks librdkafka saw on its last fetch
    (no broker round trip; 0 until a fetch told). A partition read nothing from yet counts from where its reading
    began (``starts``: its committed offset), and from the log's start at the earliest (retention may have deleted
    records no one read: they are not waiting)."""
    try:
        positions = consumer.position(parts)
    except KafkaException as exc:  # e.g. the partitions were revoked meanwhile: nothing of ours waits there
        log.debug("positions of %s: %s", parts, exc)
        return 0
    total = 0
    for tp in positions:
        low, high = consumer.get_watermark_offsets(tp, cached=True)
        at = tp.offset if tp.offset >= 0 else max(starts.get((tp.topic, tp.partition), 0), low)
        if high >= 0:
            total += max(0, high - at)
    return total


class InputSource(Protocol):
    """What the runner needs of its input."""

    consumer: Consumer  # the group's consumer: offsets commit in its group, lag is read from it

    def bind(self, on_assign: Listener, on_revoke: Listener, decoder: Decoder) -> None: ...
    def start(self) -> list[str]: ...
    def consume(self, num: int, timeout: float) -> list[Consumed]: ...
    def seek(self, topic: str, partition: int, offset: int) -> None: ...
    def pause(self, parts: list[TopicPartition]) -> None: ...  # partitions as assigned
    def resume(self, parts: list[TopicPartition]) -> None: ...
    def group_metadata(self): ...
    def exhausted(self) -> bool: ...
    def close(self) -> None: ...


class GroupSource:
    """A consumer group over topics, joined on ``start()``; committed records only."""

    def __init__(self, kafka: KafkaSettings, group_id: str, topics: list[str], *, instance: str = "",
                 session_timeout_ms: int = 10000, who: str = ""):
        self.group_id = group_id
        self._listeners: tuple[Listener, Listener] | None = None
        self._decoder: Decoder | None = None
        self.member = GroupMember(kafka, group_id, topics, instance=instance, session_timeout_ms=session_timeout_ms,
                                  on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke,
                                  who=who or group_id)

    @property
    def consumer(self) -> Consumer:
        """The member's current consumer (a new object after it was replaced)."""
        return self.member.consumer

    def bind(self, on_assign: Listener, on_revoke: Listener, decoder: Decoder) -> None:
        self._listeners = (on_assign, on_revoke)
        self._decoder = decoder

    def _on_assign(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        if not parts:
            # Kafka's assignor gives each partition to one member: a group with more members than its topics have
            # partitions leaves the rest idle (they take over when a member leaves).
            log.warning("%s: no partitions assigned to this member: its group %s has more members than its topics "
                        "have partitions, so it stays idle until one leaves (`rlstream topics --partitions N` "
                        "makes more, for a new run)", self.member.who, self.group_id)
        if self._listeners:
            self._listeners[0](consumer, parts)

    def _on_revoke(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        if self._listeners:
            self._listeners[1](consumer, parts)

    def start(self) -> list[str]:
        return self.member.subscribe().topics

    def consume(self, num: int, timeout: float) -> list[Consumed]:
        """Up to ``num`` records, decoded as one batch."""
        msgs = self._poll(num, timeout)
        return self._decoder.decode(msgs) if msgs else []

    def _poll(self, num: int, timeout: float) -> list[Message]:
        return self.member.consume(num, timeout)

    def seek(self, topic: str, partition: int, offset: int) -> None:
        try:
            self.consumer.seek(TopicPartition(topic, partition, offset))
        except KafkaException:
            pass  # partition was revoked meanwhile; its new owner starts from the committed offset

    def pause(self, parts: list[TopicPartition]) -> None:
        self.consumer.pause(parts)

    def resume(self, parts: list[TopicPartition]) -> None:
        self.consumer.resume(parts)

    def group_metadata(self):
        return self.consumer.consumer_group_metadata()

    def exhausted(self) -> bool:
        return False  # a group has no end

    def close(self) -> None:
        self.member.close()


class BoundedTopicSource(GroupSource):
    """A group over one topic, from a start per partition to the topic's end as it was when ``plan()`` ran.

    Records written after the plan are not part of it: their partition is paused when they show up. The source is
    exhausted once every partition it owns has reached its end.
    """

    def __init__(self, kafka: KafkaSettings, group_id: str, topic: str, **kw):
        super().__init__(kafka, group_id, [topic], **kw)
        self.topic = topic
        self.bounds: dict[int, tuple[int, int]] = {}  # partition -> [start, end)
        self.done_to: dict[int, int] = {}
        self.assigned: list[int] = []

    def plan(self, start_at: Callable[[int, int, int], int]) -> int:
        """Fix each partition's [start, end): ``start_at(partition, low, high)`` picks the requested start, and
        whatever this group already committed wins over it. Returns the number of offsets in range."""
        meta = self.consumer.list_topics(self.topic, timeout=30).topics.get(self.topic)
        if meta is None or meta.error is not None:
            raise LookupError(f"no topic {self.topic} (is --run right?)")
        parts = [TopicPartition(self.topic, p) for p in sorted(meta.partitions)]
        committed = {tp.partition: tp.offset for tp in self.consumer.committed(parts, timeout=30)}
        for tp in parts:
            low, high = self.consumer.get_watermark_offsets(tp, timeout=30)
            start = start_at(tp.partition, low, high)
            if committed.get(tp.partition, OFFSET_INVALID) >= 0:
                start = max(start, committed[tp.partition])  # this group already did the rest
            self.bounds[tp.partition] = (start, high)
            self.done_to[tp.partition] = start
        return sum(max(0, end - start) for start, end in self.bounds.values())

    def offsets_for_time(self, since_ms: int) -> dict[int, int]:
        """Per partition, the first offset at or after a time (-1: nothing that recent)."""
        meta = self.consumer.list_topics(self.topic, timeout=30).topics[self.topic]
        found = self.consumer.offsets_for_times([TopicPartition(self.topic, p, since_ms) for p in meta.partitions],
                                                timeout=30)
        return {tp.partition: tp.offset for tp in found}

    def _on_assign(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        try:
            committed = {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=30)}
        except KafkaException:
            committed = {}
        for tp in parts:
            start, _ = self.bounds.get(tp.partition, (OFFSET_INVALID, 0))
            # After a rebalance, what this group already committed wins over the planned start.
            tp.offset = max(start, committed.get(tp.partition, OFFSET_INVALID))
        consumer.assign(parts)
        self.assigned = [tp.partition for tp in parts]
        super()._on_assign(consumer, parts)

    def _on_revoke(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        gone = {tp.partition for tp in parts}
        self.assigned = [p for p in self.assigned if p not in gone]
        super()._on_revoke(consumer, parts)

    def _poll(self, num: int, timeout: float) -> list[Message]:
        keep, beyond = [], set()
        for m in super()._poll(num, timeout):
            start, end = self.bounds.get(m.partition(), (0, 0))
            if start <= m.offset() < end:
                keep.append(m)
            elif m.offset() >= end:
                beyond.add(m.partition())
        if beyond:
            self.consumer.pause([TopicPartition(self.topic, p) for p in beyond])
            for p in beyond:
                self.done_to[p] = self.bounds[p][1]
        return keep

    def done(self) -> int:
        """Offsets of the range behind the consumer's positions (for progress)."""
        mine = [TopicPartition(self.topic, p) for p in self.assigned if p in self.bounds]
        if mine:
            # Positions, not the last record seen: a range may end in transaction markers that no record shows.
            for tp in self.consumer.position(mine):
                if tp.offset >= 0:
                    self.done_to[tp.partition] = max(self.done_to[tp.partition],
                                                     min(tp.offset, self.bounds[tp.partition][1]))
        return sum(self.done_to[p] - s for p, (s, _) in self.bounds.items())

    def exhausted(self) -> bool:
        """Every partition of the range is done, or every partition this process owns is."""
        self.done()
        if all(self.done_to[p] >= e for p, (_, e) in self.bounds.items()):
            return True
        mine = [p for p in self.assigned if p in self.bounds]
        return bool(mine) and all(self.done_to[p] >= self.bounds[p][1] for p in mine)
