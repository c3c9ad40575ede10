"""The runner every stage process runs: consume, handle, produce, commit, exactly once.

Its input is decoded records (``records.Consumed``) from a source: a Kafka source decodes each poll as one batch,
a replay from the archive hands its rows over as they are. Two ways to drive a stage, chosen by ``Stage.batched``
(per instance) and ``--pipeline``:

- one batch per transaction (batch handlers such as rollout's in-process generation, replays, ``--no-pipeline``),
  the handler called once on the batch's records;
- pipelined (per-record handlers such as env, reward and rollout on a server fleet): up to ``max_in_flight``
  records across polls, each finished one committed in the next transaction whatever the order (see
  ``rlstream.kafka.inflight``).

Either way a transaction holds the outputs, the dead letters and the input offsets together (enforced in
``_commit_ready`` and ``_process_batch``), and an aborted one re-reads its inputs.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from concurrent.futures import wait
from typing import Any, Callable, Sequence

from rlstream import metrics
from rlstream.config import KafkaSettings
from rlstream.kafka import records
from rlstream.kafka.dead_letters import wire_bytes
from rlstream.kafka.inflight import OffsetWindow, Slot
from rlstream.kafka.records import Consumed, Decoder, Incoming, Rejected
from rlstream.kafka.sources import GroupSource, InputSource, waiting
from rlstream.kafka.standby import await_vacancy, check_standby
from rlstream.kafka.topics import logical_name, topic_name
from rlstream.kafka.transactions import Offset, TransactionalProducer
from rlstream.runtime import lifecycle
from rlstream.runtime.chain import HANDLED_BY, ChainHandlers, Chained
from rlstream.runtime.handlers import Handlers
from rlstream.runtime.settings import RuntimeSettings
from rlstream.runtime.stage import Output, Stage, StageContext
from rlstream.schemas import headers as hdr

log = logging.getLogger(__name__)

#: A progress hook: called with a number of records.
Counter = Callable[[int], None]

#: Allocations between young-generation collections while a stage runs (run()).
GC_YOUNG = 10_000


class StageRunner:
    """Drives one stage over an input source, committing each transaction's outputs with its input offsets.

    ``source`` defaults to the stage's consumer group (``<run>.<stage>``) over its input topics. ``on_consumed``
    and ``on_committed`` are public hooks for benchmarks: records handed to the stage, records committed.
    """

    def __init__(self, stage: Stage, kafka: KafkaSettings, settings: RuntimeSettings = RuntimeSettings(),
                 source: InputSource | None = None, *, then: Stage | None = None,
                 on_consumed: Counter | None = None, on_committed: Counter | None = None):
        """``then``: a second stage chained after this one, in this process and its transactions
        (``runtime.chain``)."""
        self.stage = stage
        self.then = then
        self.kafka = kafka
        self.settings = settings
        self.paused_topics: set[str] = set()
        self._stopping = False
        self._closing = False
        self.group_id = f"{kafka.run}.{stage.name}"
        # Joins the group in run(), once the producer is ready; replay plans on the consumer before that.
        self.source = source or GroupSource(kafka, self.group_id, [topic_name(kafka.run, t) for t in stage.inputs],
                                            instance=settings.instance, session_timeout_ms=settings.session_timeout_ms,
                                            who=stage.name)
        # The runner's input seam: decoded records. A Kafka source decodes each poll with this (the batch codec);
        # a source with records already decoded (the archive) hands them over as they are.
        self.source.bind(self._on_assign, self._on_revoke,
                         Decoder(kafka.run, require_policy_version=stage.require_policy_version,
                                 token_views=stage.token_views))
        instance = settings.instance or uuid.uuid4().hex[:12]  # transactional id; static membership needs a set one
        self.txn = TransactionalProducer(kafka, f"{self.group_id}.{instance}", who=stage.name,
                                         transaction_timeout_ms=settings.transaction_timeout_ms,
                                         stopping=lambda: self._stopping)
        self.handlers = (ChainHandlers(stage, then, settings, kafka.run, self._encode) if then is not None
                         else Handlers(stage, settings))
        # What a chain that handed a record over in process marks it with, when this runner is that chain's second
        # stage running on its own: such records are committed past, not handled twice (runtime.chain).
        self._handled_mark = self.group_id.encode()
        self.ctx = StageContext(kafka, self.set_paused, self.paused_topics, self.backlog)
        self._assigned: list = []
        self._starts: dict[tuple[str, int], int] = {}  # where each assigned partition's reading began
        # Consumed records not yet committed past, and what each partition's committed offset metadata says.
        self._window = OffsetWindow()
        self._lag = metrics.LagProbe(stage.name, kafka.run)  # consumer lag gauge, refreshed every few seconds
        self._on_consumed = on_consumed or (lambda n: None)
        self._on_committed = on_committed or (lambda n: None)
        self._records_out: dict[tuple, Any] = {}  # (stage, logical topic) -> its RECORDS_OUT child (a labels()
        # call per record cost more than producing it)
        self._queue_delay = metrics.QUEUE_DELAY.labels(stage.name)

    @property
    def consumer(self):
        """The source's current consumer (a new object after it was replaced)."""
        return self.source.consumer

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        """Finish (commit or abort) the open transaction, then exit the loop."""
        self._stopping = True

    def run(self, max_batches: int | None = None, idle_exit_s: float | None = None) -> None:
        """Run until SIGTERM/SIGINT, the source's end, or the limits (for tests and benchmarks)."""
        forget = lifecycle.process().on_stop(self.request_stop)  # SIGTERM/SIGINT (runtime/lifecycle.py)
        if self.settings.standby and not self._stand_by():
            forget()  # stopped while standing by: it never held anything
            self.close()
            return
        self.txn.start()
        topics = self.source.start()
        pipelined = self.settings.pipeline and not self.handlers.batched
        log.info("%s consuming %s as group %s (%s)", self.stage.name, topics, self.group_id,
                 "pipelined" if pipelined else "one batch per transaction")
        # A hop makes a few dozen containers per record, nearly all freed by reference counting. At the default
        # young-generation threshold (700) the cycle collector ran every ~17 records of a reward hop: 12% of its
        # CPU one batch per transaction, 15% pipelined; at GC_YOUNG, half that. Restored when the run ends.
        gc_before = gc.get_threshold()
        gc.set_threshold(max(GC_YOUNG, gc_before[0]), *gc_before[1:])
        try:
            if pipelined:
                self._run_pipelined(max_batches, idle_exit_s)
            else:
                self._run_batches(max_batches, idle_exit_s)
        finally:
            forget()
            gc.set_threshold(*gc_before)
            self.close()

    def _stand_by(self) -> bool:
        """``--standby``: load, then wait to take this instance over (``kafka.standby``); False when stopped first."""
        check_standby(self.settings.instance, self.stage.name)
        for stage in (self.stage, self.then):
            if stage is not None:
                stage.prepare(self.ctx)
        self._line = await_vacancy(self.kafka, self.group_id, self.settings.instance, self.settings.session_timeout_ms,
                                   stopping=lambda: self._stopping, who=self.stage.name)
        return self._line is not None

    def close(self) -> None:
        self._closing = True  # a close may still deliver an assignment; it needs no committed offsets then
        self.stage.close()
        if self.then is not None:
            self.then.close()
        try:
            self.source.close()
        finally:
            self.handlers.close()

    def _run_batches(self, max_batches: int | None, idle_exit_s: float | None) -> None:
        batches, idle_since = 0, time.monotonic()
        while not self._stopping and not self.source.exhausted():
            self._before_poll()
            msgs = self.source.consume(self.settings.batch_size, self.settings.poll_timeout_s)
            self._lag.maybe_update(self.consumer, self._assigned)
            if not msgs:
                if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
                continue
            idle_since = time.monotonic()
            self._on_consumed(len(msgs))
            self._process_batch(msgs)
            batches += 1
            if max_batches is not None and batches >= max_batches:
                break

    def _run_pipelined(self, max_batches: int | None, idle_exit_s: float | None) -> None:
        """Keep up to ``max_in_flight`` records in flight across polls; commit finished ones in any order."""
        loop = self.handlers.loop
        worker = threading.Thread(target=loop.run_forever, name=f"{self.stage.name}-loop", daemon=True)
        worker.start()
        commits, idle_since, ready_since, running = 0, time.monotonic(), None, False
        window = self._window
        limit = self.in_flight_limit()
        try:
            while not self._stopping and not self.source.exhausted():
                self._before_poll()
                busy = window.size > 0
                room = limit - window.size
                msgs = self.source.consume(min(room, self.settings.batch_size),
                                           0 if busy else self.settings.poll_timeout_s) if room > 0 else []
                self._lag.maybe_update(self.consumer, self._assigned)
                now, now_ms = time.monotonic(), hdr.now_ms()
                if msgs:
                    self._on_consumed(len(msgs))
                self._observe(msgs, now_ms)
                admitted = [slot for slot in (self._admit(m, now) for m in msgs) if slot is not None]
                for slot, future in zip(admitted, self.handlers.submit([slot.item for slot in admitted])):
                    window.attach(slot, future)
                if msgs or busy:
                    idle_since = now
                elif idle_exit_s is not None and now - idle_since > idle_exit_s:
                    break
                if not msgs and running:
                    # Nothing new arrived: sleep until a handler finishes, looking for new records now and then.
                    window.wait_finished(0.05 if room > 0 else self.settings.poll_timeout_s)
                running, ready = window.progress()  # counts kept as handlers finish: no pass over the window
                if not ready:
                    ready_since = None
                    continue
                ready_since = ready_since or time.monotonic()
                # Commit when a batch is full, when the oldest finished record has waited long enough, or when
                # nothing runs and nothing came: a fast handler must not get a transaction per record.
                if (ready >= self.settings.batch_size
                        or time.monotonic() - ready_since >= self.settings.commit_interval_s
                        or (not msgs and not running)):
                    self._commit_ready()
                    ready_since = None
                    commits += 1
                    if max_batches is not None and commits >= max_batches:
                        break
            self._drain()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            worker.join(5)

    def _before_poll(self) -> None:
        self.stage.before_poll(self.ctx)
        if self.then is not None:
            self.then.before_poll(self.ctx)

    def in_flight_limit(self) -> int:
        """Most records a pipelined run keeps in flight: the runtime's knobs, capped by the stage's own wish."""
        limit = max(1, self.settings.concurrency, self.settings.max_in_flight)
        return min(limit, self.stage.max_in_flight) if self.stage.max_in_flight else limit

    def _drain(self) -> None:
        """On the way out, give records in flight a handler timeout to finish and commit those that did."""
        unfinished = self._window.unfinished()
        if unfinished:
            wait(unfinished, timeout=self.settings.handler_timeout_s)
        if self._window.count_ready():
            self._commit_ready()

    # -- pipelined transactions ----------------------------------------------------------------------------------

    def _admit(self, c: Consumed, now: float) -> Slot | None:
        """The record's slot in the window; the slot when its handler is still to start, else None."""
        slot = self._window.add(Slot(c, admitted_at=now))
        if slot.emitted:
            return None  # handled before a crash or rebalance; the committed offset metadata says so
        if c.rejected is not None:
            self._window.resolve(slot, c.rejected)
            return None
        if self._handled_before(c):
            self._window.resolve(slot, [])
            return None
        slot.item = c.item
        return slot

    def _handled_before(self, c: Consumed) -> bool:
        """Handed to this stage in process by a chain, which produced its outputs then (``runtime.chain``)."""
        return c.item.headers.get(HANDLED_BY) == self._handled_mark

    def _commit_ready(self) -> None:
        ready = self._window.ready()
        started = min(s.admitted_at for s in ready)
        points: dict = {}

        def body() -> list[Offset]:
            for slot in ready:
                self._emit(slot.msg, slot.item, slot.outcome())
            # Each partition commits the offset of its first unfinished record, and lists the finished ones after
            # it in the offset's metadata: all of their outputs are in this transaction or an earlier one.
            points.update(self._window.commit_points())
            return [(t, p, base, meta) for (t, p), (base, meta) in points.items()]
        try:
            committed = self.txn.transact(body, self.source.group_metadata)
        except BaseException:
            self._rewind(self._rewind_window())
            raise
        if not committed:
            self._rewind(self._rewind_window())
            return
        self._window.mark_committed(points)
        self._on_committed(len(ready))
        metrics.BATCH_SECONDS.labels(self.stage.name).observe(time.monotonic() - started)

    def _rewind_window(self) -> dict[tuple[str, int], int]:
        """An aborted transaction: every record since the last commit is read again (its outputs are gone)."""
        dropped, rewind_to = self._window.rewind()
        for slot in dropped:
            if slot.future is not None:
                slot.future.cancel()
        return rewind_to

    # -- one batch per transaction -------------------------------------------------------------------------------

    def _process_batch(self, msgs: list[Consumed]) -> None:
        started = time.monotonic()

        def body() -> list[Offset]:
            self._handle_and_produce(msgs)
            return [(t, p, o, self._window.remaining_done((t, p), o)) for (t, p), o in _next_offsets(msgs).items()]
        try:
            committed = self.txn.transact(body, self.source.group_metadata)
        except BaseException:
            # Anything else (including a crash in the stage) aborted the transaction: the batch is redone.
            self._rewind(_first_offsets(msgs))
            raise
        if not committed:
            self._rewind(_first_offsets(msgs))
            return
        self._on_committed(len(msgs))
        metrics.BATCH_SECONDS.labels(self.stage.name).observe(time.monotonic() - started)

    def _handle_and_produce(self, msgs: list[Consumed]) -> None:
        """The batch's records through the stage's handlers in one call, then their outputs and dead letters."""
        items: list[Incoming] = []
        sources: list[Consumed] = []
        self._observe(msgs, hdr.now_ms())
        for c in msgs:
            if self._window.is_done_before((c.topic(), c.partition()), c.offset()):
                continue  # a pipelined worker finished it before this one took the partition over
            if c.rejected is not None:
                self._dead_letter(c, c.rejected.reason, str(c.rejected))
            elif not self._handled_before(c):
                items.append(c.item)
                sources.append(c)
        for msg, item, result in zip(sources, items, self.handlers.handle_all(items)):
            self._emit(msg, item, result)

    def _rewind(self, rewind_to: dict[tuple[str, int], int]) -> None:
        """The aborted outputs are gone, so the inputs must be read again from these offsets."""
        for (topic, partition), offset in rewind_to.items():
            self.source.seek(topic, partition, offset)

    # -- records in, records out ---------------------------------------------------------------------------------

    def _observe(self, consumed: list[Consumed], now_ms: int) -> None:
        """Records-in per topic, and each decoded record's wait on its topic (the produced-at header)."""
        per_topic: dict[str, int] = {}
        for c in consumed:
            per_topic[c.topic()] = per_topic.get(c.topic(), 0) + 1
            produced = c.item.headers.get(hdr.PRODUCED_AT) if c.item is not None else None
            if produced is not None and produced.isdigit():
                self._queue_delay.observe(max(0, now_ms - int(produced)) / 1000)
        for physical, n in per_topic.items():
            metrics.RECORDS_IN.labels(self.stage.name, logical_name(self.kafka.run, physical)).inc(n)

    def _emit(self, msg: Consumed, item: Incoming | None, result: "list[Output] | Chained | Rejected") -> None:
        """Produce a record's outputs, or its dead letter, into the open transaction."""
        if isinstance(result, Rejected):
            self._dead_letter(msg, result.reason, str(result))
            return
        if isinstance(result, Chained):  # encoded already, both stages' (runtime.chain)
            self._produce(self.stage.name, result.first)
            for handed, outcome in result.handed:
                if isinstance(outcome, Rejected):
                    self.txn.dead_letter(self.then.name, handed, outcome.reason, str(outcome),
                                         self.settings.max_record_bytes)
                else:
                    self._produce(self.then.name, outcome)
            return
        try:
            encoded = [(out, self._encode(item, out)) for out in result]
        except Rejected as rej:
            self._dead_letter(msg, rej.reason, str(rej))
            return
        self._produce(self.stage.name, encoded)

    def _produce(self, stage: str, encoded: list) -> None:
        for out, (topic, key, value, headers) in encoded:
            self.txn.produce(topic, value, key, headers)
            counter = self._records_out.get((stage, out.topic))
            if counter is None:
                counter = self._records_out[(stage, out.topic)] = metrics.RECORDS_OUT.labels(stage, out.topic)
            counter.inc()
            metrics.count_output(stage, out.topic, out.record)

    def _encode(self, item: Incoming, out: Output) -> tuple[str, Any, bytes, list]:
        try:
            value = out.value() if out.value is not None else records.encode(out.topic, out.record)
        except Exception as exc:  # e.g. a str with lone surrogates, or a wrong type, from the handler
            # Raised past here it would abort the batch, crash the stage and do the same again on restart.
            raise Rejected("handler_error", f"{out.topic} output does not fit its schema: "
                                            f"{type(exc).__name__}: {exc}") from None
        reward_version = out.reward_version if out.reward_version is not None else item.reward_version
        headers = hdr.build(out.policy_version if out.policy_version is not None else item.policy_version,
                            hdr.child_traceparent(item.traceparent), reward_version)
        headers += [(name, value.encode()) for name, value in out.extra_headers]
        size = wire_bytes(value, out.key, headers)
        if size > self.settings.max_record_bytes:
            raise Rejected("oversized", f"{out.topic} record of {len(value)} bytes ({size} on the wire at worst) "
                                        f"exceeds {self.settings.max_record_bytes}")
        return topic_name(self.kafka.run, out.topic), out.key, value, headers

    def _dead_letter(self, m: Consumed, reason: str, error: str) -> None:
        self.txn.dead_letter(self.stage.name, m, reason, error, self.settings.max_record_bytes)

    # -- assignment and backpressure -----------------------------------------------------------------------------

    def set_paused(self, logical_topic: str, paused: bool) -> None:
        physical = topic_name(self.kafka.run, logical_topic)
        parts = [tp for tp in self._assigned if tp.topic == physical]
        if paused and logical_topic not in self.paused_topics:
            self.paused_topics.add(logical_topic)
            if parts:
                self.source.pause(parts)
        elif not paused and logical_topic in self.paused_topics:
            self.paused_topics.discard(logical_topic)
            if parts:
                self.source.resume(parts)
        metrics.PAUSED.labels(self.stage.name).set(
            sum(1 for tp in self._assigned if logical_name(self.kafka.run, tp.topic) in self.paused_topics))

    def backlog(self, logical_topic: str) -> int:
        """Records of ``logical_topic`` on this worker's partitions not read yet (``kafka.sources.waiting``)."""
        physical = topic_name(self.kafka.run, logical_topic)
        parts = [tp for tp in self._assigned if tp.topic == physical]
        return waiting(self.consumer, parts, self._starts) if parts else 0

    def _on_assign(self, consumer, parts: list) -> None:
        self._assigned = list(parts)
        if self._closing:
            return
        self._load_committed(consumer, parts)
        # A rebalance resumes everything; re-apply the stage's backpressure.
        paused = [tp for tp in parts if logical_name(self.kafka.run, tp.topic) in self.paused_topics]
        if paused:
            consumer.pause(paused)

    def _load_committed(self, consumer, parts: list) -> None:
        """Learn which records past each committed offset a pipelined worker already finished (its metadata)."""
        if not parts:
            return
        for tp in consumer.committed(parts, timeout=30):
            self._starts[(tp.topic, tp.partition)] = max(0, tp.offset)
            if tp.offset >= 0:
                self._window.set_committed((tp.topic, tp.partition), tp.offset, tp.metadata)

    def _on_revoke(self, consumer, parts: list) -> None:
        # No transaction is open here: revocation only happens inside consume(). Records in flight or held for
        # these partitions are uncommitted; their next owner reads them again, so they are dropped, not produced.
        self._assigned = [tp for tp in self._assigned if tp not in parts]
        gone = {(tp.topic, tp.partition) for tp in parts}
        for slot in self._window.drop(gone):
            if slot.future is not None:
                slot.future.cancel()


def _first_offsets(msgs: Sequence[Consumed]) -> dict[tuple[str, int], int]:
    """Where a rewind of a batch starts: the first offset of each partition in it."""
    first: dict[tuple[str, int], int] = {}
    for m in msgs:
        key = (m.topic(), m.partition())
        first[key] = min(first.get(key, m.offset()), m.offset())
    return first


def _next_offsets(msgs: Sequence[Consumed]) -> dict[tuple[str, int], int]:
    """The offsets to commit: one past the last consumed record of each partition."""
    last: dict[tuple[str, int], int] = {}
    for m in msgs:
        key = (m.topic(), m.partition())
        last[key] = max(last.get(key, -1), m.offset() + 1)
    return last
