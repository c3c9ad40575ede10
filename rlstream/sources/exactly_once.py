"""The exactly-once writer of a source: transactional batches, and where it stopped read back from the topics.

Every record a source writes carries two headers, ``source_id`` and ``source_seq`` (its position in the source's
fixed order). A batch is one transaction of consecutive positions, so the committed positions of a source are
always 0..k with nothing missing: the restart point is the highest committed ``source_seq`` plus one, read with
``read_committed`` from the topics alone (``prompts``, ``eval-prompts`` and ``dead-letters``: a row that became a
dead letter is done too). A batch that a SIGKILL cut short was never committed and is not seen; the restart writes it again.

The transactional id is ``<run>.prompts.<source id>``: registering it (``start``) fences the killed instance and
aborts its open transaction, which must happen before the read back, or that transaction could still commit.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlstream import metrics
from rlstream.config import KafkaSettings
from rlstream.kafka.records import encode
from rlstream.kafka.tail import read_to_end
from rlstream.kafka.topics import topic_name
from rlstream.kafka.transactions import TransactionalProducer
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Record

log = logging.getLogger(__name__)

SOURCE_ID = "source_id"
SOURCE_SEQ = "source_seq"

#: The topics a source writes, and so reads back (held-out rows go to the eval lane's prompts).
SOURCE_TOPICS = ("prompts", "eval-prompts", "dead-letters")


@dataclass
class Out:
    """One record to write at position ``seq`` of the source's order."""

    seq: int
    topic: str  # logical
    key: str | bytes
    record: Record
    traceparent: str


def committed_next(kafka: KafkaSettings, source_id: str, timeout: float = 300.0) -> int:
    """The position after the last one ``source_id`` committed to the run's topics (0: none yet)."""
    ours = source_id.encode()
    last = -1
    for topic in SOURCE_TOPICS:
        for seen in read_to_end(kafka.client_config(), kafka.run, topic, timeout=timeout,
                                name=f"resume.{source_id}"):
            if seen.headers.get(SOURCE_ID) == ours:
                last = max(last, hdr.int_header(seen.headers, SOURCE_SEQ))
    return last + 1


class ExactlyOnceWriter:
    """Writes a source's records in transactions of consecutive positions; ``next`` is the first one not written."""

    def __init__(self, kafka: KafkaSettings, source_id: str, *, stopping: Callable[[], bool] = lambda: False,
                 pause_s: float = 0.0):
        """``pause_s``: how long each transaction waits before its commit (a gentle rate; tests kill inside it)."""
        self.kafka, self.source_id, self.pause_s = kafka, source_id, pause_s
        self.producer = TransactionalProducer(kafka, f"{kafka.run}.prompts.{source_id}", who=f"prompts.{source_id}",
                                              stopping=stopping)
        self.next = 0

    def start(self) -> int:
        """Fence any earlier instance, then read back where the source stopped; the position to continue from."""
        self.producer.start()
        self.next = committed_next(self.kafka, self.source_id)
        if self.next:
            log.info("source %s resumes after position %d", self.source_id, self.next - 1)
        return self.next

    def write(self, batch: list[Out]) -> None:
        """Commit ``batch`` (the positions from ``next`` on, in order) as one transaction, redone until it commits."""
        if not batch:
            return
        if batch[0].seq != self.next or any(b.seq != a.seq + 1 for a, b in zip(batch, batch[1:])):
            raise ValueError(f"source {self.source_id}: batch at {[o.seq for o in batch][:5]}..., expected "
                             f"consecutive positions from {self.next}")
        ours = self.source_id.encode()

        def body() -> None:
            for out in batch:
                headers = hdr.build(-1, out.traceparent) + [(SOURCE_ID, ours), (SOURCE_SEQ, str(out.seq).encode())]
                self.producer.produce(topic_name(self.kafka.run, out.topic), encode(out.topic, out.record),
                                      out.key, headers)
            if self.pause_s:
                time.sleep(self.pause_s)

        # False: aborted (a broker fault); nothing of it is visible, so the same batch is written again.
        while not self.producer.transact(body):
            time.sleep(0.5)
        for out in batch:
            if out.topic == "dead-letters":
                metrics.DEAD_LETTERS.labels("prompts", "invalid").inc()
        self.next = batch[-1].seq + 1
