"""The announced policy versions, read from the compacted policy-versions topic with the tail reader.

- ``PolicyWatcher``: follows the topic in a background thread; the newest announced version of one policy.
- ``last_policy_version``: reads the topic to its end once; the newest version of one policy (a trainer resuming).
"""
from __future__ import annotations

import logging
import threading

from rlstream.kafka.tail import Seen, TopicTail, read_to_end
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
        # Every watcher reads the whole (compacted) topic from the start, and keeps only the newest version.
        self._tail = TopicTail(client_config, run, ["policy-versions"], name="policy-watch", keep=False,
                               on_record=self._seen)

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
        """Stop following the topic."""
        self._tail.close()

    def _seen(self, s: Seen) -> None:
        """One record of the topic: a newer version of this policy becomes ``latest``."""
        pv = s.record
        if pv is None:
            log.warning("ignoring undecodable policy version at offset %d", s.offset)
            return
        if pv.policy != self.policy or pv.version <= self.version:
            return
        with self._changed:
            self.latest = pv
            self.seen_at[pv.version] = s.seen_at
            self._changed.notify_all()
        if self._on_new:
            self._on_new(pv)


def last_policy_version(client_config: dict, run: str, policy: str, timeout: float = 60.0) -> PolicyVersion | None:
    """The newest committed PolicyVersion of ``policy`` in ``run`` (None before the first); TimeoutError when the
    topic cannot be read to its end within ``timeout`` seconds, rather than an older version."""
    latest: PolicyVersion | None = None
    for s in read_to_end(client_config, run, "policy-versions", timeout=timeout, name="policy-last"):
        pv = s.record
        if pv is None:
            log.warning("ignoring undecodable policy version at offset %d", s.offset)
        elif pv.policy == policy and (latest is None or pv.version > latest.version):
            latest = pv
    return latest
