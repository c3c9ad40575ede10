"""The exactly-once stage runtime every stage process runs on.

A stage only decodes nothing and produces nothing itself: it gets typed input
records and returns typed outputs. This module owns the Kafka plumbing once:
transactions that commit input offsets with the outputs, dead letters,
timeouts, pause/resume, SIGTERM and metrics.
"""
from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from rlstream.config import KafkaSettings, knob
from rlstream.kafka.topics import MAX_MESSAGE_BYTES, TOPICS, logical_name, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import DecodeError, default_codec
from rlstream.schemas.records import RECORD_TYPES, DeadLetter, Record
from rlstream.monitoring import metrics
from rlstream.kafka.group import GroupMember
from rlstream.kafka.inflight import OffsetWindow, Slot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeSettings:
    """Knobs of the shared stage runtime."""

    batch_size: int = knob(256, "Most records consumed and committed in one transaction")
    poll_timeout_s: float = knob(0.2, "How long one poll waits for records")
    handler_timeout_s: float = knob(30.0, "A record whose handler runs longer goes to dead-letters")
    concurrency: int = knob(64, "Records handled at once (threads for sync handlers)")
    instance: str = knob("", "Stable worker id: a restarted worker with the same id fences its zombie and takes "
                             "its partitions back at once (default: a random id, whose open transaction the broker "
                             "aborts on timeout and whose partitions move after the session timeout)")
    session_timeout_ms: int = knob(10000, "Consumer-group session: how long a dead worker without a stable "
                                          "--instance holds its partitions")
    transaction_timeout_ms: int = knob(30000, "Broker-side timeout of an open transaction")
    metrics_port: int = knob(0, "Prometheus /metrics port (0 picks a free port)")
    metrics_addr: str = knob("127.0.0.1", "Address /metrics listens on (0.0.0.0 in containers, for Prometheus)")
    max_record_bytes: int = knob(MAX_MESSAGE_BYTES, "Outputs larger than this are dead-lettered as oversized")
    pipeline: bool = knob(True, "Per-record stages keep records in flight across polls and commit each as it "
                                "finishes, in any order (no record waits for a slower one); --no-pipeline "
                                "handles and commits one batch at a time")
    commit_interval_s: float = knob(0.1, "Pipelined stages: longest a finished record waits for its transaction")
    max_in_flight: int = knob(1024, "Pipelined stages: most records consumed and not yet committed past (at least "
                                    "--concurrency, at most ~8000: the done-ahead map must fit the offset "
                                    "metadata); bounds memory, while --concurrency bounds running handlers")


class InvalidRecord(ValueError):
    """Raised by a stage's handler for input that decodes but is not acceptable (dead-letter reason ``invalid``)."""


@dataclass
class Incoming:
    """One decoded input record, as a stage handler sees it."""

    topic: str  # logical name
    partition: int
    offset: int
    key: bytes | None
    headers: dict[str, bytes]
    policy_version: int
    record: Record

    @property
    def traceparent(self) -> bytes | None:
        return self.headers.get(hdr.TRACEPARENT)

    @property
    def reward_version(self) -> str | None:
        raw = self.headers.get(hdr.REWARD_VERSION)
        return raw.decode() if raw is not None else None


@dataclass
class Output:
    """A record a handler wants produced; headers default to the input's."""

    topic: str  # logical name
    key: str | bytes | None
    record: Record
    policy_version: int | None = None
    reward_version: str | None = None


class Stage:
    """A stream processor: override ``handle`` (per record) or ``handle_batch``.

    ``handle`` may be sync (run in a thread) or ``async``; both get a timeout.
    """

    name: str = "stage"
    inputs: tuple[str, ...] = ()
    #: Whether records without a policy_version header are accepted (sources outside the loop).
    require_policy_version: bool = True

    def handle(self, item: Incoming) -> list[Output]:
        raise NotImplementedError

    def handle_batch(self, items: list[Incoming]) -> list[list[Output]] | None:
        """Handle a whole batch at once (e.g. batched generation); None means per record."""
        return None

    def before_poll(self, ctx: "StageContext") -> None:
        """Called between batches, outside any transaction: reload weights, pause, resume."""

    def close(self) -> None:
        """Release what the stage holds (engines, pools)."""


class StageContext:
    """What a stage may do to its own consumption: pause and resume partitions."""

    def __init__(self, runner: "StageRunner"):
        self._runner = runner

    def pause(self, logical_topic: str) -> None:
        """Stop fetching a topic (backpressure); records wait in Kafka."""
        self._runner.set_paused(logical_topic, True)

    def resume(self, logical_topic: str) -> None:
        self._runner.set_paused(logical_topic, False)

    def is_paused(self, logical_topic: str) -> bool:
        return logical_topic in self._runner.paused_topics

    @property
    def kafka(self) -> KafkaSettings:
        """The process's Kafka settings, for stages that open clients of their own (policy watchers)."""
        return self._runner.kafka


class Wedged(Exception):
    """A librdkafka call that did not return long after its own timeout."""


class _Rejected(Exception):
    """A record that goes to dead-letters with a reason."""

    def __init__(self, reason: str, error: str):
        super().__init__(error)
        self.reason = reason


class StageRunner:
    """Consumes, handles and produces one batch per Kafka transaction."""

    def __init__(self, stage: Stage, kafka: KafkaSettings, settings: RuntimeSettings = RuntimeSettings()):
        self.stage = stage
        self.kafka = kafka
        self.settings = settings
        self.codec = default_codec()
        self.paused_topics: set[str] = set()
        self._stopping = False
        self._closing = False
        instance = settings.instance or uuid.uuid4().hex[:12]  # transactional id; static membership needs a set one
        base = kafka.client_config()
        self.group_id = f"{kafka.run}.{stage.name}"
        topics = [topic_name(kafka.run, t) for t in stage.inputs]
        # Joins the group in run(), once the producer is ready; replay uses the consumer before that.
        self._member = GroupMember(kafka, self.group_id, topics, instance=settings.instance,
                                   session_timeout_ms=settings.session_timeout_ms, on_assign=self._on_assign,
                                   on_revoke=self._on_revoke, on_lost=self._on_revoke, who=stage.name)
        self._producer_config = {
            **base,
            "transactional.id": f"{self.group_id}.{instance}",
            "transaction.timeout.ms": settings.transaction_timeout_ms,
            "message.max.bytes": MAX_MESSAGE_BYTES + 65536,
            "linger.ms": 5,
            "compression.type": "lz4",
        }
        self.producer = Producer(self._producer_config)
        self._wedged: list[Producer] = []  # producers stuck in a call, kept so that no destructor waits on them
        self._replaced = 0  # producers replaced since the last commit
        self._pool = ThreadPoolExecutor(max_workers=max(1, settings.concurrency),
                                        thread_name_prefix=f"{stage.name}-handler")
        self._loop = asyncio.new_event_loop()
        # asyncio.to_thread (sync reward functions) uses the default executor: make it ours, sized by concurrency.
        self._loop.set_default_executor(self._pool)
        self.ctx = StageContext(self)
        self._assigned: list[TopicPartition] = []
        # Consumed records not yet committed past, and what each partition's committed offset metadata says.
        self._window = OffsetWindow()
        self._lag = metrics.LagProbe(stage.name, kafka.run)  # consumer lag gauge, refreshed every few seconds

    # -- lifecycle -----------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        """Finish (commit or abort) the open transaction, then exit the loop."""
        self._stopping = True

    def run(self, max_batches: int | None = None, idle_exit_s: float | None = None) -> None:
        """Run until SIGTERM/SIGINT (or the limits, for tests and benchmarks)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        init_transactions(self.producer, self.stage.name, stopping=lambda: self._stopping)
        topics = self._member.subscribe().topics
        pipelined = self.settings.pipeline and type(self.stage).handle_batch is Stage.handle_batch
        log.info("%s consuming %s as group %s (%s)", self.stage.name, topics, self.group_id,
                 "pipelined" if pipelined else "one batch per transaction")
        try:
            if pipelined:
                self._run_pipelined(max_batches, idle_exit_s)
            else:
                self._run_batches(max_batches, idle_exit_s)
        finally:
            self.close()

    def _run_batches(self, max_batches: int | None, idle_exit_s: float | None) -> None:
        batches, idle_since = 0, time.monotonic()
        while not self._stopping:
            self.stage.before_poll(self.ctx)
            msgs = self._member.consume(self.settings.batch_size, self.settings.poll_timeout_s)
            self._lag.maybe_update(self.consumer, self._assigned)
            if not msgs:
                if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
                continue
            idle_since = time.monotonic()
            self._process_batch(msgs)
            batches += 1
            if max_batches is not None and batches >= max_batches:
                break

    def _run_pipelined(self, max_batches: int | None, idle_exit_s: float | None) -> None:
        """Keep up to ``max_in_flight`` records in flight across polls; commit finished ones in any order."""
        worker = threading.Thread(target=self._loop.run_forever, name=f"{self.stage.name}-loop", daemon=True)
        worker.start()
        commits, idle_since, ready_since = 0, time.monotonic(), None
        window = self._window
        limit = max(1, self.settings.concurrency, self.settings.max_in_flight)
        self._running = asyncio.Semaphore(max(1, self.settings.concurrency))
        try:
            while not self._stopping:
                self.stage.before_poll(self.ctx)
                busy = window.size > 0
                room = limit - window.size
                msgs = self._member.consume(min(room, self.settings.batch_size),
                                            0 if busy else self.settings.poll_timeout_s) if room > 0 else []
                self._lag.maybe_update(self.consumer, self._assigned)
                now, now_ms = time.monotonic(), hdr.now_ms()
                for m in msgs:
                    self._admit(m, now, now_ms)
                if msgs or busy:
                    idle_since = now
                elif idle_exit_s is not None and now - idle_since > idle_exit_s:
                    break
                running = window.unfinished()
                if running and not msgs:
                    # Nothing new arrived: sleep until a handler finishes, looking for new records now and then.
                    wait(running, timeout=0.05 if room > 0 else self.settings.poll_timeout_s,
                         return_when=FIRST_COMPLETED)
                ready = window.count_ready()
                if not ready:
                    ready_since = None
                    continue
                ready_since = ready_since or time.monotonic()
                # Commit when a batch is full, when the oldest finished record has waited long enough, or when
                # nothing runs and nothing came: a fast handler must not get a transaction per record.
                if (ready >= self.settings.batch_size
                        or time.monotonic() - ready_since >= self.settings.commit_interval_s
                        or (not msgs and all(f.done() for f in running))):  # nothing admitted since `running`
                    self._commit_ready()
                    ready_since = None
                    commits += 1
                    if max_batches is not None and commits >= max_batches:
                        break
            self._drain()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            worker.join(5)

    def _drain(self) -> None:
        """On the way out, give records in flight a handler timeout to finish and commit those that did."""
        unfinished = self._window.unfinished()
        if unfinished:
            wait(unfinished, timeout=self.settings.handler_timeout_s)
        if self._window.count_ready():
            self._commit_ready()

    def _admit(self, m: Message, now: float, now_ms: int) -> None:
        logical = logical_name(self.kafka.run, m.topic())
        slot = self._window.add(Slot(m, admitted_at=now))
        if slot.emitted:
            return  # handled before a crash or rebalance; the committed offset metadata says so
        metrics.RECORDS_IN.labels(self.stage.name, logical).inc()
        try:
            slot.item = self._decode(m, logical, now_ms)
        except _Rejected as rej:
            slot.resolve(rej)
        else:
            slot.future = asyncio.run_coroutine_threadsafe(self._handle_when_free(slot.item), self._loop)

    def _commit_ready(self) -> None:
        ready = self._window.ready()
        started = min(s.admitted_at for s in ready)
        self.producer.begin_transaction()
        try:
            for slot in ready:
                self._emit(slot.msg, slot.item, slot.outcome())
            # Do not advance committed offsets outside of the transaction. Each partition commits the offset of
            # its first unfinished record, and lists the finished ones after it in the offset's metadata: all
            # of their outputs are in this transaction or an earlier one.
            points = self._window.commit_points()
            bounded(self.producer.send_offsets_to_transaction,
                    [TopicPartition(t, p, base, metadata=meta) for (t, p), (base, meta) in points.items()],
                    self.consumer.consumer_group_metadata(), 30)
            bounded(self.producer.commit_transaction, 60)
        except KafkaException as exc:
            self._recover(exc, self._rewind_window())
            return
        except Wedged as exc:
            self._replace_producer(exc, self._rewind_window())
            return
        except BaseException:
            self._abort_and_rewind(self._rewind_window())
            raise
        self._window.mark_committed(points)
        self._replaced = 0
        metrics.TRANSACTIONS.labels(self.stage.name, "committed").inc()
        metrics.BATCH_SECONDS.labels(self.stage.name).observe(time.monotonic() - started)

    def _rewind_window(self) -> dict[tuple[str, int], int]:
        """An aborted transaction: every record since the last commit is read again (its outputs are gone)."""
        dropped, rewind_to = self._window.rewind()
        for slot in dropped:
            if slot.future is not None:
                slot.future.cancel()
        return rewind_to

    def close(self) -> None:
        self._closing = True  # a close may still deliver an assignment; it needs no committed offsets then
        self.stage.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self._member.close()
        finally:
            self._loop.close()

    @property
    def consumer(self) -> Consumer:
        """The group member's current consumer (a new object after it was replaced)."""
        return self._member.consumer

    def set_paused(self, logical_topic: str, paused: bool) -> None:
        physical = topic_name(self.kafka.run, logical_topic)
        parts = [tp for tp in self._assigned if tp.topic == physical]
        if paused and logical_topic not in self.paused_topics:
            self.paused_topics.add(logical_topic)
            if parts:
                self.consumer.pause(parts)
        elif not paused and logical_topic in self.paused_topics:
            self.paused_topics.discard(logical_topic)
            if parts:
                self.consumer.resume(parts)
        metrics.PAUSED.labels(self.stage.name).set(
            sum(1 for tp in self._assigned if logical_name(self.kafka.run, tp.topic) in self.paused_topics))

    def _on_assign(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        self._assigned = list(parts)
        if self._closing:
            return
        self._load_committed(consumer, parts)
        # A rebalance resumes everything; re-apply the stage's backpressure.
        paused = [tp for tp in parts if logical_name(self.kafka.run, tp.topic) in self.paused_topics]
        if paused:
            consumer.pause(paused)

    def _load_committed(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        """Learn which records past each committed offset a pipelined worker already finished (its metadata)."""
        if not parts:
            return
        for tp in consumer.committed(parts, timeout=30):
            if tp.offset >= 0:
                self._window.set_committed((tp.topic, tp.partition), tp.offset, tp.metadata)

    def _on_revoke(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        # No transaction is open here: revocation only happens inside consume(). Records in flight or held for
        # these partitions are uncommitted; their next owner reads them again, so they are dropped, not produced.
        self._assigned = [tp for tp in self._assigned if tp not in parts]
        gone = {(tp.topic, tp.partition) for tp in parts}
        for slot in self._window.drop(gone):
            if slot.future is not None:
                slot.future.cancel()

    # -- one transaction -----------------------------------------------------------

    def _process_batch(self, msgs: list[Message]) -> None:
        started = time.monotonic()
        self.producer.begin_transaction()
        try:
            self._handle_and_produce(msgs)
            # Do not advance committed offsets outside of the transaction: the
            # outputs and the input positions become visible together or not at all.
            offsets = [TopicPartition(tp.topic, tp.partition, tp.offset,
                                      metadata=self._window.remaining_done((tp.topic, tp.partition), tp.offset))
                       for tp in _next_offsets(msgs)]
            bounded(self.producer.send_offsets_to_transaction, offsets, self.consumer.consumer_group_metadata(), 30)
            bounded(self.producer.commit_transaction, 60)
        except KafkaException as exc:
            self._recover(exc, _first_offsets(msgs))
            return
        except Wedged as exc:
            self._replace_producer(exc, _first_offsets(msgs))
            return
        except BaseException:
            # Anything else (including a crash in the stage) aborts: the batch is redone.
            self._abort_and_rewind(_first_offsets(msgs))
            raise
        self._replaced = 0
        metrics.TRANSACTIONS.labels(self.stage.name, "committed").inc()
        metrics.BATCH_SECONDS.labels(self.stage.name).observe(time.monotonic() - started)

    def _replace_producer(self, exc: Exception, rewind_to: dict[tuple[str, int], int]) -> None:
        """Fence a stuck or broken producer with a new one of the same transactional id, then redo the batch."""
        log.error("%s: %s; replacing the producer (the new one aborts the open transaction)", self.stage.name, exc)
        metrics.TRANSACTIONS.labels(self.stage.name, "aborted").inc()
        self._replaced += 1
        if self._replaced > 5:  # no commit since several replacements: not a passing fault; exit
            raise exc
        self._wedged.append(self.producer)
        self.producer = Producer(self._producer_config)
        init_transactions(self.producer, self.stage.name, stopping=lambda: self._stopping)
        self._rewind(rewind_to)

    def _recover(self, exc: KafkaException, rewind_to: dict[tuple[str, int], int]) -> None:
        err = exc.args[0]
        if err.txn_requires_abort() or err.retriable():
            log.warning("%s transaction failed (%s); aborting and redoing the batch", self.stage.name, err)
            self._abort_and_rewind(rewind_to)
            return
        if err.fatal() and err.code() not in _FENCED:
            self._replace_producer(exc, rewind_to)
            return
        # Fenced by a newer instance with our transactional.id: we are the zombie; exit.
        metrics.TRANSACTIONS.labels(self.stage.name, "fatal").inc()
        raise exc

    def _abort_and_rewind(self, rewind_to: dict[tuple[str, int], int]) -> None:
        metrics.TRANSACTIONS.labels(self.stage.name, "aborted").inc()
        deadline = time.monotonic() + 600
        while True:
            try:
                bounded(self.producer.abort_transaction, 30)
                break
            except Wedged as exc:
                self._replace_producer(exc, rewind_to)  # the new producer's fencing aborts the transaction
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal() and err.code() not in _FENCED and not self._stopping:
                    # E.g. INVALID_TXN_STATE after a broker restart aborted the transaction on its own.
                    self._replace_producer(exc, rewind_to)
                    return
                # An abort times out while the broker is down or restarting: wait for it rather than exit.
                if err.fatal() or not err.retriable() or self._stopping or time.monotonic() > deadline:
                    log.error("%s abort failed: %s", self.stage.name, exc)
                    raise
                log.warning("%s abort not done yet (%s); retrying", self.stage.name, err.str())
        self._rewind(rewind_to)

    def _rewind(self, rewind_to: dict[tuple[str, int], int]) -> None:
        """The aborted outputs are gone, so the inputs must be read again from these offsets."""
        for (topic, partition), offset in rewind_to.items():
            try:
                self.consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException:
                pass  # partition was revoked meanwhile; its new owner starts from the committed offset

    def _handle_and_produce(self, msgs: list[Message]) -> None:
        items: list[Incoming] = []
        sources: list[Message] = []
        now = hdr.now_ms()
        for m in msgs:
            if self._window.is_done_before((m.topic(), m.partition()), m.offset()):
                continue  # a pipelined worker finished it before this one took the partition over
            logical = logical_name(self.kafka.run, m.topic())
            metrics.RECORDS_IN.labels(self.stage.name, logical).inc()
            try:
                items.append(self._decode(m, logical, now))
                sources.append(m)
            except _Rejected as rej:
                self._dead_letter(m, rej.reason, str(rej))
        for msg, item, result in zip(sources, items, self._handle_all(items)):
            self._emit(msg, item, result)

    def _emit(self, msg: Message, item: Incoming | None, result: "list[Output] | _Rejected") -> None:
        """Produce a record's outputs, or its dead letter, into the open transaction."""
        if isinstance(result, _Rejected):
            self._dead_letter(msg, result.reason, str(result))
            return
        try:
            encoded = [self._encode(item, out) for out in result]
        except _Rejected as rej:
            self._dead_letter(msg, rej.reason, str(rej))
            return
        for out, (topic, key, value, headers) in zip(result, encoded):
            self._produce(topic, key, value, headers)
            metrics.RECORDS_OUT.labels(self.stage.name, out.topic).inc()
            metrics.count_output(self.stage.name, out.topic, out.record)

    def _decode(self, m: Message, logical: str, now: int) -> Incoming:
        headers = hdr.as_dict(m.headers())
        try:
            version = hdr.policy_version(headers)
        except hdr.HeaderError as exc:
            if self.stage.require_policy_version or hdr.POLICY_VERSION in headers:
                raise _Rejected("bad_header", str(exc)) from None
            version = -1
        reward_version = headers.get(hdr.REWARD_VERSION)
        if reward_version is not None:
            try:
                reward_version.decode("utf-8")
            except UnicodeDecodeError:
                # Checked here: outputs copy it, and a decode error there would crash the stage on every retry.
                raise _Rejected("bad_header", f"reward_version header is not UTF-8: {reward_version[:32]!r}") from None
        produced = headers.get(hdr.PRODUCED_AT)
        if produced is not None and produced.isdigit():
            metrics.QUEUE_DELAY.labels(self.stage.name).observe(max(0, now - int(produced)) / 1000)
        try:
            name, value = self.codec.decode(m.value(), expect=TOPICS[logical].record)
            record = RECORD_TYPES[name].from_dict(value)
        except DecodeError as exc:
            raise _Rejected(exc.reason, str(exc)) from None
        return Incoming(logical, m.partition(), m.offset(), m.key(), headers, version, record)

    def _encode(self, item: Incoming, out: Output) -> tuple[str, Any, bytes, list]:
        try:
            value = self.codec.encode(TOPICS[out.topic].record, out.record.to_dict())
        except Exception as exc:  # e.g. a str with lone surrogates, or a wrong type, from the handler
            # Raised past here it would abort the batch, crash the stage and do the same again on restart.
            raise _Rejected("handler_error", f"{out.topic} output does not fit its schema: "
                                             f"{type(exc).__name__}: {exc}") from None
        reward_version = out.reward_version if out.reward_version is not None else item.reward_version
        headers = hdr.build(out.policy_version if out.policy_version is not None else item.policy_version,
                            hdr.child_traceparent(item.traceparent), reward_version)
        size = wire_bytes(value, out.key, headers)
        if size > self.settings.max_record_bytes:
            raise _Rejected("oversized", f"{out.topic} record of {len(value)} bytes ({size} on the wire at worst) "
                                         f"exceeds {self.settings.max_record_bytes}")
        return topic_name(self.kafka.run, out.topic), out.key, value, headers

    def _produce(self, topic: str, key: Any, value: bytes, headers: list) -> None:
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers)
                return
            except BufferError:
                self.producer.poll(0.05)  # local queue full: let deliveries drain

    def _dead_letter(self, m: Message, reason: str, error: str) -> None:
        value, headers = dead_letter(self.stage.name, m, reason, error, self.settings.max_record_bytes)
        self._produce(topic_name(self.kafka.run, "dead-letters"), m.key(), value, headers)
        metrics.DEAD_LETTERS.labels(self.stage.name, reason).inc()
        log.warning("%s dead-lettered %s[%d]@%d: %s: %s", self.stage.name, m.topic(), m.partition(), m.offset(),
                    reason, error[:200])

    # -- handlers ------------------------------------------------------------------

    def _handle_all(self, items: list[Incoming]) -> list[list[Output] | _Rejected]:
        if not items:
            return []
        batch = self._run_timed(self._call_batch, items, len(items))
        if isinstance(batch, list):
            return batch
        if batch is not None:
            # The batch failed as a whole: handle records one by one to isolate the bad one.
            return [_first(self._run_timed(self._call_batch, [it], 1)) for it in items]
        return self._loop.run_until_complete(self._handle_each(items))

    def _call_batch(self, items: list[Incoming]):
        result = self.stage.handle_batch(items)
        if result is not None and len(result) != len(items):
            raise TypeError(f"handle_batch returned {len(result)} results for {len(items)} records")
        return result

    def _run_timed(self, fn, items: list[Incoming], n: int):
        """Run a batch handler in the pool with a timeout scaled to the batch; errors become _Rejected."""
        async def go():
            return await asyncio.wait_for(self._loop.run_in_executor(self._pool, fn, items),
                                          self.settings.handler_timeout_s * max(1, math.ceil(n / 8)))
        try:
            return self._loop.run_until_complete(go())
        except Exception as exc:
            return self._rejection(exc)

    def _rejection(self, exc: Exception) -> "_Rejected":
        """The dead-letter reason for a handler's failure."""
        if isinstance(exc, asyncio.TimeoutError):
            return _Rejected("handler_timeout", f"handler exceeded {self.settings.handler_timeout_s}s")
        if isinstance(exc, InvalidRecord):
            return _Rejected("invalid", str(exc))
        return _Rejected("handler_error", f"{type(exc).__name__}: {exc}")

    async def _handle_each(self, items: list[Incoming]) -> list[list[Output] | _Rejected]:
        sem = asyncio.Semaphore(max(1, self.settings.concurrency))

        async def one(item: Incoming):
            async with sem:
                return await self._handle_one(item)

        return list(await asyncio.gather(*(one(it) for it in items)))

    async def _handle_when_free(self, item: Incoming) -> list[Output] | _Rejected:
        # The handler timeout starts once a handler slot is free, not while the record queues for one.
        async with self._running:
            return await self._handle_one(item)

    async def _handle_one(self, item: Incoming) -> list[Output] | _Rejected:
        """One record through the stage's handler (async, or sync in the pool), with its timeout."""
        handler = self.stage.handle
        started = time.monotonic()
        try:
            if asyncio.iscoroutinefunction(handler):
                result = await asyncio.wait_for(handler(item), self.settings.handler_timeout_s)
            else:
                result = await asyncio.wait_for(self._loop.run_in_executor(self._pool, handler, item),
                                                self.settings.handler_timeout_s)
            if not isinstance(result, list) or not all(isinstance(o, Output) for o in result):
                raise TypeError(f"handler returned {type(result).__name__}, expected list[Output]")
            return result
        except Exception as exc:
            return self._rejection(exc)
        finally:
            metrics.HANDLER_SECONDS.labels(self.stage.name).observe(time.monotonic() - started)


def _first(result):
    """The outputs of a one-record batch, or its rejection."""
    return result if isinstance(result, _Rejected) else result[0]


def bounded(call, *args):
    """A transactional producer call whose last argument is its timeout, given a minute more to return.

    librdkafka can block in send_offsets_to_transaction() past its timeout once the group coordinator went
    away (a broker restart; librdkafka issues 5456 and 5511). Raises Wedged then: only a new producer of the
    same transactional id (which fences this one) gets the process going again.
    """
    done, result = threading.Event(), {}

    def run():
        try:
            result["value"] = call(*args)
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc
        finally:
            done.set()
    threading.Thread(target=run, name="txn-call", daemon=True).start()
    if not done.wait(args[-1] + 60):
        raise Wedged(f"{getattr(call, '__name__', 'call')} did not return within {args[-1] + 60}s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


#: Fatal errors that mean a newer instance with our transactional id exists: replacing the producer would
#: fence that one in turn, so the process exits instead.
_FENCED = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)

#: What a broker still starting (or moving its transaction coordinator) answers; worth waiting out.
_COORDINATOR_BUSY = (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
                     KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._TIMED_OUT, KafkaError._TRANSPORT)


def init_transactions(producer: Producer, who: str, timeout_s: float = 300.0,
                      stopping: Callable[[], bool] = lambda: False) -> None:
    """Register the transactional id (fencing any zombie), waiting while the broker is not ready yet."""
    deadline = time.monotonic() + timeout_s
    while not stopping():
        try:
            producer.init_transactions(30)
            return
        except KafkaException as exc:
            err = exc.args[0]
            # A stage started with (or during a restart of) the broker must wait for it, not exit.
            if err.fatal() or not (err.retriable() or err.code() in _COORDINATOR_BUSY) \
                    or time.monotonic() > deadline:
                raise
            log.warning("%s: broker not ready for transactions (%s); retrying", who, err.str())
            time.sleep(1.0)


def dead_letter(stage: str, m: Message, reason: str, error: str,
                max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[bytes, list]:
    """The encoded DeadLetter value and headers for an input record a stage could not use."""
    # Kafka allows null header values; the letter's map cannot hold them (and must never fail to encode).
    headers = {k: v if v is not None else b"" for k, v in hdr.as_dict(m.headers()).items()}
    letter = DeadLetter(stage=stage, reason=reason, error=error[:4000], topic=m.topic(), partition=m.partition(),
                        offset=m.offset(), failed_at=hdr.now_ms(), key=m.key(), value=m.value(), headers=headers,
                        trace_id=hdr.trace_id(headers.get(hdr.TRACEPARENT)))
    try:
        version = hdr.policy_version(headers)
    except hdr.HeaderError:
        version = -1
    out_headers = hdr.build(version, hdr.child_traceparent(headers.get(hdr.TRACEPARENT)))
    value = default_codec().encode("DeadLetter", letter.to_dict())
    if wire_bytes(value, m.key(), out_headers) > max_bytes:
        # A record near the size limit no longer fits once wrapped: the broker would refuse the letter and the
        # batch would be redone forever. Keep where the original is instead of its bytes.
        letter.value = None
        letter.error = (f"{letter.error[:3000]} [original value of {len(m.value() or b'')} bytes not kept: the "
                        f"letter would exceed {max_bytes} bytes; it is at {m.topic()}[{m.partition()}]@{m.offset()}]")
        value = default_codec().encode("DeadLetter", letter.to_dict())
    return value, out_headers


def wire_bytes(value: bytes, key: str | bytes | None, headers: list[tuple[str, bytes]]) -> int:
    """Worst-case size of a one-record batch on the broker, which checks it against max.message.bytes.

    Record and batch framing add up to ~100 bytes, and lz4 can grow incompressible data by 1/255.
    """
    key_len = len(key.encode()) if isinstance(key, str) else len(key or b"")
    raw = len(value) + key_len + sum(len(k) + len(v or b"") + 10 for k, v in headers) + 128
    return raw + raw // 255 + 64


def _first_offsets(msgs: Sequence[Message]) -> dict[tuple[str, int], int]:
    """Where a rewind of a batch starts: the first offset of each partition in it."""
    first: dict[tuple[str, int], int] = {}
    for m in msgs:
        key = (m.topic(), m.partition())
        first[key] = min(first.get(key, m.offset()), m.offset())
    return first


def _next_offsets(msgs: Sequence[Message]) -> list[TopicPartition]:
    """The offsets to commit: one past the last consumed record of each partition."""
    last: dict[tuple[str, int], int] = {}
    for m in msgs:
        key = (m.topic(), m.partition())
        last[key] = max(last.get(key, -1), m.offset())
    return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]
