"""Typed records on the wire: a consumed message becomes an ``Incoming`` (headers checked, value decoded into its
record type), and a record becomes a value and headers to produce. Every process decodes and encodes here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from rlstream.config import KafkaSettings
from rlstream.kafka.topics import TOPICS, logical_name, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import DecodeError, default_codec
from rlstream.schemas.records import RECORD_TYPES, Record

__all__ = ["Consumed", "Decoder", "Incoming", "Message", "Rejected", "TypedProducer", "check_headers", "decode", "encode",
           "produce", "produce_located", "produce_placed"]


class Rejected(Exception):
    """A record that goes to dead-letters with a reason (``bad_header``, a decode reason, ``invalid``, ...)."""

    def __init__(self, reason: str, error: str):
        super().__init__(error)
        self.reason = reason


@dataclass
class Incoming:
    """One decoded input record with where it came from and its headers."""

    topic: str  # logical name
    partition: int
    offset: int
    key: bytes | None
    headers: dict[str, bytes]
    policy_version: int
    record: Record
    # The single-object value the record was decoded from (None where it was not: the archive's replays): what a
    # stage that carries the record on unchanged writes instead of encoding it again (schemas.splice).
    wire: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def traceparent(self) -> bytes | None:
        return self.headers.get(hdr.TRACEPARENT)

    @property
    def reward_version(self) -> str | None:
        raw = self.headers.get(hdr.REWARD_VERSION)
        return raw.decode() if raw is not None else None


def produce_waiting(producer: Producer, topic: str, value: bytes | None, key: Any = None,
                    headers: list | None = None, on_delivery: Any = None, partition: int | None = None) -> None:
    """Produce, waiting for deliveries while librdkafka's local queue is full (its BufferError is backpressure).

    ``on_delivery(err, msg)``: called from a later poll or flush with the record's partition and offset (a
    transactional producer learns them before the commit, so one record can name another's place). ``partition``:
    that one, not the key's."""
    extra = {"on_delivery": on_delivery} if on_delivery is not None else {}
    if partition is not None:
        extra["partition"] = partition
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=headers, **extra)
            return
        except BufferError:
            producer.poll(0.05)


def check_headers(raw_headers, *, require_policy_version: bool = True) -> tuple[dict[str, bytes], int]:
    """A record's headers as a dict and its policy version; Rejected (``bad_header``) when they are not usable.

    Checked before the value is decoded: consumers filter on headers without decoding, so a bad header must never
    pass as a version.
    """
    headers = hdr.as_dict(raw_headers)
    try:
        version = hdr.policy_version(headers)
    except hdr.HeaderError as exc:
        if require_policy_version or hdr.POLICY_VERSION in headers:
            raise Rejected("bad_header", str(exc)) from None
        version = -1  # a source outside the loop (a user's prompts) has no version yet
    reward_version = headers.get(hdr.REWARD_VERSION)
    if reward_version is not None:
        try:
            reward_version.decode("utf-8")
        except UnicodeDecodeError:
            # Checked here: outputs copy it, and a decode error there would crash the stage on every retry.
            raise Rejected("bad_header", f"reward_version header is not UTF-8: {reward_version[:32]!r}") from None
    return headers, version


def decode(m: Message, logical: str, *, require_policy_version: bool = True) -> Incoming:
    """The typed record of a consumed message of the logical topic ``logical``; Rejected with the dead-letter
    reason if it is not one."""
    headers, version = check_headers(m.headers(), require_policy_version=require_policy_version)
    try:
        name, value = default_codec().decode(m.value(), expect=TOPICS[logical].record)
        record = RECORD_TYPES[name].from_dict(value)
    except DecodeError as exc:
        raise Rejected(exc.reason, str(exc)) from None
    return Incoming(logical, m.partition(), m.offset(), m.key(), headers, version, record)


class Consumed:
    """One record a source hands the runner: where it sits on its log, its decoded input (``item``) or why it has
    none (``rejected``), and its original key, value and headers for a dead letter.

    Positions read like a confluent Message's (``topic()``, ``partition()``, ``offset()``: the physical topic), so
    the offset window and the dead letters take either. ``value`` may be a callable that builds the bytes on
    demand: a source whose records are already decoded (the archive) encodes one only for a dead letter.
    """

    __slots__ = ("_topic", "_partition", "_offset", "_key", "_headers", "_value", "item", "rejected")

    def __init__(self, topic: str, partition: int, offset: int, key: bytes | None, headers: Any, value: Any,
                 item: Incoming | None = None, rejected: Rejected | None = None):
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._headers, self._value = key, headers, value
        self.item, self.rejected = item, rejected

    def topic(self) -> str: return self._topic
    def partition(self) -> int: return self._partition
    def offset(self) -> int: return self._offset
    def key(self) -> bytes | None: return self._key
    def headers(self) -> Any: return self._headers

    def value(self) -> bytes | None:
        if callable(self._value):
            self._value = self._value()
        return self._value


class Decoder:
    """Turns one poll's messages into ``Consumed`` records with the batch codec: headers checked first, every value
    of the poll decoded in one call, each failure kept as that record's dead-letter reason."""

    def __init__(self, run: str, *, require_policy_version: bool = True, token_views: bool = False):
        self.run = run
        self.require_policy_version = require_policy_version
        self.token_views = token_views  # token arrays as read-only views over their bytes (Stage.token_views)
        self._logical: dict[str, str] = {}  # physical topic -> logical name

    def logical(self, physical: str) -> str:
        name = self._logical.get(physical)
        if name is None:
            name = self._logical[physical] = logical_name(self.run, physical)
        return name

    def decode(self, msgs: list[Message]) -> list[Consumed]:
        out: list[Consumed] = []
        by_topic: dict[str, list[tuple[Consumed, dict, int]]] = {}
        for m in msgs:
            c = Consumed(m.topic(), m.partition(), m.offset(), m.key(), m.headers(), m.value())
            out.append(c)
            try:
                headers, version = check_headers(c.headers(), require_policy_version=self.require_policy_version)
            except Rejected as rej:
                c.rejected = rej
                continue
            by_topic.setdefault(c.topic(), []).append((c, headers, version))
        codec = default_codec()
        for physical, group in by_topic.items():
            logical = self.logical(physical)
            record_name = TOPICS[logical].record
            cls = RECORD_TYPES[record_name]
            for (c, headers, version), decoded in zip(group, codec.decode_many([c.value() for c, _, _ in group],
                                                                               expect=record_name,
                                                                               views=self.token_views)):
                if isinstance(decoded, DecodeError):
                    c.rejected = Rejected(decoded.reason, str(decoded))
                    continue
                c.item = Incoming(logical, c.partition(), c.offset(), c.key(), headers, version,
                                  cls.from_dict(decoded[1]), c.value())
        return out


def encode(logical: str, record: Record) -> bytes:
    """The wire value of a record for a logical topic (its schema is the topic's record type)."""
    return default_codec().encode(TOPICS[logical].record, record.to_dict())


def produce(producer: Any, run: str, logical: str, key: Any, record: Record, policy_version: int,
            traceparent: str | None = None, reward_version: str | None = None, on_delivery: Any = None,
            partition: int | None = None) -> None:
    """Produce a typed record with the loop's headers, through a plain Producer or a TransactionalProducer
    (``on_delivery``, ``partition``: see ``produce_waiting``)."""
    headers = hdr.build(policy_version, traceparent or hdr.new_traceparent(), reward_version)
    extra = {"on_delivery": on_delivery} if on_delivery is not None else {}
    if partition is not None:
        extra["partition"] = partition
    producer.produce(topic_name(run, logical), value=encode(logical, record), key=key, headers=headers, **extra)


def produce_located(producer: Any, run: str, logical: str, key: Any, items: list[Record], policy_version: int,
                    timeout: float = 300.0, partition: int | None = None) -> tuple[int, int]:
    """Produce ``items`` in order under one key and flush; return (partition, offset) of the first.

    Every item must be delivered within ``timeout``: a delivery error, or one still undelivered, raises
    KafkaException (inside a transaction it aborts it), so a caller never names a place that is not on the log.
    """
    first: dict[str, tuple[int, int]] = {}
    errors: list = []

    def report(err, msg):
        if err is not None:
            errors.append(err)
        else:
            first["at"] = (msg.partition(), msg.offset())

    for i, record in enumerate(items):
        # One key, one partition: the items stay in order after the first, so its place locates them all.
        produce(producer, run, logical, key, record, policy_version, on_delivery=report if i == 0 else None,
                partition=partition)
    left = producer.flush(timeout)
    if errors or left or "at" not in first:
        raise KafkaException(errors[0] if errors else KafkaError(
            KafkaError._TIMED_OUT, f"{logical}: {left} of {len(items)} records undelivered", txn_requires_abort=True))
    return first["at"]


def produce_placed(producer: Any, run: str, logical: str, items: Iterable[tuple[Any, Record, int | None]],
                   policy_version: int, timeout: float) -> list[tuple[int, int]]:
    """Produce each (key, record, partition or None) of ``items`` (taken as they come: the caller may prepare the next
    while the ones before are sent) and flush; return each one's (partition, offset), in order. A delivery error,
    or a record still undelivered after ``timeout`` seconds, raises KafkaException."""
    places: list = []
    errors: list = []

    def delivered(i: int):
        def report(err, msg):
            if err is not None:
                errors.append(err)
            else:
                places[i] = (msg.partition(), msg.offset())
        return report

    for i, (key, record, partition) in enumerate(items):
        places.append(None)
        produce(producer, run, logical, key, record, policy_version, on_delivery=delivered(i), partition=partition)
    flusher = getattr(producer, "producer", producer)  # a TypedProducer's flush raises on its own; its producer's not
    left = flusher.flush(timeout)
    if errors or left or None in places:
        raise KafkaException(errors[0] if errors else KafkaError(
            KafkaError._TIMED_OUT, f"{logical}: {left} of {len(places)} records undelivered within {timeout:.0f}s",
            txn_requires_abort=True))
    return places


class TypedProducer:
    """An idempotent producer of typed records for writers outside the loop's transactions (tools, tests)."""

    def __init__(self, kafka: KafkaSettings, **overrides: Any):
        self.run = kafka.run
        self.producer = Producer({**kafka.client_config(), "linger.ms": 20, "enable.idempotence": True, **overrides})

    def produce(self, topic: str, value: bytes | None, key: Any = None, headers: list | None = None,
                on_delivery: Any = None, partition: int | None = None) -> None:
        """Produce raw bytes."""
        produce_waiting(self.producer, topic, value, key, headers, on_delivery, partition)

    def send(self, logical: str, key: Any, record: Record, policy_version: int, traceparent: str | None = None,
             reward_version: str | None = None) -> None:
        """Produce a typed record with the loop's headers."""
        produce(self, self.run, logical, key, record, policy_version, traceparent, reward_version)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every record is delivered; raise if some are not within ``timeout``."""
        left = self.producer.flush(timeout)
        if left > 0:
            raise RuntimeError(f"{left} records not delivered to Kafka within {timeout:.0f} s")
