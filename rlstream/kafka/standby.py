"""Warm standbys (``--standby``): a second process of a worker's ``--instance``, loaded, that takes the instance over
once the worker's group membership lapses.

The broker drops a SIGKILLed member when its session lapses (``--session-timeout-ms``), so a standby that watches
the group takes over that long after a crash, instead of a process start and a model load after it.

Exactly-once does not rest on the watching being right: the taker's transactional producer fences every older one
of the instance's transactional id, and its static membership fences the older member, so of two processes that
both believe they are the instance, the older can neither commit nor keep its partitions, and exits as a zombie.

What the watching must get right is liveness: two takers at once fence each other back and forth (each one's
rejoin fences the other's consumer) until both give up. So the standbys of an instance stand in a line: a
consumer group of their own, ``<group>.standby.<instance>``, over the run's one-partition ``policy-versions``
topic, whose one partition goes to one member at a time. Only the member holding it may take over, and it keeps
holding it for as long as it lives, as the primary (``cooperative-sticky`` keeps a partition with its holder when
another standby joins). When the primary dies, its place in the line lapses with the same session as its place in
the worker's group, and the partition goes to one standby alone; a process restarted meanwhile queues behind it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from rlstream.config import KafkaSettings
from rlstream.errors import UsageError
from rlstream.kafka.group import heartbeat_ms, static_member_id
from rlstream.kafka.topics import topic_name

log = logging.getLogger(__name__)

#: The line's topic: one partition in every run, so one member of the line holds it at a time.
LINE_TOPIC = "policy-versions"


def check_standby(instance: str, who: str) -> None:
    """A standby needs the instance it stands by for (raised before it loads anything)."""
    if not instance:
        raise UsageError(f"{who}: --standby needs a stable --instance: a standby takes over the worker with the "
                         "same --instance when that one's group membership lapses")


def holds(admin: AdminClient, group_id: str, member: str, timeout_s: float = 5.0) -> bool:
    """Whether a live member of ``group_id`` has the static id ``member`` (one describe round trip)."""
    try:
        desc = admin.describe_consumer_groups([group_id], request_timeout=timeout_s)[group_id].result(timeout_s + 5)
    except KafkaException as exc:
        if exc.args and exc.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
            return False  # no group yet: nobody holds anything
        raise
    return any(m.group_instance_id == member for m in desc.members)


class Line:
    """This process's place in its instance's line (module docstring); kept for the life of the process."""

    def __init__(self, kafka: KafkaSettings, group_id: str, instance: str, session_timeout_ms: int):
        self.consumer = Consumer({
            **kafka.client_config(), "group.id": f"{group_id}.standby.{instance}",
            "session.timeout.ms": session_timeout_ms, "heartbeat.interval.ms": heartbeat_ms(session_timeout_ms),
            "partition.assignment.strategy": "cooperative-sticky", "enable.auto.commit": False,
            "auto.offset.reset": "latest", "max.poll.interval.ms": 600000})
        self.joined = False  # until the line's first assignment (maybe of nothing) says where this process stands
        self.consumer.subscribe([topic_name(kafka.run, LINE_TOPIC)], on_assign=self._assigned)
        self._lock = threading.Lock()
        self._left = False

    def _assigned(self, consumer, parts) -> None:
        self.joined = True  # the binding assigns ``parts`` itself after this returns

    def first(self) -> bool:
        """Whether this process holds the line's partition (serving the line's rebalances)."""
        with self._lock:
            if self._left:
                return False
            self.consumer.poll(0)
            parts = self.consumer.assignment()
            if parts:
                self.consumer.pause(parts)  # the line's records are nobody's business
            return bool(parts)

    def keep(self) -> "Line":
        """Hold the place from a thread of its own: the line's rebalances are served through polls."""
        def serve():
            while not self._left:
                self.first()
                time.sleep(0.5)
        threading.Thread(target=serve, name="standby-line", daemon=True).start()
        return self

    def leave(self) -> None:
        """Give the place up (the next standby in line becomes first)."""
        with self._lock:
            if not self._left:
                self._left = True
                self.consumer.close()


def await_vacancy(kafka: KafkaSettings, group_id: str, instance: str, session_timeout_ms: int, *,
                  stopping: Callable[[], bool], poll_s: float = 0.2, who: str = "") -> Line | None:
    """Stand in the instance's line until first in it with no live member of ``group_id`` holding ``instance``'s
    static id; then the place is kept (returned: hold on to it) and the caller takes over. None if ``stopping()``
    came first. A broker that cannot be asked is asked again: waiting is the safe side."""
    who = who or group_id
    check_standby(instance, who)
    member, admin = static_member_id(group_id, instance), AdminClient(kafka.client_config())
    line = Line(kafka, group_id, instance, session_timeout_ms)
    since, standing, reported = time.monotonic(), "", 0.0
    try:
        while not stopping():
            try:
                first = line.first()
                if not line.joined:
                    time.sleep(poll_s / 4)
                    continue
                if first and not holds(admin, group_id, member):
                    log.info("%s taking over %s %s", who, member, f"after {time.monotonic() - since:.1f} s standing "
                             "by" if standing else "(no live member holds it)")
                    return line.keep()
                why = "a live worker holds it" if first else "another standby is first in line"
                if standing != why:
                    standing = why
                    log.info("%s standing by for %s: %s", who, member, why)
            except KafkaException as exc:
                if time.monotonic() - reported > 30:
                    reported = time.monotonic()
                    log.warning("%s standing by: cannot ask the broker about group %s (%s); asking again", who,
                                group_id, exc)
            time.sleep(poll_s)
    except BaseException:
        line.leave()
        raise
    line.leave()
    return None
