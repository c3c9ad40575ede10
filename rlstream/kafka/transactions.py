"""The one transactional producer every process of the loop writes through: stages, the trainer, replay.

A transaction carries a batch's outputs, its dead letters and the consumer offsets of its inputs, so they
become visible together or not at all. What can go wrong, and what this module does about it, in one place:

- A broker that is still starting (or moving its transaction coordinator) answers ``init_transactions`` with
  retriable errors: the producer waits for it instead of exiting.
- A transaction that fails with an abortable or retriable error is aborted; the caller re-reads its inputs (or,
  holding state it cannot re-read, tries the same outputs again: ``failure`` says why the last one failed).
- A producer that librdkafka declares fatal (but not fenced) is replaced in-process by a new one with the same
  transactional id, whose registration aborts the open transaction; the caller re-reads its inputs.
- A call that never returns (librdkafka can block in ``send_offsets_to_transaction`` after a broker restart,
  issues 5456 and 5511) is abandoned past its timeout, and the producer replaced likewise (``Caller`` says how
  long past).
- An abort that keeps timing out past the transaction timeout is the same fault in another form (seen after a
  broker restart: the abort request queued for a coordinator connection that never came back): the producer is
  replaced, and the new one waits for the broker in ``init_transactions``.
- A commit that times out goes on in librdkafka's background, and the next ``commit_transaction`` resumes it (an
  abort meanwhile is refused as a conflicting call): it is called again, within the transaction timeout.
- A commit whose answer never came by then (or whose call wedged) may have gone through: librdkafka cannot say, and
  the caller's redo would duplicate it. The producer is replaced, whose registration ends the transaction one way
  or the other, and the transaction's first record says which (``_settle``); ``transact`` returns that.
- A producer fenced by a newer instance of its own transactional id is the zombie: it raises and the process
  exits, because replacing it would fence the live instance in turn.

**Bulk bytes outside the transaction** (a weights version larger than a transaction can carry): ``outside()`` is
the process's companion producer, idempotent and not transactional (librdkafka's transactional producer cannot
produce outside a transaction, and its ``message.timeout.ms`` is capped by the transaction timeout). Its records
are committed as soon as they are acknowledged, so a ``read_committed`` reader sees them at once, whether or not a
transaction ever names them: they are trusted only through a record the transaction commits (the weights log's
manifest). Idempotence dedupes librdkafka's own retries within one producer session (producer id and sequence
numbers); a process killed mid-upload leaves what was acknowledged behind, and its successor writes new records
rather than completing those. While the bulk records are produced the transaction has produced nothing, so the
coordinator's transaction timer (which starts at the first partition added to it) does not run: the transaction
carries only the small records that name them, and its timeout stays the runtime's.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from rlstream import metrics
from rlstream.config import KafkaSettings
from rlstream.errors import RestartToResume
from rlstream.kafka.dead_letters import dead_letter
from rlstream.kafka.records import TypedProducer, produce_waiting
from rlstream.kafka.topics import MAX_MESSAGE_BYTES, topic_name

log = logging.getLogger(__name__)

#: Fatal errors that mean a newer instance with our transactional id exists.
_FENCED = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)

#: What a broker still starting (or moving its transaction coordinator) answers; worth waiting out.
_COORDINATOR_BUSY = (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
                     KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._TIMED_OUT, KafkaError._TRANSPORT)

#: Replacements without a commit in between before a fault is taken as permanent.
MAX_REPLACEMENTS = 5

#: An input position to commit: (topic, partition, next offset, offset metadata or None).
Offset = tuple[str, int, int, "str | None"]


#: How long past its own timeout a blocking producer call is given before it counts as wedged. librdkafka enforces
#: its timeouts on its own threads, so a call that has not returned by then is stuck, not slow (a starved process
#: is late by scheduling delays, not by seconds). A minute, for the calls after which the transaction may have
#: committed (``commit_transaction``, ``abort_transaction``): a false alarm there replaces a producer whose commit
#: went through. Seconds for ``send_offsets_to_transaction``, the call that wedges (issues 5456, 5511): nothing is
#: committed before it returns, so abandoning it aborts the transaction and costs a redo at worst; a minute there
#: held a whole loop still for 90 s after a broker died (benchmarks/three_hosts.py: v4 to v5 in 103 s).
WEDGED_AFTER_S = 60.0
OFFSETS_WEDGED_AFTER_S = 5.0
#: ``send_offsets_to_transaction``'s own timeout: past it the transaction is aborted and redone (a coordinator that
#: moved with a dead broker is found again by then: the controller fences a dead broker within its session timeout).
OFFSETS_TIMEOUT_S = 15.0
#: ``commit_transaction``'s own timeout (it is called again after one, ``_commit``).
COMMIT_TIMEOUT_S = 60.0
#: The pause between two tries of an abort.
ABORT_RETRY_S = 0.2
#: How long a commit with an unknown outcome may take to show which way it went (``_settle``): the broker writes
#: the transaction's markers after it has ended, and a broker restarting meanwhile is waited out, as ``abort`` does.
SETTLE_TIMEOUT_S = 300.0


class Wedged(Exception):
    """A librdkafka call that did not return long after its own timeout."""


def _resumable(err: KafkaError) -> bool:
    """A failed commit that is still going on in librdkafka's background: the next ``commit_transaction`` resumes
    it, and an abort is refused meanwhile."""
    return err.retriable() and not (err.fatal() or err.txn_requires_abort())


class _First:
    """The delivery callback of a transaction's first record: where it landed (``_settle`` looks there), then the
    caller's own callback, if any."""

    __slots__ = ("then", "where")

    def __init__(self, then: Callable | None):
        self.then, self.where = then, None

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            self.where = (msg.topic(), msg.partition(), msg.offset())
        if self.then is not None:
            self.then(err, msg)


class Caller:
    """Runs a producer's blocking calls (their last argument is their timeout) on one long-lived thread, giving each
    ``wedged_after`` seconds more than its timeout to return; Wedged if not, and the caller is then abandoned with
    its thread.

    One thread for every call, not one per call: a thread start costs about 0.1 ms of CPU here, two per
    transaction in every stage."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="txn-call", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, args, result, done = self._calls.get()
            try:
                result["value"] = call(*args)
            except BaseException as exc:  # handed to the caller's thread
                result["error"] = exc
            finally:
                done.set()

    def __call__(self, call: Callable, *args: Any, wedged_after: float = WEDGED_AFTER_S) -> Any:
        done, result = threading.Event(), {}
        self._calls.put((call, args, result, done))
        if not done.wait(args[-1] + wedged_after):
            raise Wedged(f"{getattr(call, '__name__', 'call')} did not return within {args[-1] + wedged_after}s")
        if "error" in result:
            raise result["error"]
        return result.get("value")


#: The slowest rate at which a broker is taken to accept (or serve) bulk bytes before a transfer counts as failed:
#: about 1/20 of what one broker took on the loaded 2-core dev machine (benchmarks/weight_log.py, ~150 MB/s).
FLOOR_BYTES_PER_S = 8 * 1024 * 1024
#: What any transfer may take besides its bytes: a broker's leader moving, a connection set up again.
TRANSFER_SLACK_S = 60.0
#: The companion producer's local queue: bounds the bytes ahead of any record, so its delivery timeout is sized.
OUTSIDE_QUEUE_BYTES = 256 * 1024 * 1024


def transfer_timeout_s(nbytes: int) -> float:
    """How long moving ``nbytes`` of bulk records through the broker may take, either way: ``TRANSFER_SLACK_S`` plus
    the bytes at ``FLOOR_BYTES_PER_S``. The one sizing rule for bulk transfers: the companion producer's delivery
    timeout (the most bytes queued ahead of a record), an upload's flush, a reader's read of a version. Never a
    fixed number: a 14 GB anchor takes minutes where a delta takes a second."""
    return TRANSFER_SLACK_S + max(0, nbytes) / FLOOR_BYTES_PER_S


#: librdkafka's first retry backoff for a transactional producer (``producer_config`` says why it is not 100).
TXN_RETRY_BACKOFF_MS = 5


def producer_config(kafka: KafkaSettings, transactional_id: str, transaction_timeout_ms: int = 30000,
                    **overrides: Any) -> dict[str, Any]:
    """librdkafka settings of a transactional producer of this loop."""
    # A transaction begun right after a commit finds the coordinator still writing the last one's markers: its
    # first AddPartitionsToTxn is answered CONCURRENT_TRANSACTIONS and librdkafka retries after retry.backoff.ms,
    # whose default (100 ms) made every back-to-back transaction last ~90 ms on a local broker (~9 ms at 5 ms).
    # Kafka's Java client lowered that one retry's backoff to 20 ms for the same reason (KAFKA-5477); librdkafka
    # has only the general knob, and backs off exponentially from it to retry.backoff.max.ms on repeated
    # failures, so a broker that is down is not hammered. First, so that --kafka-config can set it.
    return {"retry.backoff.ms": TXN_RETRY_BACKOFF_MS, **kafka.client_config(), "transactional.id": transactional_id,
            "transaction.timeout.ms": transaction_timeout_ms,
            "message.max.bytes": MAX_MESSAGE_BYTES + 65536, "linger.ms": 5, "compression.type": "lz4",
            **overrides}


class TransactionalProducer:
    """A transactional producer that survives what a broker restart does to it (see the module docstring).

    ``start()`` once, then one ``transact(body, group_metadata)`` per batch: ``body`` produces (``produce``,
    ``dead_letter``) and returns the input offsets to commit with what it produced.
    """

    def __init__(self, kafka: KafkaSettings, transactional_id: str, *, who: str,
                 transaction_timeout_ms: int = 30000, stopping: Callable[[], bool] = lambda: False,
                 **overrides: Any):
        self.who = who
        self.run = kafka.run
        self._config = producer_config(kafka, transactional_id, transaction_timeout_ms, **overrides)
        self._transaction_timeout_s = transaction_timeout_ms / 1000
        self._stopping = stopping
        self._replaced = 0  # replacements since the last commit
        self._wedged: list[Producer] = []  # stuck producers, kept so that no destructor waits on them
        self.producer = Producer(self._config)
        self._bounded = Caller()
        self._kafka = kafka
        self._outside: TypedProducer | None = None
        self.failure: KafkaError | None = None  # why the last transact() returned False, when the broker said
        self._first: _First | None = None  # the open transaction's first record, once produced

    @property
    def transaction_timeout_s(self) -> float:
        return self._transaction_timeout_s

    def outside(self) -> TypedProducer:
        """The companion idempotent producer for bulk records outside the transaction (module docstring), made on
        first use: records up to the topics' message limit, no compression (weights payloads are packed already,
        and lz4 would take a core), a local queue of ``OUTSIDE_QUEUE_BYTES``, and a delivery timeout sized from it
        (``transfer_timeout_s``)."""
        if self._outside is None:
            self._outside = TypedProducer(self._kafka, **{
                "linger.ms": 5, "compression.type": "none", "message.max.bytes": MAX_MESSAGE_BYTES + 65536,
                "queue.buffering.max.kbytes": OUTSIDE_QUEUE_BYTES // 1024,
                "message.timeout.ms": int(transfer_timeout_s(OUTSIDE_QUEUE_BYTES) * 1000)})
        return self._outside

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 300.0) -> None:
        """Register the transactional id, fencing any zombie, waiting while the broker is not ready yet."""
        deadline = time.monotonic() + timeout_s
        while not self._stopping():
            try:
                self.producer.init_transactions(30)
                return
            except KafkaException as exc:
                err = exc.args[0]
                # A process started with (or during a restart of) the broker must wait for it, not exit.
                if err.fatal() or not (err.retriable() or err.code() in _COORDINATOR_BUSY) \
                        or time.monotonic() > deadline:
                    raise
                log.warning("%s: broker not ready for transactions (%s); retrying", self.who, err.str())
                time.sleep(1.0)

    def flush(self, timeout: float = 30.0) -> int:
        return self.producer.flush(timeout)

    # -- one transaction ---------------------------------------------------------------------------------------

    def transact(self, body: Callable[[], Iterable[Offset] | None],
                 group_metadata: Callable[[], Any] | None = None) -> bool:
        """Run ``body`` in a transaction and commit what it produced with the offsets it returns.

        Returns False when the transaction was aborted instead (the caller re-reads its inputs from before it), and
        True when it committed, even if the commit call failed first (``_settle``); raises, after aborting,
        whatever ``body`` raised that is not a Kafka error; raises when fenced.
        """
        self.failure = None
        self._first = None
        committing = False
        self.producer.begin_transaction()
        try:
            offsets = [TopicPartition(t, p, o, metadata=meta) if meta is not None else TopicPartition(t, p, o)
                       for t, p, o, meta in body() or ()]
            # Do not advance committed offsets outside of the transaction: the outputs and the input positions
            # become visible together or not at all.
            if offsets:
                self._bounded(self.producer.send_offsets_to_transaction, offsets, group_metadata(),
                              OFFSETS_TIMEOUT_S, wedged_after=OFFSETS_WEDGED_AFTER_S)
            committing = True
            self._commit()
        except KafkaException as exc:
            if committing and _resumable(exc.args[0]):
                self._replace(exc)  # a commit still pending refuses an abort; the new producer's registration ends it
            else:
                self._recover(exc)
            if not (committing and self._settle(exc)):
                return False
        except Wedged as exc:
            self._replace(exc)
            if not (committing and self._settle(exc)):
                return False
        except BaseException:
            self.abort()
            raise
        self._replaced = 0
        metrics.TRANSACTIONS.labels(self.who, "committed").inc()
        return True

    def produce(self, topic: str, value: bytes | None, key: Any = None, headers: list | None = None,
                on_delivery: Any = None, partition: int | None = None) -> None:
        """Produce into the open transaction (``on_delivery``, ``partition``: see ``records.produce_waiting``)."""
        if self._first is None:
            self._first = on_delivery = _First(on_delivery)
        produce_waiting(self.producer, topic, value, key, headers, on_delivery, partition)

    def dead_letter(self, stage: str, msg: Message, reason: str, error: str,
                    max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        """Send an input record the process could not use to the run's dead-letters, in the open transaction."""
        value, headers = dead_letter(stage, msg, reason, error, max_bytes)
        self.produce(topic_name(self.run, "dead-letters"), value, msg.key(), headers)
        metrics.DEAD_LETTERS.labels(stage, reason).inc()
        log.warning("%s dead-lettered %s[%d]@%d: %s: %s", stage, msg.topic(), msg.partition(), msg.offset(),
                    reason, error[:200])

    def _commit(self) -> None:
        """``commit_transaction``, called again while it fails retriably (a timeout: the commit goes on in the
        background, and the next call resumes it), for up to the transaction timeout; what it raises past that is
        the caller's."""
        started = time.monotonic()
        while True:
            try:
                self._bounded(self.producer.commit_transaction, COMMIT_TIMEOUT_S)
                return
            except KafkaException as exc:
                if (not _resumable(exc.args[0]) or self._stopping()
                        or time.monotonic() - started > self._transaction_timeout_s):
                    raise
                log.warning("%s commit not done yet (%s); calling it again", self.who, exc.args[0].str())

    def _settle(self, exc: Exception) -> bool:
        """After a commit call that failed, once the transaction has ended (aborted, or ended by a new producer's
        registration): whether it committed after all.

        Its first record answers: a ``read_committed`` reader gets that record at its offset only if the transaction
        committed, and reads past it once its abort marker is written. A transaction that produced nothing carried
        only input offsets, whose redo produces nothing either, so it counts as aborted. Where the broker does not
        answer, the process exits to resume from what it holds: guessing either way loses or duplicates.
        """
        # librdkafka sends EndTxn(commit) only after a flush that served every delivery report, so a first record
        # with no successful report (nothing produced, its delivery failed, or the flush never ended) means no
        # commit was asked for.
        first = self._first.where if self._first is not None else None
        if first is None:
            return False
        committed = committed_at(self._kafka, *first, timeout_s=SETTLE_TIMEOUT_S)
        if committed is None:
            raise RestartToResume(f"{self.who}: a commit failed ({exc}) and the broker did not show within "
                                  f"{SETTLE_TIMEOUT_S:.0f}s whether it went through; a restart resumes from its "
                                  "offsets") from None
        if committed:
            log.warning("%s: the commit reported as failed (%s) had gone through; not redoing it", self.who, exc)
        return committed

    def _recover(self, exc: KafkaException) -> None:
        """After a failed call in the open transaction: abort it (or replace the producer), or raise if fenced."""
        err = self.failure = exc.args[0]
        if err.txn_requires_abort() or err.retriable():
            log.warning("%s transaction failed (%s); aborting and redoing the batch", self.who, err)
            self.abort()
            return
        if err.fatal() and err.code() not in _FENCED:
            self._replace(exc)
            return
        # Fenced by a newer instance with our transactional id: we are the zombie; exit.
        metrics.TRANSACTIONS.labels(self.who, "fatal").inc()
        raise exc

    def abort(self) -> None:
        """Abort the open transaction, waiting out a broker restart; replace the producer if it cannot abort."""
        metrics.TRANSACTIONS.labels(self.who, "aborted").inc()
        started = time.monotonic()
        deadline = started + 600
        while True:
            try:
                self._bounded(self.producer.abort_transaction, 30)
                return
            except Wedged as exc:
                self._replace(exc)  # the new producer's registration aborts the transaction
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal() and err.code() not in _FENCED and not self._stopping():
                    # E.g. INVALID_TXN_STATE after a broker restart aborted the transaction on its own.
                    self._replace(exc)
                    return
                # An abort times out while the broker is down or restarting: wait for it rather than exit.
                if err.fatal() or not err.retriable() or self._stopping() or time.monotonic() > deadline:
                    log.error("%s abort failed: %s", self.who, exc)
                    raise
                if time.monotonic() - started > self._transaction_timeout_s:
                    # The broker aborts an open transaction by itself past its timeout; an abort still timing out
                    # then will not finish on this producer (module docstring).
                    self._replace(exc)
                    return
                log.warning("%s abort not done yet (%s); retrying", self.who, err.str())
                time.sleep(ABORT_RETRY_S)  # some refusals come back at once: no hot loop

    def _replace(self, exc: Exception) -> None:
        """Fence a stuck or broken producer with a new one of the same transactional id."""
        log.error("%s: %s; replacing the producer (its registration ends the open transaction)", self.who, exc)
        metrics.TRANSACTIONS.labels(self.who, "aborted").inc()
        self._replaced += 1
        if self._replaced > MAX_REPLACEMENTS:  # no commit since several replacements: not a passing fault
            raise exc
        self._wedged.append(self.producer)
        self.producer = Producer(self._config)
        self._bounded = Caller()  # the old one's thread may be stuck in the wedged call
        self.start()


def committed_at(kafka: KafkaSettings, topic: str, partition: int, offset: int, timeout_s: float) -> bool | None:
    """Whether the transactional record at ``topic[partition]@offset`` was committed (True) or aborted (False),
    once its transaction has ended; None if the broker did not show it within ``timeout_s``. A ``read_committed``
    reader returns the record itself only if committed, and otherwise skips it (and at the end of the partition,
    reports an end past it); while its transaction's markers are not written yet, its end is still before it."""
    consumer = Consumer({**kafka.client_config(), "group.id": f"{kafka.run}.settle", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "enable.partition.eof": True})
    try:
        consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is None:
                return msg.offset() == offset
            if msg.error().code() == KafkaError._PARTITION_EOF and msg.offset() > offset:
                return False
        return None
    finally:
        consumer.close()
