"""Consumer-group membership, shared by every process that reads the loop's topics (stages, trainer, archive).

Members with a stable instance id use static membership (KIP-345): a worker restarted with the same id takes
its partitions back at once instead of waiting out its dead predecessor's session, which is what bounds
recovery after a crash. The price is that a static member can find itself fenced by its own earlier
incarnation in the group (for example after a broker outage longer than the session); librdkafka reports
that as fatal, so the member replaces its consumer in-process and rejoins from the committed offsets.

Warm standbys of a member (``--standby``) are ``rlstream.kafka.standby``'s.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from rlstream.config import KafkaSettings
from rlstream.kafka.topics import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

#: Replacements allowed within REPLACE_WINDOW_S before a fatal error is taken as permanent.
MAX_REPLACEMENTS = 5
REPLACE_WINDOW_S = 600.0

#: What a transaction's offset commit answers when the consumer whose group metadata it carries no longer holds
#: its place in the group (fenced by its own instance id, or left behind by a rebalance it did not see).
MEMBERSHIP_LOST = (KafkaError.FENCED_INSTANCE_ID, KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION)


def group_consumer_config(kafka: KafkaSettings, group_id: str, instance: str = "",
                          session_timeout_ms: int = 10000) -> dict[str, Any]:
    """Consumer settings for a member of ``group_id``: committed records only, offsets moved by hand."""
    config: dict[str, Any] = {
        **kafka.client_config(),
        "group.id": group_id,
        "client.id": f"{group_id}.{instance}" if instance else group_id,
        # Downstream of a transactional stage, only committed records exist.
        "isolation.level": "read_committed",
        # Offsets move only inside our transactions (or after the archive's insert), never on their own.
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "max.partition.fetch.bytes": MAX_MESSAGE_BYTES,
        "fetch.max.bytes": 4 * MAX_MESSAGE_BYTES,
        "session.timeout.ms": session_timeout_ms,
        "heartbeat.interval.ms": heartbeat_ms(session_timeout_ms),
        # A trainer step or a slow batch may hold the poll loop for minutes; liveness is the session's job.
        "max.poll.interval.ms": 600000,
    }
    if instance:
        config["group.instance.id"] = static_member_id(group_id, instance)
    return config


def heartbeat_ms(session_timeout_ms: int) -> int:
    """A member's heartbeat for its session: five to a session, so a short one (a warm standby's 1 s) is not lost to
    one late heartbeat, and surviving members hear of a rebalance within a fifth of it."""
    return max(200, session_timeout_ms // 5)


def static_member_id(group_id: str, instance: str) -> str:
    """The static membership id (``group.instance.id``) of ``instance`` in ``group_id``."""
    return f"{group_id}.{instance}"


class GroupMember:
    """One consumer of a group, for ``topics``; replaced in-process when librdkafka gives up on it.

    ``subscribe()`` joins the group (the consumer exists before, for offset lookups). Always reach the consumer
    through ``.consumer``: it is a new object after a replacement. The rebalance callbacks fire again for the
    new consumer, so state keyed by assignment is rebuilt by them.
    """

    def __init__(self, kafka: KafkaSettings, group_id: str, topics: list[str], *, instance: str = "",
                 session_timeout_ms: int = 10000, overrides: dict[str, Any] | None = None,
                 on_assign: Callable | None = None, on_revoke: Callable | None = None,
                 on_lost: Callable | None = None, who: str = ""):
        self.who = who or group_id
        self.topics = list(topics)
        self._config = {**group_consumer_config(kafka, group_id, instance, session_timeout_ms), **(overrides or {})}
        self._callbacks = {k: v for k, v in (("on_assign", on_assign), ("on_revoke", on_revoke),
                                             ("on_lost", on_lost)) if v is not None}
        self._replaced_at: list[float] = []
        self._subscribed = False
        self.consumer = Consumer(self._config)

    def subscribe(self) -> "GroupMember":
        """Join the group."""
        self.consumer.subscribe(self.topics, **self._callbacks)
        self._subscribed = True
        return self

    def consume(self, num: int, timeout: float) -> list[Message]:
        """Up to ``num`` records: waits at most ``timeout`` for the first, then takes only what is already fetched.

        librdkafka's batch consume returns early only when the batch is full, so a plain ``consume(num, timeout)``
        holds the last records of every trickle for the whole timeout: one poll interval of latency per hop of
        the loop. Partition EOFs and transient errors are dropped; a fatal error replaces the consumer.
        """
        msgs = self.consumer.consume(1, timeout)
        if msgs and num > 1:
            msgs += self.consumer.consume(num - 1, 0)
        if all(m.error() is None for m in msgs):
            return msgs
        good = []
        for m in msgs:
            err = m.error()
            if err is None:
                good.append(m)
            elif err.code() in (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART):
                continue
            # A fatal consumer error arrives as code _FATAL, not always with the fatal flag set.
            elif err.fatal() or err.code() == KafkaError._FATAL:
                self.replace(err)
                return []  # records of the old consumer are read again from the committed offsets
            else:
                log.warning("%s consume error: %s", self.who, err)
        return good

    def replace(self, err: KafkaError) -> None:
        """Close the broken consumer and join again with the same identity; raise if it keeps happening."""
        now = time.monotonic()
        self._replaced_at = [t for t in self._replaced_at if now - t < REPLACE_WINDOW_S] + [now]
        if len(self._replaced_at) > MAX_REPLACEMENTS:
            log.error("%s: consumer failed fatally %d times in %.0f s (%s); giving up", self.who,
                      len(self._replaced_at), REPLACE_WINDOW_S, err)
            raise KafkaException(err)
        log.warning("%s: consumer failed fatally (%s); replacing it and rejoining the group", self.who, err)
        old, self.consumer = self.consumer, None
        try:
            old.close()
        except (KafkaException, RuntimeError) as exc:  # a fenced consumer may refuse a clean close
            log.info("%s: closing the failed consumer: %s", self.who, exc)
        self.consumer = Consumer(self._config)
        if self._subscribed:
            self.consumer.subscribe(self.topics, **self._callbacks)

    def rejoin(self, err: KafkaError, timeout: float = 60.0) -> set[tuple[str, int]]:
        """Replace the consumer (``replace``) and wait until the new one holds partitions: the (topic, partition)s
        it holds, empty if none came within ``timeout``. What it reads meanwhile is dropped, so before reading on,
        the caller moves it back with ``seek_committed``."""
        self.replace(err)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.consume(1, 0.2)  # joins, and runs the assignment callbacks
            held = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
            if held:
                return held
        return set()

    def seek_committed(self) -> None:
        """Move every held partition to the group's committed offset (its start where none is committed)."""
        try:
            for tp in self.consumer.committed(self.consumer.assignment(), timeout=30):
                tp.offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
                self.consumer.seek(tp)
        except KafkaException as exc:  # e.g. a partition not fetching yet refuses a seek
            self.replace(exc.args[0])  # a new consumer starts from the committed offsets

    def commit_consumed(self, msgs: list[Message]) -> bool:
        """Commit, outside any transaction, the positions past these records; False if the broker refused.

        Only for a member whose writes are idempotent elsewhere (the archive: its rows carry their offsets, and a
        re-read record is skipped by watermark). Stages commit inside their transactions instead.
        """
        offsets: dict[tuple[str, int], int] = {}
        for m in msgs:
            key = (m.topic(), m.partition())
            offsets[key] = max(offsets.get(key, -1), m.offset() + 1)
        try:
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                 asynchronous=False)
        except KafkaException as exc:
            log.warning("%s: offset commit failed (%s)", self.who, exc)
            return False
        return True

    def committed_offsets(self, topic: str, partitions: list[int]) -> dict[int, int]:
        """This group's committed offset per partition of ``topic`` (none for a partition it never committed, or
        for a topic that is gone)."""
        try:
            found = self.consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=30)
        except KafkaException:
            return {}
        return {tp.partition: tp.offset for tp in found if tp.offset >= 0}

    def close(self) -> None:
        """Leave (static members keep their slot until the session times out, so a restart finds it)."""
        if self.consumer is not None:
            try:
                self.consumer.close()
            except Exception as exc:  # e.g. a rebalance callback that could not finish: we are leaving anyway
                log.warning("%s: closing the consumer: %s", self.who, exc)
