"""The archive sink: every topic of a run into ClickHouse (embedded chDB or a server), idempotently.

Inserts happen in batches and Kafka offsets are committed only after them. A
per-(table, topic, partition) watermark read back from ClickHouse skips records
already archived, so replayed offsets add no rows; ReplacingMergeTree on
(run, topic, partition, offset) is the second line of defence.
"""
from __future__ import annotations

import gc
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client import Counter, Histogram

from rlstream.archive.decode import NativeTable, meta_row, undecodable_row
from rlstream.archive.query import DATABASE, ArchiveError, SqlEndpoint, connect, resolve, run_sql
from rlstream.archive.tables import TABLES, TOPIC_TABLE
from rlstream.config import KafkaSettings, LoopSettings, knob
from rlstream.kafka.group import GroupMember
from rlstream.kafka.records import Message
from rlstream.kafka.standby import await_vacancy
from rlstream.kafka.topics import TOPICS, create_topics, topic_name
from rlstream.schemas.codec import HEADER_LEN, MARKER, DecodeError, default_codec

log = logging.getLogger(__name__)

ROWS = Counter("rlstream_archive_rows_total", "Rows inserted into the archive", ["table"])
SKIPPED = Counter("rlstream_archive_skipped_total", "Records skipped as already archived (replayed offsets)", ["table"])
UNDECODABLE = Counter("rlstream_archive_undecodable_total", "Records archived as dead letters by the archive",
                      ["topic", "reason"])
INSERT_SECONDS = Histogram("rlstream_archive_insert_seconds", "Latency of one batch insert into one table", ["table"],
                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
FALLBACKS = Counter("rlstream_archive_python_fallbacks_total", "Batches ClickHouse could not decode, redone in Python",
                    ["table"])
INSERT_ERRORS = Counter("rlstream_archive_insert_errors_total", "Failed insert attempts (retried)", ["table"])
BATCH_SECONDS = Histogram("rlstream_archive_batch_seconds", "Decode, insert and commit time of one batch",
                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))


@dataclass(frozen=True)
class ArchiveSettings:
    """Where the archive lives and how the sink batches."""

    ROLE: ClassVar[str] = "ARCHIVE"

    archive_batch_rows: int = knob(20000, "Most records inserted per batch (ClickHouse prefers big inserts)")
    archive_flush_s: float = knob(1.0, "Longest a consumed record waits before its batch is inserted")
    archive_batch_bytes: int = knob(64 * 1024 * 1024, "Most record bytes held per batch")
    archive_clickhouse_decode: bool = knob(True, "With chDB, let ClickHouse decode current-schema Avro (fast); "
                                                 "off: decode every record in Python")
    sql_port: int = knob(0, "Port of the SQL endpoint other processes query an embedded archive through (0: free)")


#: No two rows of one insert share a key, so ReplacingMergeTree has nothing to collapse at insert time.
_INSERT_SETTINGS = {"optimize_on_insert": 0}


class _Rows:
    """Rows bound for one table, and the highest offset per (logical topic, partition) among them."""

    __slots__ = ("rows", "top")

    def __init__(self):
        self.rows: list[tuple] = []
        self.top: dict[tuple[str, int], int] = {}


class ArchiveSink:
    """Consumes every topic of a run (group ``<run>.archive``) and inserts it into ClickHouse."""

    def __init__(self, settings: ArchiveSettings = ArchiveSettings(), loop: LoopSettings = LoopSettings()):
        if settings.archive_batch_rows < 1:
            raise ValueError("--archive-batch-rows must be at least 1")
        if settings.archive_flush_s <= 0:
            raise ValueError("--archive-flush-s must be positive")
        self.kind, self.location = resolve(loop.archive)
        self.settings = settings
        self.url = loop.archive
        self.codec = default_codec()
        self.client = None
        self.lock = threading.Lock()  # one chDB engine, used by the sink and the SQL endpoint threads
        self.watermarks: dict[tuple[str, str, int], int] = {}  # (table, logical topic, partition) -> max offset
        self.stats = {"rows": 0, "skipped": 0, "batches": 0, "first_consumed": None, "last_flushed": None}
        self._stopping = threading.Event()
        self._endpoint: SqlEndpoint | None = None
        self._member: GroupMember | None = None
        self._run = ""
        self._logical: dict[str, str] = {}
        self._native = settings.archive_clickhouse_decode and self.kind == "chdb"
        self._native_tables: dict[str, NativeTable] = {}
        self._fingerprints = {t: self.codec.fingerprint(spec.record) for t, spec in TOPICS.items()
                              if t in TOPIC_TABLE}

    # -- ClickHouse side ---------------------------------------------------------------------------------------

    def open(self) -> None:
        """Connect and create the database and tables (idempotent); older tables gain new columns."""
        if self.client is not None:
            return
        self.client = connect(self.url, create=True)
        try:
            with self.lock:
                self.client.command(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
                for table in TABLES.values():
                    self.client.command(table.ddl())
                    have = {r[0] for r in self.client.query(f"DESCRIBE TABLE {DATABASE}.{table.name}").result_rows}
                    for column in table.columns:
                        if column.name not in have:
                            self.client.command(f"ALTER TABLE {DATABASE}.{table.name} "
                                                f"ADD COLUMN IF NOT EXISTS `{column.name}` {column.type}")
                # The analytics views exist from the start, so plain SQL works on a live run.
                from rlstream.archive.views import install_views
                install_views(self.client)
        except Exception as exc:
            raise ArchiveError(f"cannot create the archive tables: {exc}") from None
        log.info("archive at %s (%s)", self.location, self.kind)

    def close(self) -> None:
        """Stop the SQL endpoint and release the engine."""
        if self._endpoint is not None:
            self._endpoint.stop()
            self._endpoint = None
        if self.client is not None:
            with self.lock:
                self.client.close()
            self.client = None

    def sql(self, statement: str) -> tuple[list[str], list[list]]:
        """Run SQL on the archive this process owns (what the endpoint serves)."""
        with self.lock:
            return run_sql(self.client, statement)

    def load_watermarks(self, run: str, parts: list[tuple[str, int]] | None = None) -> None:
        """Read back the highest archived offset per (table, topic, partition) of a run (or of ``parts``)."""
        where = "run = {run:String}"
        if parts:
            where += " AND (topic, partition) IN (" + ", ".join(
                f"('{t.replace(chr(92), '').replace(chr(39), '')}', {int(p)})" for t, p in parts) + ")"
        union = " UNION ALL ".join(f"SELECT '{t}', topic, partition, max(offset) FROM {DATABASE}.{t} WHERE {where} "
                                   f"GROUP BY topic, partition" for t in TABLES)
        with self.lock:
            rows = self.client.query(union, parameters={"run": run}).result_rows
        for table, topic, partition, top in rows:
            self.watermarks[(table, topic, partition)] = int(top)

    def ingest(self, run: str, msgs: list[Message]) -> bool:
        """Skip what is already archived, insert the rest per table. False if stopped before all were inserted."""
        return self._execute(run, self._prepare(run, msgs))

    def _prepare(self, run: str, msgs: list[Message]) -> tuple[list, list[Message]]:
        """Split a batch: Avro containers ClickHouse decodes, and the records Python must decode."""
        wm = self.watermarks
        # Per (topic, partition): its key, table, both watermarks, fingerprint, and its records for ClickHouse
        # so far (None once one of them needs Python: rows of one key go in one insert, so watermarks stay prefixes).
        keys: dict[tuple[str, int], list] = {}
        slow: dict[tuple[str, int], list[Message]] = {}
        for m in msgs:
            tp = (m.topic(), m.partition())
            k = keys.get(tp)
            if k is None:
                logical = tp[0][len(run) + 1:]
                key, main = (logical, tp[1]), TOPIC_TABLE.get(logical, "dead_letters")
                fingerprint = self._fingerprints.get(logical) if self._native else None
                k = keys[tp] = [key, main, wm.get((main,) + key, -1), wm.get(("dead_letters",) + key, -1),
                                fingerprint, [] if fingerprint else None]
            offset = m.offset()
            if offset <= k[2] and offset <= k[3]:
                self.stats["skipped"] += 1
                SKIPPED.labels(k[1]).inc()
                continue
            value = m.value()
            # Above both watermarks a current-schema record can only land in its own table: ClickHouse may decode it.
            if (k[5] is not None and offset > k[2] and offset > k[3] and value is not None
                    and value[2:HEADER_LEN] == k[4] and value[:2] == MARKER):
                k[5].append(m)
            elif k[5] is not None:
                slow[k[0]], k[5] = k[5] + [m], None
            else:
                slow.setdefault(k[0], []).append(m)
        containers = []
        for table in {k[1] for k in keys.values() if k[5]}:
            groups = {k[0]: k[5] for k in keys.values() if k[1] == table and k[5]}
            batch = [m for ms in groups.values() for m in ms]
            spec = self._native_tables.get(table) or self._native_tables.setdefault(table, NativeTable(table))
            containers.append((table, groups, spec.container(run, batch), len(batch)))
        return containers, [m for ms in slow.values() for m in ms]

    def _execute(self, run: str, plan: tuple[list, list[Message]]) -> bool:
        """Insert a prepared batch: the containers ClickHouse decodes, then the rest in Python."""
        containers, slow = plan
        for table, groups, data, n in containers:
            try:
                self._insert_native(table, data, n)
            except Exception as exc:  # a corrupt record (or anything else): redo these records in Python
                log.warning("archive: ClickHouse could not decode a %s batch (%s); decoding it in Python", table,
                            str(exc).splitlines()[0][:300])
                FALLBACKS.labels(table).inc()
                # A failed INSERT ... SELECT may have written whole blocks; re-read where each partition got to.
                self.load_watermarks(run, list(groups))
                slow = [m for ms in groups.values() for m in ms] + slow
                continue
            for (logical, partition), ms in groups.items():
                self.watermarks[(table, logical, partition)] = ms[-1].offset()
        return self._ingest_python(run, slow)

    def _ingest_python(self, run: str, msgs: list[Message]) -> bool:
        """Decode in Python and insert per table; what cannot be archived as itself goes to dead_letters."""
        batches: dict[str, _Rows] = {}
        wm = self.watermarks
        decode = self.codec.decode
        for m in msgs:
            topic = m.topic()
            logical = self._logical.get(topic) or self._logical.setdefault(topic, topic[len(run) + 1:])
            partition, offset = m.partition(), m.offset()
            table = TOPIC_TABLE.get(logical, "dead_letters")
            try:
                if m.value() is None:
                    raise DecodeError("tombstone", "null value (a compaction delete marker)")
                if logical not in TOPIC_TABLE:
                    raise DecodeError("unknown_topic", f"no archive table for topic {topic}")
                _, record = decode(m.value(), expect=TOPICS[logical].record)
                row = TABLES[table].row(record, logical)
            except Exception as exc:  # a record that cannot be archived as itself is kept as a dead letter
                reason = exc.reason if isinstance(exc, DecodeError) else "archive_error"
                table, row = "dead_letters", undecodable_row(m, reason, f"{type(exc).__name__}: {exc}")
                if offset > wm.get((table, logical, partition), -1):
                    UNDECODABLE.labels(logical, reason).inc()
            if offset <= wm.get((table, logical, partition), -1):
                self.stats["skipped"] += 1
                SKIPPED.labels(table).inc()
                continue
            batch = batches.get(table) or batches.setdefault(table, _Rows())
            batch.rows.append(meta_row(run, logical, m) + row)
            key = (logical, partition)
            if offset > batch.top.get(key, -1):
                batch.top[key] = offset
        for table, batch in batches.items():
            if not self._insert_with_retry(table, batch):
                return False
        return True

    def _insert_native(self, table: str, data: bytes, n: int) -> None:
        """Let ClickHouse decode and insert one Avro container of ``n`` records."""
        started = time.perf_counter()
        fd, path = tempfile.mkstemp(prefix="rlstream-archive-", suffix=".avro")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            with self.lock:  # chDB runs the INSERT without the GIL: the next batch is consumed meanwhile
                self.client.command(self._native_tables[table].sql.replace("{path}", "'" + path.replace("'", "") + "'"))
        finally:
            os.unlink(path)
        INSERT_SECONDS.labels(table).observe(time.perf_counter() - started)
        ROWS.labels(table).inc(n)
        self.stats["rows"] += n

    def _insert_with_retry(self, table: str, batch: _Rows) -> bool:
        """Insert until it succeeds, then move the watermarks; False if stopped first."""
        delay = 0.5
        while True:
            try:
                self._insert(table, batch.rows)
                break
            except Exception as exc:  # the server may be restarting: wait, never skip
                INSERT_ERRORS.labels(table).inc()
                if self._stopping.is_set():
                    log.warning("archive: stopping with %d %s rows not inserted (%s); they will be re-read",
                                len(batch.rows), table, exc)
                    return False
                log.warning("archive: insert into %s failed (%s); retrying in %.1fs", table, exc, delay)
                self._stopping.wait(delay)
                delay = min(delay * 2, 30.0)
        for (logical, partition), top in batch.top.items():
            self.watermarks[(table, logical, partition)] = top
        return True

    def _insert(self, table: str, rows: list[tuple]) -> None:
        """One column-oriented insert of Python rows."""
        names = TABLES[table].names
        columns = list(zip(*rows))
        started = time.perf_counter()
        with self.lock:
            self.client.insert(f"{DATABASE}.{table}", columns, column_names=names, column_oriented=True,
                               settings=_INSERT_SETTINGS)
        INSERT_SECONDS.labels(table).observe(time.perf_counter() - started)
        ROWS.labels(table).inc(len(rows))
        self.stats["rows"] += len(rows)

    # -- Kafka side --------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Flush what is pending, commit, and leave the loop (the process lifecycle calls it on SIGTERM/SIGINT)."""
        self._stopping.set()

    def serve(self, kafka: KafkaSettings, runtime=None, idle_exit_s: float | None = None) -> None:
        """Run until ``stop()`` (or ``idle_exit_s`` without records once it holds partitions, for benchmarks)."""
        poll_s = getattr(runtime, "poll_timeout_s", 0.2)
        self._run = kafka.run
        if getattr(runtime, "standby", False):
            # A standby opens the archive (one chDB process at a time) only once it takes over; it imports first.
            import clickhouse_connect  # noqa: F401
            if self.kind == "chdb":
                import chdb  # noqa: F401
            from rlstream.archive.views import install_views  # noqa: F401
            self._line = await_vacancy(kafka, f"{kafka.run}.archive", runtime.instance, runtime.session_timeout_ms,
                                       stopping=self._stopping.is_set, who="archive")
            if self._line is None:
                return
        self.open()
        # A batch keeps tens of thousands of Kafka messages alive; default GC thresholds rescan them over and over.
        thresholds = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        try:
            self._endpoint = SqlEndpoint(self.sql, self.location if self.kind == "chdb" else None,
                                         self.settings.sql_port)
            log.info("archive SQL endpoint on http://127.0.0.1:%d/", self._endpoint.start())
            try:
                create_topics(kafka.client_config(), kafka.run)
            except Exception as exc:  # the broker may forbid it; topics made elsewhere still get archived
                log.warning("archive: could not create the run's topics: %s", exc)
            self._consume(kafka, poll_s, idle_exit_s, getattr(runtime, "instance", "") or "",
                          getattr(runtime, "session_timeout_ms", 10000))
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
            self.close()
            log.info("archive stopped: %d rows inserted, %d records skipped as already archived",
                     self.stats["rows"], self.stats["skipped"])

    def _consume(self, kafka: KafkaSettings, poll_s: float, idle_exit_s: float | None, instance: str,
                 session_timeout_ms: int) -> None:
        """Consume, batch and flush until stopped (or idle for ``idle_exit_s``)."""
        group = f"{kafka.run}.archive"
        topics = [topic_name(kafka.run, t) for t, spec in TOPICS.items() if spec.archived]
        self._pending, self._pending_bytes, self._inflight, self._catching_up = [], 0, None, False
        # One batch inserts in this thread while the next is consumed and wrapped (chDB releases the GIL).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archive-insert")
        # Committed records only, and offsets move only after their rows are in ClickHouse (group.py).
        self._member = GroupMember(kafka, group, topics, instance=instance, session_timeout_ms=session_timeout_ms,
                                   on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost,
                                   who="archive").subscribe()
        log.info("archive consuming %d topics of run %s as group %s", len(topics), kafka.run, group)
        batch_rows, flush_s = self.settings.archive_batch_rows, self.settings.archive_flush_s
        oldest = idle_since = time.monotonic()
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                wait = poll_s if not self._pending else max(0.0, min(poll_s, oldest + flush_s - now))
                fresh = self._member.consume(max(1, batch_rows - len(self._pending)), wait)
                if fresh:
                    if not self._pending:
                        oldest = time.monotonic()
                    if self.stats["first_consumed"] is None:
                        self.stats["first_consumed"] = time.monotonic()
                        log.info("archive: first %d records consumed; inserted every --archive-flush-s %.3g s or "
                                 "%d rows", len(fresh), flush_s, batch_rows)
                    self._pending.extend(fresh)
                    self._pending_bytes += sum(map(len, fresh))
                # After an assignment, what the partitions' last owner left is inserted once a poll finds nothing
                # more: those records have waited already (a takeover's first commit is its recovery).
                caught_up = self._catching_up and not fresh
                self._catching_up = self._catching_up and bool(fresh)
                if self._pending and (len(self._pending) >= batch_rows or time.monotonic() - oldest >= flush_s
                                      or self._pending_bytes >= self.settings.archive_batch_bytes or caught_up):
                    self._flush()
                self._reap(block=False)
                if fresh or self._pending or self._inflight is not None:
                    idle_since = time.monotonic()
                elif idle_exit_s is not None:
                    # Idle means assigned and nothing arriving: a broker's first group can take seconds to assign
                    # (it creates its offsets topic then), and that wait is not an empty topic. Asked only with an
                    # idle exit: a serving sink's idle polls need not ask the client for its assignment.
                    if not self._member.consumer.assignment():
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since > idle_exit_s:
                        break
            self._flush()
            self._reap(block=True)
        finally:
            self._pool.shutdown(wait=True)
            self._member.close()
            self._member = None

    def _flush(self) -> None:
        """Wrap the pending records, wait for the batch in flight to commit, then start inserting these."""
        msgs, self._pending, self._pending_bytes = self._pending, [], 0
        if not msgs:
            return
        plan = self._prepare(self._run, msgs)
        if self._reap(block=True):  # else we are stopping: these stay uncommitted and are read again later
            self._inflight = (self._pool.submit(self._execute, self._run, plan), msgs, time.monotonic())

    def _reap(self, block: bool) -> bool:
        """Commit the batch in flight once its rows are in (never before); False if it stopped short."""
        if self._inflight is None or not (block or self._inflight[0].done()):
            return True
        future, msgs, started = self._inflight
        self._inflight = None
        if not future.result():
            return False
        # The rows are in; if the commit fails, whoever reads these offsets again skips them by watermark.
        self._member.commit_consumed(msgs)
        self.stats["batches"] += 1
        self.stats["last_flushed"] = time.monotonic()
        BATCH_SECONDS.observe(time.monotonic() - started)
        return True

    def _on_assign(self, consumer, parts: list) -> None:
        """Read the watermarks of partitions this member now owns: another owner may have archived them since."""
        self.load_watermarks(self._run, [(tp.topic[len(self._run) + 1:], tp.partition) for tp in parts])
        self._catching_up = True

    def _on_revoke(self, consumer, parts: list) -> None:
        """Flush and commit before the partitions move, so their next owner's watermark covers our rows."""
        self._flush()
        if not self._reap(block=True):
            self._drop(parts)

    def _on_lost(self, consumer, parts: list) -> None:
        """Forget what was pending for partitions already gone."""
        self._drop(parts)

    def _drop(self, parts: list) -> None:
        """Drop pending records of ``parts``: their next owner reads them again."""
        gone = {(tp.topic, tp.partition) for tp in parts}
        self._pending = [m for m in self._pending if (m.topic(), m.partition()) not in gone]
        self._pending_bytes = sum(map(len, self._pending))

