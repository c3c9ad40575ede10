"""The archive sink: every topic of a run into ClickHouse (embedded chDB or a server), idempotently.

Inserts happen in batches and Kafka offsets are committed only after them. A
per-(table, topic, partition) watermark read back from ClickHouse skips records
already archived, so replayed offsets add no rows; ReplacingMergeTree on
(run, topic, partition, offset) is the second line of defence.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import re
import secrets
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from prometheus_client import Counter, Histogram

from rlstream.config import KafkaSettings, knob
from rlstream.kafka.topics import TOPICS, create_topics, topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import HEADER_LEN, MARKER, DecodeError, default_codec, load_current, packed_paths
from rlstream.kafka.group import GroupMember
from rlstream.archive.query import DATABASE, DEFAULT_ARCHIVE, ArchiveError, SqlEndpoint, connect, resolve, run_sql

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

    archive: str = knob(DEFAULT_ARCHIVE, "chdb://PATH (embedded; relative paths from the working directory) or "
                                         "http(s)://HOST:PORT of a ClickHouse server; credentials only from "
                                         "RLSTREAM_CLICKHOUSE_USER / RLSTREAM_CLICKHOUSE_PASSWORD")
    archive_batch_rows: int = knob(20000, "Most records inserted per batch (ClickHouse prefers big inserts)")
    archive_flush_s: float = knob(1.0, "Longest a consumed record waits before its batch is inserted")
    archive_batch_bytes: int = knob(64 * 1024 * 1024, "Most record bytes held per batch")
    archive_clickhouse_decode: bool = knob(True, "With chDB, let ClickHouse decode current-schema Avro (fast); "
                                                 "off: decode every record in Python")
    sql_port: int = knob(0, "Port of the SQL endpoint other processes query an embedded archive through (0: free)")


# -- table shapes --------------------------------------------------------------------------------------------

_TS = "DateTime64(3, 'UTC')"
_LC = "LowCardinality(String)"
META = [("run", _LC), ("topic", _LC), ("partition", "Int32"), ("offset", "Int64"), ("kafka_key", "String"),
        ("kafka_timestamp", _TS), ("header_policy_version", "Int32"), ("header_reward_version", _LC),
        ("traceparent", "String"), ("produced_at", _TS)]
TASK = [("task_id", "String"), ("task_name", _LC), ("env_name", _LC), ("env_version", _LC), ("prompt", "String"),
        ("prompt_token_ids", "Array(Int32)"), ("answer", "Nullable(String)"), ("task_metadata", "Map(String, String)"),
        ("group_size", "Int32"), ("split", _LC), ("max_turns", "Int32"), ("task_created_at", _TS),
        ("temperature", "Float64"), ("top_p", "Float64"), ("top_k", "Int32"), ("max_tokens", "Int32"),
        ("seed", "Nullable(Int64)"), ("stop", "Array(String)")]
TURNS = [("turns.role", f"Array({_LC})"), ("turns.text", "Array(String)"), ("turns.token_start", "Array(Int32)"),
         ("turns.token_end", "Array(Int32)"), ("turns.policy_version", "Array(Int32)"),
         ("turns.finish_reason", f"Array({_LC})"), ("turns.tool_name", "Array(String)"),
         ("turns.tool_arguments", "Array(String)"), ("turns.tool_output", "Array(String)"),
         ("turns.tool_exit_code", "Array(Int32)"), ("turns.tool_duration_ms", "Array(Float64)"),
         ("turns.tool_truncated", "Array(Bool)"), ("turns.tool_failure_class", f"Array({_LC})"),
         ("turns.started_at", f"Array({_TS})"), ("turns.finished_at", f"Array({_TS})")]
TOKENS = [("token_ids", "Array(Int32)"), ("loss_mask", "Array(UInt8)"), ("behaviour_logprobs", "Array(Float32)"),
          ("n_tokens", "UInt32")]
FAILURE = [("failure_class", _LC), ("failure_message", "String"), ("failure_stage", _LC)]
TRAJECTORY = ([("trajectory_id", "String"), ("group_id", "String"), ("sample_index", "Int32")] + TASK
              + [("response", "String")] + TOKENS + TURNS
              + [("min_policy_version", "Int32"), ("max_policy_version", "Int32"), ("status", _LC)] + FAILURE
              + [("stage_times", "Map(String, Int64)"), ("trace_id", "String")])
REWARD = [("reward_total", "Float64"), ("reward_breakdown", "Map(String, Float64)"), ("violations", "Array(String)"),
          ("reward_version", _LC), ("verifier_version", _LC), ("judge_version", _LC), ("reward_latency_ms", "Float64"),
          ("reward_failure_class", _LC), ("scored_at", _TS)]

#: Table -> its columns after META (every table also has archived_at, filled by ClickHouse).
TABLES: dict[str, list[tuple[str, str]]] = {
    "tasks": [("group_id", "String")] + TASK + [("trace_id", "String")],
    "episodes": ([("direction", _LC), ("episode_id", "String"), ("group_id", "String"), ("sample_index", "Int32")]
                 + TASK + TOKENS + TURNS + [("done", "Bool")] + FAILURE
                 + [("stage_times", "Map(String, Int64)"), ("trace_id", "String")]),
    "trajectories": TRAJECTORY,
    "rewards": TRAJECTORY + REWARD,
    "feedback": TRAJECTORY + REWARD + [("teacher_version", _LC), ("teacher_model", _LC),
                                       ("teacher_logprobs", "Array(Float32)"), ("teacher_latency_ms", "Float64")],
    "policy_versions": [("policy", _LC), ("version", "Int32"), ("weights_uri", "String"), ("step", "Int64"),
                        ("parent_version", "Int32"), ("samples_trained", "Int64"), ("metrics", "Map(String, Float64)"),
                        ("trainer_id", "String"), ("created_at", _TS), ("published_at", _TS),
                        ("tokenizer_hash", "String")],
    "dead_letters": [("stage", _LC), ("reason", _LC), ("error", "String"), ("original_topic", "String"),
                     ("original_partition", "Int32"), ("original_offset", "Int64"), ("failed_at", _TS),
                     ("key", "String"), ("value", "String"), ("headers", "Map(String, String)"),
                     ("trace_id", "String")],
}
TOPIC_TABLE = {"prompts": "tasks", "actions": "episodes", "observations": "episodes", "trajectories": "trajectories",
               "rewards": "rewards", "feedback": "feedback", "policy-versions": "policy_versions",
               "dead-letters": "dead_letters"}
_DIRECTION = {"actions": "action", "observations": "observation"}


def table_ddl(table: str) -> str:
    """CREATE TABLE IF NOT EXISTS for one archive table."""
    cols = ",\n  ".join(f"`{n}` {t}" for n, t in META + TABLES[table])
    return (f"CREATE TABLE IF NOT EXISTS {DATABASE}.{table} (\n  {cols},\n  `archived_at` {_TS} DEFAULT now64(3)\n)"
            f" ENGINE = ReplacingMergeTree ORDER BY (run, topic, partition, offset)")


# -- record -> row (tuples in column order; hot path, so plain indexing) --------------------------------------

_NO_TURNS = ((),) * len(TURNS)


def _task(t: dict) -> tuple:
    s = t["sampling"]
    return (t["task_id"], t["task_name"], t["env_name"], t["env_version"], t["prompt"], t["prompt_token_ids"],
            t["answer"], t["metadata"], t["group_size"], t["split"], t["max_turns"], t["created_at"],
            s["temperature"], s["top_p"], s["top_k"], s["max_tokens"], s["seed"], s["stop"])


def _turn(t: dict) -> tuple:
    call, res = t["tool_call"], t["tool_result"]
    if res is None:
        tool = ("", 0, 0.0, False, "")
    else:
        tool = (res["output"], res["exit_code"], res["duration_ms"], res["truncated"], res["failure_class"] or "")
    return ((t["role"], t["text"], t["token_start"], t["token_end"], t["policy_version"], t["finish_reason"],
             call["name"] if call else "", call["arguments"] if call else "") + tool
            + (t["started_at"], t["finished_at"]))


def _turns(turns: list) -> tuple:
    return tuple(zip(*map(_turn, turns))) if turns else _NO_TURNS


def _failure(f: dict | None) -> tuple:
    return ("", "", "") if f is None else (f["failure_class"], f["message"], f["stage"])


def _tokens(r: dict) -> tuple:
    ids = r["token_ids"]
    return ids, r["loss_mask"], r["behaviour_logprobs"], len(ids)


def _trajectory(r: dict) -> tuple:
    return ((r["trajectory_id"], r["group_id"], r["sample_index"]) + _task(r["task"]) + (r["response"],)
            + _tokens(r) + _turns(r["turns"])
            + (r["min_policy_version"], r["max_policy_version"], r["status"]) + _failure(r["failure"])
            + (r["stage_times"], r["trace_id"]))


def _reward(w: dict) -> tuple:
    return (w["total"], w["breakdown"], w["violations"], w["reward_version"], w["verifier_version"],
            w["judge_version"], w["latency_ms"], w["failure_class"] or "", w["scored_at"])


#: Table -> (decoded record, logical topic) -> the row after META.
ROW_FNS = {
    "tasks": lambda r, _: (r["group_id"],) + _task(r) + (r["trace_id"],),
    "episodes": lambda r, topic: (
        (_DIRECTION.get(topic, topic), r["episode_id"], r["group_id"], r["sample_index"]) + _task(r["task"])
        + _tokens(r) + _turns(r["turns"]) + (r["done"],) + _failure(r["failure"]) + (r["stage_times"], r["trace_id"])),
    "trajectories": lambda r, _: _trajectory(r),
    "rewards": lambda r, _: _trajectory(r["trajectory"]) + _reward(r["reward"]),
    "feedback": lambda r, _: (_trajectory(r["scored"]["trajectory"]) + _reward(r["scored"]["reward"])
                              + (r["teacher_version"], r["teacher_model"], r["teacher_logprobs"], r["latency_ms"])),
    "policy_versions": lambda r, _: (r["policy"], r["version"], r["weights_uri"], r["step"], r["parent_version"],
                                     r["samples_trained"], r["metrics"], r["trainer_id"], r["created_at"],
                                     r["published_at"], r["tokenizer_hash"]),
    "dead_letters": lambda r, _: (r["stage"], r["reason"], r["error"], r["topic"], r["partition"], r["offset"],
                                  r["failed_at"], r["key"] or b"", r["value"] or b"", r["headers"], r["trace_id"]),
}

_NO_HEADERS = (-1, b"", b"", 0)
#: No two rows of one insert share a key, so ReplacingMergeTree has nothing to collapse at insert time.
_INSERT_SETTINGS = {"optimize_on_insert": 0}


def _headers(m: Message) -> tuple[int, bytes, bytes, int]:
    """(policy_version, reward_version, traceparent, produced_at); malformed ints become defaults, never errors."""
    raw = m.headers()
    if not raw:
        return _NO_HEADERS
    h = dict(raw)  # the last of a repeated header wins, as everywhere else
    pv, rv, tp, produced = h.get(hdr.POLICY_VERSION), h.get(hdr.REWARD_VERSION), h.get(hdr.TRACEPARENT), \
        h.get(hdr.PRODUCED_AT)
    try:
        pv = int(pv)
        if not -2 ** 31 <= pv < 2 ** 31:
            pv = -1
    except (TypeError, ValueError):
        pv = -1
    try:
        produced = int(produced)
        if not -2 ** 63 <= produced < 2 ** 63:
            produced = 0
    except (TypeError, ValueError):
        produced = 0
    return pv, rv or b"", tp or b"", produced


def _meta(run: str, logical: str, m: Message) -> tuple:
    """The Kafka coordinates and headers every row carries."""
    ts = m.timestamp()[1]
    return (run, logical, m.partition(), m.offset(), m.key() or b"", ts if ts > 0 else 0) + _headers(m)


def _undecodable_row(m: Message, reason: str, error: str) -> tuple:
    """A record the archive cannot decode, kept whole in the dead_letters shape."""
    headers = {k: (v or b"") for k, v in (m.headers() or ())}
    return ("archive", reason, error[:4000], m.topic(), m.partition(), m.offset(), hdr.now_ms(), m.key() or b"",
            m.value() or b"", headers, hdr.trace_id(headers.get(hdr.TRACEPARENT)))


# -- the same rows, decoded by ClickHouse (chDB) ---------------------------------------------------------------
# Python decoding caps ingest near 25k records/s on a small machine, so with chDB the sink wraps each record's
# Avro body with its Kafka coordinates into an Avro container and lets ClickHouse decode and flatten it. The
# SELECT below mirrors the row functions above column for column (a test compares both paths).

def _ts_sql(x: str) -> str:
    return f"fromUnixTimestamp64Milli({x}, 'UTC')"


def _task_sql(t: str) -> list[str]:
    s = f"{t}.sampling"
    return [f"{t}.task_id", f"{t}.task_name", f"{t}.env_name", f"{t}.env_version", f"{t}.prompt",
            f"ARR(Int32, {t}.prompt_token_ids)", f"{t}.answer", f"{t}.metadata", f"{t}.group_size", f"{t}.split",
            f"{t}.max_turns", _ts_sql(f"{t}.created_at"), f"{s}.temperature", f"{s}.top_p", f"{s}.top_k",
            f"{s}.max_tokens", f"{s}.seed", f"{s}.stop"]


def _turns_sql(p: str) -> list[str]:
    each = ["x.role", "x.text", "x.token_start", "x.token_end", "x.policy_version", "x.finish_reason",
            "ifNull(x.tool_call.name, '')", "ifNull(x.tool_call.arguments, '')", "ifNull(x.tool_result.output, '')",
            "ifNull(x.tool_result.exit_code, 0)", "ifNull(x.tool_result.duration_ms, 0)",
            "ifNull(x.tool_result.truncated, false)", "ifNull(x.tool_result.failure_class, '')",
            _ts_sql("x.started_at"), _ts_sql("x.finished_at")]
    return [f"arrayMap(x -> {e}, {p}.turns)" for e in each]


def _tokens_sql(p: str) -> list[str]:
    return [f"ARR(Int32, {p}.token_ids)", f"ARR(UInt8, {p}.loss_mask)", f"ARR(Float32, {p}.behaviour_logprobs)",
            f"LEN(Int32, {p}.token_ids)"]


def _failure_sql(f: str) -> list[str]:
    return [f"ifNull({f}.failure_class, '')", f"ifNull({f}.message, '')", f"ifNull({f}.stage, '')"]


def _trajectory_sql(p: str) -> list[str]:
    return ([f"{p}.trajectory_id", f"{p}.group_id", f"{p}.sample_index"] + _task_sql(f"{p}.task") + [f"{p}.response"]
            + _tokens_sql(p) + _turns_sql(p) + [f"{p}.min_policy_version", f"{p}.max_policy_version", f"{p}.status"]
            + _failure_sql(f"{p}.failure") + [f"{p}.stage_times", f"{p}.trace_id"])


def _reward_sql(w: str) -> list[str]:
    return [f"{w}.total", f"{w}.breakdown", f"{w}.violations", f"{w}.reward_version", f"{w}.verifier_version",
            f"{w}.judge_version", f"{w}.latency_ms", f"ifNull({w}.failure_class, '')", _ts_sql(f"{w}.scored_at")]


META_SQL = ["run", "topic", "partition", "reinterpretAsInt64(offset)", "kafka_key",
            _ts_sql("reinterpretAsInt64(kafka_timestamp)"), "header_policy_version", "header_reward_version",
            "traceparent", _ts_sql("reinterpretAsInt64(produced_at)")]
SELECTS: dict[str, list[str]] = {
    "tasks": ["value.group_id"] + _task_sql("value") + ["value.trace_id"],
    "episodes": (["multiIf(topic = 'actions', 'action', topic = 'observations', 'observation', topic)",
                  "value.episode_id", "value.group_id", "value.sample_index"] + _task_sql("value.task")
                 + _tokens_sql("value") + _turns_sql("value") + ["value.done"] + _failure_sql("value.failure")
                 + ["value.stage_times", "value.trace_id"]),
    "trajectories": _trajectory_sql("value"),
    "rewards": _trajectory_sql("value.trajectory") + _reward_sql("value.reward"),
    "feedback": (_trajectory_sql("value.scored.trajectory") + _reward_sql("value.scored.reward")
                 + ["value.teacher_version", "value.teacher_model", "ARR(Float32, value.teacher_logprobs)",
                    "value.latency_ms"]),
    "policy_versions": ["value.policy", "value.version", "value.weights_uri", "value.step", "value.parent_version",
                        "value.samples_trained", "value.metrics", "value.trainer_id", _ts_sql("value.created_at"),
                        _ts_sql("value.published_at"), "value.tokenizer_hash"],
    "dead_letters": ["value.stage", "value.reason", "value.error", "value.topic", "value.partition", "value.offset",
                     _ts_sql("value.failed_at"), "ifNull(value.key, '')", "ifNull(value.value, '')", "value.headers",
                     "value.trace_id"],
}
_TABLE_RECORD = {"tasks": "Task", "episodes": "Episode", "trajectories": "Trajectory", "rewards": "ScoredTrajectory",
                 "feedback": "TeacherFeedback", "policy_versions": "PolicyVersion", "dead_letters": "DeadLetter"}
_WIDTH = {"int32": 4, "float32": 4, "uint8": 1}
_SYNC = secrets.token_bytes(16)


def _long(n: int) -> bytes:
    """Avro zig-zag varint."""
    n = (n << 1) ^ (n >> 63)
    if n < 128:
        return _BYTE[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_BYTE = [bytes([i]) for i in range(128)]


def _bytes(b: bytes) -> bytes:
    return _long(len(b)) + b


class _NativeTable:
    """How ClickHouse decodes one table's records: the wrapper schema and the INSERT ... SELECT."""

    def __init__(self, table: str):
        record = _TABLE_RECORD[table]
        schema = load_current(record)
        packed = {"value." + ".".join(path): kind for path, kind in packed_paths(schema)}
        # Offsets and times travel as 8 fixed little-endian bytes: cheaper to write than varints in Python.
        fields = [("run", "string"), ("topic", "string"), ("partition", "int"),
                  ("offset", {"type": "fixed", "name": "rlstream.Int64LE", "size": 8}), ("kafka_key", "bytes"),
                  ("kafka_timestamp", "rlstream.Int64LE"), ("header_policy_version", "int"),
                  ("header_reward_version", "string"), ("traceparent", "string"), ("produced_at", "rlstream.Int64LE"),
                  ("value", schema), ("check", "rlstream.Int64LE")]
        wrapper = {"type": "record", "name": "rlstream.Archived",
                   "fields": [{"name": n, "type": t} for n, t in fields]}
        meta = {"avro.schema": json.dumps(wrapper).encode(), "avro.codec": b"null"}
        self.header = (b"Obj\x01" + _long(len(meta)) + b"".join(_bytes(k.encode()) + _bytes(v) for k, v in meta.items())
                       + _long(0) + _SYNC)

        def packed_sql(match) -> str:
            fn, kind, path = match.group(1), match.group(2), match.group(3)
            if path not in packed:
                return path if fn == "ARR" else f"length({path})"
            return f"reinterpret({path}, 'Array({kind})')" if fn == "ARR" else f"intDiv(length({path}), 4)"

        exprs = [re.sub(r"(ARR|LEN)\((\w+), ([\w.]+)\)", packed_sql, e) for e in META_SQL + SELECTS[table]]
        names = ", ".join(f"`{n}`" for n, _ in META + TABLES[table])
        # A record whose body is not what its fingerprint says misframes every later one: the check field
        # (its own offset) catches that, and the packed arrays must hold whole elements, as the codec demands.
        bad = ["check != offset"] + [
            f"length({path}) % {_WIDTH[kind]} != 0" for path, kind in packed.items() if _WIDTH[kind] > 1]
        self.sql = (f"INSERT INTO {DATABASE}.{table} ({names}) SELECT {', '.join(exprs)} FROM file({{path}}, 'Avro') "
                    f"WHERE throwIf({' OR '.join(bad)}, 'misframed or malformed record') = 0 "
                    f"SETTINGS optimize_on_insert = 0")

    def container(self, run: str, msgs: list[Message]) -> bytes:
        """One Avro container block: per record, its Kafka coordinates, its body and its check."""
        parts: list = []
        extend = parts.extend
        prefixes: dict[tuple[str, int], bytes] = {}
        cut = len(run) + 1
        for m in msgs:
            topic, partition, offset = m.topic(), m.partition(), m.offset()
            prefix = prefixes.get((topic, partition))
            if prefix is None:
                prefix = prefixes[(topic, partition)] = (_bytes(run.encode()) + _bytes(topic[cut:].encode())
                                                         + _long(partition))
            pv, rv, tp, produced = _headers(m)
            ts = m.timestamp()[1]
            check = offset.to_bytes(8, "little", signed=True)
            extend((prefix, check, _bytes(m.key() or b""), (ts if ts > 0 else 0).to_bytes(8, "little", signed=True),
                    _long(pv), _bytes(rv), _bytes(tp), produced.to_bytes(8, "little", signed=True),
                    m.value()[HEADER_LEN:], check))  # a bytes copy: memoryviews would be tracked by the GC
        body = b"".join(parts)
        return self.header + _long(len(msgs)) + _long(len(body)) + body + _SYNC


class _Rows:
    """Rows bound for one table, and the highest offset per (logical topic, partition) among them."""

    __slots__ = ("rows", "top")

    def __init__(self):
        self.rows: list[tuple] = []
        self.top: dict[tuple[str, int], int] = {}


class ArchiveSink:
    """Consumes every topic of a run (group ``<run>.archive``) and inserts it into ClickHouse."""

    def __init__(self, settings: ArchiveSettings = ArchiveSettings()):
        if settings.archive_batch_rows < 1:
            raise ValueError("--archive-batch-rows must be at least 1")
        if settings.archive_flush_s <= 0:
            raise ValueError("--archive-flush-s must be positive")
        self.kind, self.location = resolve(settings.archive)
        self.settings = settings
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
        self._native_tables: dict[str, _NativeTable] = {}
        self._fingerprints = {t: self.codec.fingerprint(spec.record) for t, spec in TOPICS.items()
                              if t in TOPIC_TABLE}

    # -- ClickHouse side ---------------------------------------------------------------------------------------

    def open(self) -> None:
        """Connect and create the database and tables (idempotent); older tables gain new columns."""
        if self.client is not None:
            return
        self.client = connect(self.settings.archive, create=True)
        try:
            with self.lock:
                self.client.command(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
                for table in TABLES:
                    self.client.command(table_ddl(table))
                    have = {r[0] for r in self.client.query(f"DESCRIBE TABLE {DATABASE}.{table}").result_rows}
                    for name, kind in META + TABLES[table]:
                        if name not in have:
                            self.client.command(f"ALTER TABLE {DATABASE}.{table} "
                                                f"ADD COLUMN IF NOT EXISTS `{name}` {kind}")
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
            spec = self._native_tables.get(table) or self._native_tables.setdefault(table, _NativeTable(table))
            containers.append((table, groups, spec.container(run, batch), len(batch)))
        return containers, [m for ms in slow.values() for m in ms]

    def _execute(self, run: str, plan: tuple[list, list[Message]]) -> bool:
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
                row = ROW_FNS[table](record, logical)
            except Exception as exc:  # a record that cannot be archived as itself is kept as a dead letter
                reason = exc.reason if isinstance(exc, DecodeError) else "archive_error"
                table, row = "dead_letters", _undecodable_row(m, reason, f"{type(exc).__name__}: {exc}")
                if offset > wm.get((table, logical, partition), -1):
                    UNDECODABLE.labels(logical, reason).inc()
            if offset <= wm.get((table, logical, partition), -1):
                self.stats["skipped"] += 1
                SKIPPED.labels(table).inc()
                continue
            batch = batches.get(table) or batches.setdefault(table, _Rows())
            batch.rows.append(_meta(run, logical, m) + row)
            key = (logical, partition)
            if offset > batch.top.get(key, -1):
                batch.top[key] = offset
        for table, batch in batches.items():
            if not self._insert_with_retry(table, batch):
                return False
        return True

    def _insert_native(self, table: str, data: bytes, n: int) -> None:
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
        names = [n for n, _ in META + TABLES[table]]
        columns = list(zip(*rows))
        started = time.perf_counter()
        with self.lock:
            self.client.insert(f"{DATABASE}.{table}", columns, column_names=names, column_oriented=True,
                               settings=_INSERT_SETTINGS)
        INSERT_SECONDS.labels(table).observe(time.perf_counter() - started)
        ROWS.labels(table).inc(len(rows))
        self.stats["rows"] += len(rows)

    # -- Kafka side --------------------------------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        """Flush what is pending, commit, and leave the loop."""
        self._stopping.set()

    def serve(self, kafka: KafkaSettings, runtime=None, idle_exit_s: float | None = None) -> None:
        """Run until SIGTERM/SIGINT (or ``idle_exit_s`` without records, for tests and benchmarks)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        poll_s = getattr(runtime, "poll_timeout_s", 0.2)
        self._run = kafka.run
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
        group = f"{kafka.run}.archive"
        topics = [topic_name(kafka.run, t) for t in TOPICS]
        self._pending, self._pending_bytes, self._inflight = [], 0, None
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
                    self._pending.extend(fresh)
                    self._pending_bytes += sum(map(len, fresh))
                if self._pending and (len(self._pending) >= batch_rows or time.monotonic() - oldest >= flush_s
                                      or self._pending_bytes >= self.settings.archive_batch_bytes):
                    self._flush()
                self._reap(block=False)
                if fresh or self._pending or self._inflight is not None:
                    idle_since = time.monotonic()
                elif idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
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
        offsets: dict[tuple[str, int], int] = {}
        for m in msgs:
            key = (m.topic(), m.partition())
            if m.offset() >= offsets.get(key, -1):
                offsets[key] = m.offset()
        try:
            self._member.consumer.commit(offsets=[TopicPartition(t, p, o + 1) for (t, p), o in offsets.items()],
                                  asynchronous=False)
        except KafkaException as exc:
            # The rows are in; whoever reads these offsets again skips them by watermark.
            log.warning("archive: offset commit failed (%s); records will be re-read and skipped", exc)
        self.stats["batches"] += 1
        self.stats["last_flushed"] = time.monotonic()
        BATCH_SECONDS.observe(time.monotonic() - started)
        return True

    def _on_assign(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        # Another owner may have archived these partitions since we last held them.
        self.load_watermarks(self._run, [(tp.topic[len(self._run) + 1:], tp.partition) for tp in parts])

    def _on_revoke(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        # Flush before the partitions move, so their next owner's watermark already covers our rows.
        self._flush()
        if not self._reap(block=True):
            self._drop(parts)

    def _on_lost(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        self._drop(parts)

    def _drop(self, parts: list[TopicPartition]) -> None:
        gone = {(tp.topic, tp.partition) for tp in parts}
        self._pending = [m for m in self._pending if (m.topic(), m.partition()) not in gone]
        self._pending_bytes = sum(map(len, self._pending))

