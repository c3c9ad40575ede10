"""The tail reader: follows logical topics of a run, committed records only, and knows when it is at their end.

Every reader that is not a stage goes through here: the policy watcher and the trainer's resume
(``rlstream.policy.watcher``), the monitor's plain backend, the demo's live view, the benchmarks and the tests.

- ``TopicTail``: a background thread that follows the topics, keeps what it read (``keep``) and/or hands each
  record to ``on_record``, and says when every partition is at its end (``caught_up``, ``settle``).
- ``read_to_end``: every committed record of one topic, up to each partition's end as of the call.
- ``read_from``: the committed records of one partition from an offset, as they come, up to its end as of the
  call; the caller stops when it has what it wanted (the weights log reads one version's chunks so).

The reader is assigned every partition (no group membership, nothing committed), from the beginning or from
given offsets, with ``isolation.level=read_committed``. For such a reader the end of a partition is its last
stable offset, and transaction markers take offsets too, so neither the high watermark nor a quiet spell says
"caught up": librdkafka's partition-EOF event does, and it comes again each time new records have been read.
A partition that is written without pause may never show its end, so ``read_to_end`` also counts a partition
as read once it read past the high watermark the partition had when the read began.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from rlstream.errors import UserError
from rlstream.kafka.topics import MAX_MESSAGE_BYTES, TOPICS, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import RECORD_TYPES, Record

log = logging.getLogger(__name__)

#: Records taken per wake-up once the first one is there.
BATCH = 500
#: How long a reader waits for a topic the broker does not know before it says so.
UNKNOWN_TOPIC_WAIT_S = 10.0


class UnknownTopic(UserError):
    """A reader was asked for a topic that does not exist (a misspelt run, or one whose topics were never made)."""


@dataclass
class Seen:
    """One committed record as the tail read it."""

    topic: str  # logical
    partition: int
    offset: int
    key: bytes | None
    headers: dict[str, bytes]
    record: Record | None  # None when the value is not the topic's record (tests put garbage on topics on purpose)
    timestamp_ms: int  # the record's Kafka timestamp
    seen_at: float  # monotonic time this process read it


class _Reader:
    """One consumer assigned every partition of some topics of a run; ``poll`` decodes what it fetched."""

    def __init__(self, client_config: dict, run: str, topics: list[str], name: str,
                 offsets: dict[tuple[str, int], int] | None, ends: bool = False, only: bool = False):
        """``ends``: note each partition's high watermark now, for ``read_past_ends``; ``only``: assign only the
        partitions ``offsets`` names."""
        self.name = name
        self._logical = {topic_name(run, t): t for t in topics}
        self._codec = default_codec()
        self._consumer = Consumer({**client_config, "group.id": f"{run}.{name}", "enable.auto.commit": False,
                                   "isolation.level": "read_committed", "enable.partition.eof": True,
                                   # A failed lookup of the beginning falls back to this: the end would skip records.
                                   "auto.offset.reset": "earliest",
                                   "fetch.max.bytes": 64 * 1024 * 1024,
                                   # Two of the largest records a partition can hold per fetch (a weights chunk is
                                   # one): the default 1 MiB would fetch them one request at a time.
                                   "max.partition.fetch.bytes": 2 * (MAX_MESSAGE_BYTES + 65536),
                                   # A read to the end learns it is there (past the last transaction's commit
                                   # marker) from a fetch that finds nothing new, which the broker holds for this
                                   # long: librdkafka's 500 ms was half a second of every trainer resume.
                                   **({"fetch.wait.max.ms": 10} if ends else {})})
        self.eof: dict[tuple[str, int], bool] = {}
        self.next: dict[tuple[str, int], int] = {}  # offset after the last record read
        self.ends: dict[tuple[str, int], int] = {}  # high watermarks when the reader began (``ends`` only)
        parts = []
        try:
            for physical, logical in self._logical.items():
                for p in self._partitions(physical, run):
                    if only and (logical, p) not in (offsets or {}):
                        continue
                    start = (offsets or {}).get((logical, p), OFFSET_BEGINNING)
                    parts.append(TopicPartition(physical, p, start))
                    self.eof[(logical, p)] = False
                    self.next[(logical, p)] = -1
                    if ends:
                        self.ends[(logical, p)] = self._high_watermark(TopicPartition(physical, p))
            self._consumer.assign(parts)
        except BaseException:
            self._consumer.close()
            raise

    def _partitions(self, physical: str, run: str) -> list[int]:
        """The topic's partitions, asked again while the broker does not know it (a topic just created, whose
        metadata has not reached every broker of a cluster yet); ``UnknownTopic`` past ``UNKNOWN_TOPIC_WAIT_S``.
        A reader assigned no partition would read a missing topic as an empty one: a misspelt run would look like a
        run with nothing in it, and a follower would wait for ever."""
        deadline = time.monotonic() + UNKNOWN_TOPIC_WAIT_S
        while True:
            meta = self._consumer.list_topics(physical, timeout=30).topics.get(physical)
            if meta is not None and meta.partitions:
                return sorted(meta.partitions)
            if time.monotonic() > deadline:
                raise UnknownTopic(f"topic {physical} (of run {run!r}) does not exist on the broker: check the run's "
                                   f"name (--run), or create its topics with `rlstream topics --run {run}`")
            time.sleep(0.2)

    def _high_watermark(self, tp: TopicPartition, timeout: float = 30.0) -> int:
        """The partition's high watermark, asked again while its leader is not known yet (a topic just created)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._consumer.get_watermark_offsets(tp, timeout=timeout)[1]
            except KafkaException:  # e.g. NOT_LEADER_FOR_PARTITION, which librdkafka does not mark retriable here
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def poll(self, timeout: float) -> list[Seen]:
        """What arrived within ``timeout``: wakes on the first record, then takes what is already fetched."""
        # consume(BATCH, timeout) would sit out the whole timeout whenever fewer than BATCH records wait, and a
        # follower (a rollout watching for new policy versions) would see each record that much later.
        msgs = self._consumer.consume(1, timeout)
        if msgs:
            msgs += self._consumer.consume(BATCH - 1, 0)
        out = []
        for m in msgs:
            logical = self._logical[m.topic()]
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    self.eof[(logical, m.partition())] = True
                else:
                    log.warning("tail %s: %s", self.name, err)
                continue
            self.eof[(logical, m.partition())] = False
            self.next[(logical, m.partition())] = m.offset() + 1
            try:
                kind = TOPICS[logical].record
                record = RECORD_TYPES[kind].from_dict(self._codec.decode(m.value(), expect=kind)[1])
            except Exception:  # any value that is not the topic's record: record=None, the reader goes on
                record = None
            out.append(Seen(logical, m.partition(), m.offset(), m.key(), hdr.as_dict(m.headers()), record,
                            m.timestamp()[1], time.monotonic()))
        return out

    def at_end(self) -> bool:
        """Every partition has reached its end (its last stable offset) since its last record."""
        return all(self.eof.values())

    def read_past_ends(self) -> bool:
        """Every partition is at its end, or read past the high watermark it had when the reader began."""
        return all(done or self.next[tp] >= self.ends[tp] for tp, done in self.eof.items())

    def behind(self) -> list[str]:
        """The partitions not at their end, as ``topic[partition]``."""
        return [f"{t}[{p}]" for (t, p), done in self.eof.items() if not done]

    def close(self) -> None:
        """Close the consumer (it committed nothing, so nothing is lost)."""
        self._consumer.close()


class TopicTail:
    """Follows the given topics of a run (all of them by default) in a background thread.

    ``keep``: keep every record read (``snapshot``, ``count``); a long-lived follower passes False and only
    ``on_record``, which is called in the tail's thread for every record (each partition's in offset order).
    """

    def __init__(self, client_config: dict, run: str, topics: list[str] | None = None, *, name: str = "tail",
                 offsets: dict[tuple[str, int], int] | None = None, keep: bool = True,
                 on_record: Callable[[Seen], None] | None = None):
        self.run = run
        self.topics = list(topics or TOPICS)
        self.records: dict[str, list[Seen]] = {t: [] for t in self.topics}
        self.lock = threading.Lock()
        self.last_record_at = time.monotonic()
        self._keep, self._on_record = keep, on_record
        self._reader = _Reader(client_config, run, self.topics, name, offsets)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tail-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """Read until closed: keep and/or hand over each batch, note when the last record came."""
        while not self._stop.is_set():
            batch = self._reader.poll(0.2)
            if not batch:
                continue
            if self._keep:
                with self.lock:
                    for s in batch:
                        self.records[s.topic].append(s)
            if self._on_record is not None:
                for s in batch:
                    try:
                        self._on_record(s)
                    except Exception:  # one failing callback must not end the tail (a watcher would go deaf)
                        log.exception("tail %s: on_record failed at %s[%d]@%d", self._reader.name, s.topic,
                                      s.partition, s.offset)
            self.last_record_at = time.monotonic()

    def snapshot(self, topic: str) -> list[Seen]:
        """Every record of ``topic`` read so far (``keep`` only)."""
        with self.lock:
            return list(self.records[topic])

    def count(self, topic: str) -> int:
        """How many records of ``topic`` were read so far (``keep`` only)."""
        with self.lock:
            return len(self.records[topic])

    def assigned(self) -> set[tuple[str, int]]:
        """The (topic, partition) pairs this tail reads: those the broker's metadata named when it began (a topic
        just created on a cluster of several brokers may not be known yet to the one that answered)."""
        return set(self._reader.eof)

    def caught_up(self) -> bool:
        """Every partition has reached its end (its last stable offset) since its last record."""
        return self._reader.at_end()

    def settle(self, quiet_s: float = 2.0, timeout: float = 120.0) -> None:
        """Wait until every partition is at its end and nothing new arrived for ``quiet_s``; TimeoutError if not."""
        deadline = time.monotonic() + timeout
        while not (self.caught_up() and time.monotonic() - self.last_record_at > quiet_s):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s reading to the end of "
                                   f"{', '.join(self._reader.behind()) or 'the topics'}")
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the thread and close the consumer."""
        self._stop.set()
        self._thread.join(10)
        self._reader.close()


def read_to_end(client_config: dict, run: str, topic: str, *, expect: int = 0, timeout: float = 60.0,
                offsets: dict[tuple[str, int], int] | None = None, name: str = "read") -> list[Seen]:
    """Every committed record of logical ``topic`` in ``run``, decoded, up to each partition's end as of the call.

    ``expect``: go on until at least this many were read (records a running stage has yet to commit).
    TimeoutError when that is not reached within ``timeout`` seconds.
    """
    reader = _Reader(client_config, run, [topic], name, offsets, ends=True)
    out: list[Seen] = []
    deadline = time.monotonic() + timeout
    try:
        while not (reader.read_past_ends() and len(out) >= expect):
            if time.monotonic() > deadline:
                done = reader.read_past_ends()
                raise TimeoutError(f"{run}.{topic}: {len(out)} records read in {timeout:.0f}s"
                                   + (f", {expect} expected" if expect else "")
                                   + ("" if done else f"; not at the end of {', '.join(reader.behind())}"))
            out += reader.poll(0.2)
    finally:
        reader.close()
    return out


def read_from(client_config: dict, run: str, topic: str, partition: int, offset: int, *, timeout: float = 60.0,
              name: str = "read-from") -> Iterator[Seen]:
    """The committed records of ``topic[partition]`` from ``offset`` on, as they are read, up to the partition's end
    as of the call; the caller may stop early. A first record past ``offset`` means the log no longer starts
    there (retention deleted it; the consumer falls back to the earliest offset). TimeoutError when the end is not
    reached within ``timeout`` seconds."""
    reader = _Reader(client_config, run, [topic], name, {(topic, partition): offset}, ends=True, only=True)
    deadline = time.monotonic() + timeout
    try:
        while not reader.read_past_ends():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{run}.{topic}[{partition}]: not read from offset {offset} to its end in "
                                   f"{timeout:.0f}s")
            yield from reader.poll(0.2)
    finally:
        reader.close()
