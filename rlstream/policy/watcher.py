"""Follows the compacted policy-versions topic in a background thread: the newest announced policy."""
from __future__ import annotations

import logging
import threading
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from rlstream.kafka.topics import topic_name
from rlstream.schemas.codec import DecodeError, default_codec
from rlstream.schemas.records import PolicyVersion

log = logging.getLogger(__name__)


class PolicyWatcher:
    """Tracks the newest PolicyVersion of one policy; ``latest`` is safe to read from any thread."""

    def __init__(self, client_config: dict, run: str, policy: str, on_new=None):
        self.policy = policy
        self.latest: PolicyVersion | None = None
        self.seen_at: dict[int, float] = {}  # version -> monotonic time it was first seen here
        self._on_new = on_new
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._consumer = Consumer({**client_config, "group.id": f"{run}.policy-watch", "enable.auto.commit": False,
                                   "isolation.level": "read_committed", "auto.offset.reset": "earliest"})
        name = topic_name(run, "policy-versions")
        parts = self._consumer.list_topics(name, timeout=30).topics[name].partitions
        # No group subscription: every watcher reads the whole (compacted) topic from the start.
        self._consumer.assign([TopicPartition(name, p, OFFSET_BEGINNING) for p in parts])
        self._thread = threading.Thread(target=self._loop, name="policy-watch", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        """The newest announced version (-1 before the first)."""
        latest = self.latest
        return latest.version if latest is not None else -1

    def wait_for(self, version: int, timeout: float) -> bool:
        """Block until a version >= ``version`` is announced (or the timeout passes)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.version >= version, timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()

    def _loop(self) -> None:
        codec = default_codec()
        while not self._stop.is_set():
            # poll() returns on the first record; consume(n, t) would sit out its whole timeout waiting for
            # n records, and every rollout would see each new version up to that much later.
            first = self._consumer.poll(0.2)
            if first is None:
                continue
            for msg in [first, *self._consumer.consume(100, 0)]:
                if msg.error():
                    continue
                try:
                    _, value = codec.decode(msg.value(), expect="PolicyVersion")
                except DecodeError as exc:
                    log.warning("ignoring undecodable policy version at offset %d: %s", msg.offset(), exc)
                    continue
                pv = PolicyVersion.from_dict(value)
                if pv.policy != self.policy or pv.version <= self.version:
                    continue
                with self._changed:
                    self.latest = pv
                    self.seen_at[pv.version] = time.monotonic()
                    self._changed.notify_all()
                if self._on_new:
                    self._on_new(pv)
