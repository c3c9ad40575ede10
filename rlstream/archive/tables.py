"""The archive's tables, each declared once.

A table is declared as a tree that mirrors its Avro record: ``Field`` (one column
from one field), ``Rec`` (a nested record), ``Many`` (an array of records, stored
as parallel ``<field>.<column>`` arrays) and ``Derived`` (a column computed from
the topic). From that one declaration a ``Table`` generates

(a) its DDL,
(b) the Python row a decoded record becomes (after the Kafka ``META`` columns),
(c) the SQL expression per column that ClickHouse uses when it decodes the Avro
    itself (over the wrapper record ``decode.NativeTable`` writes), and
(d) the way back from an archived row to the record's dict (replay).

Nulls: a nullable field, and every field of a nullable record, is stored as its
column's zero ('' / 0 / false); on the way back a zero reads as null again, and a
nullable record whose columns are all zeros reads as null.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

from rlstream.archive.query import DATABASE

_TS = "DateTime64(3, 'UTC')"
_LC = "LowCardinality(String)"
_TYPE_ZERO = object()  # Field.zero's default: the zero of the column's type


@dataclass(frozen=True)
class Field:
    """One column filled from one field of the record (``field``, default the column's name)."""

    name: str
    type: str
    field: str = ""
    ts: bool = False  # epoch milliseconds, stored as DateTime64
    packed: str = ""  # ClickHouse element type of an array the codec may pack into bytes
    length: str = ""  # instead of the field: the length of the packed array ``field`` of this element type
    nullable: bool = False  # the field may be null: stored as ``zero``, read back as null
    zero: Any = _TYPE_ZERO  # what a null stores: the type's zero, b"" in a bytes field (one Python type a column)

    @property
    def key(self) -> str:
        """The record field."""
        return self.field or self.name


@dataclass(frozen=True)
class Derived:
    """A column computed from the record's logical topic, not from a field; it has no way back."""

    name: str
    type: str
    py: Callable[[str], Any]
    sql: str  # over the wrapper's ``topic``


@dataclass(frozen=True)
class Rec:
    """A nested record: the columns of its fields, in order."""

    field: str
    cols: tuple
    nullable: bool = False
    #: Fields of this record not archived here; the way back copies the enclosing record's same-named fields.
    inherit: tuple[str, ...] = ()


@dataclass(frozen=True)
class Many:
    """An array of records, stored as one array column ``<field>.<name>`` per element column."""

    field: str
    cols: tuple


@dataclass(frozen=True)
class Column:
    """A column as ClickHouse sees it: name, type, and the SQL that fills it from the decoded Avro wrapper."""

    name: str
    type: str
    sql: str


def _ts_sql(x: str) -> str:
    """Epoch milliseconds as a DateTime64 in ClickHouse."""
    return f"fromUnixTimestamp64Milli({x}, 'UTC')"


def _zero(col: Field) -> Any:
    """What a null stores in this column (in each element, for a column of an array of records)."""
    if col.zero is not _TYPE_ZERO:
        return col.zero
    kind = col.type
    if kind in ("String", _LC):
        return ""
    if kind == "Bool":
        return False
    if re.fullmatch(r"U?Int\d+", kind):
        return 0
    if re.fullmatch(r"Float\d+", kind):
        return 0.0
    raise TypeError(f"column {col.name} ({kind}) has no zero to stand for null")


def _sql_literal(value: Any) -> str:
    """A column's zero as a ClickHouse literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, bytes)):
        if value:
            raise ValueError("only empty strings stand for null")
        return "''"
    return f"{value:g}"


def read_sql(name: str, kind: str) -> str:
    """The SELECT expression that reads a column back as the record holds it (times as epoch milliseconds)."""
    if kind == _TS:
        return f"toUnixTimestamp64Milli(`{name}`)"
    if kind == f"Array({_TS})":
        return f"arrayMap(x -> toUnixTimestamp64Milli(x), `{name}`)"
    return f"`{name}`"


# -- (b) the Python row: generated code -------------------------------------------------------------------------
# The row mapping is the sink's hot path in Python: the table's tree is turned into straight-line source (one
# local per nested record, a tuple display per row), as fast as the hand-written tuples it replaced.

class _Source:
    """Python source being generated, and the objects it refers to."""

    def __init__(self):
        self.defs: list[str] = []
        self.env: dict[str, Any] = {}
        self.n = 0

    def name(self, prefix: str) -> str:
        """A fresh name."""
        self.n += 1
        return f"{prefix}{self.n}"

    def const(self, value: Any) -> str:
        """The name the generated code reaches ``value`` by."""
        name = self.name("_k")
        self.env[name] = value
        return name

    def compile(self, label: str, entry: str) -> Callable:
        """Run the definitions; returns the function named ``entry``."""
        exec(compile("\n\n".join(self.defs), f"<archive table {label}>", "exec"), self.env)
        return self.env[entry]


def _py_exprs(cols: Sequence, var: str, null: str | None, src: _Source, body: list[str]) -> list[str]:
    """Expressions for the columns of the record in ``var`` (None when the local ``null`` is None)."""
    out = []
    for c in cols:
        if isinstance(c, Field):
            e = f"{var}[{c.key!r}]"
            if c.length:
                e = f"len({e})"
            if c.nullable:
                e = f"({e} or {_zero(c)!r})"
            out.append(f"({_zero(c)!r} if {null} is None else {e})" if null else e)
        elif isinstance(c, Derived):
            out.append(f"{src.const(c.py)}(topic)")
        elif isinstance(c, Rec):
            local = src.name("r")
            get = f"{var}[{c.field!r}]"
            body.append(f"    {local} = {get}" if null is None else f"    {local} = None if {null} is None else {get}")
            out += _py_exprs(c.cols, local, local if (c.nullable or null) else None, src, body)
        else:
            if null is not None:
                raise TypeError(f"an array of records under a nullable record ({c.field}) is not supported")
            elem, body_elem = src.name("_one"), []
            exprs = _py_exprs(c.cols, "x", None, src, body_elem)
            src.defs.append(f"def {elem}(x):\n" + "".join(line + "\n" for line in body_elem)
                            + f"    return ({', '.join(exprs)},)")
            many, none = src.name("_many"), src.const(((),) * len(exprs))
            src.defs.append(f"def {many}(v):\n    return tuple(zip(*map({elem}, v))) if v else {none}")
            out.append(f"*{many}({var}[{c.field!r}])")
    return out


def _compile_row(label: str, cols: Sequence) -> Callable[[dict, str], tuple]:
    """``row(record, topic)``: the columns of ``cols`` from a decoded record, as one tuple."""
    src, body = _Source(), []
    exprs = _py_exprs(cols, "r", None, src, body)
    src.defs.append("def row(r, topic):\n" + "".join(line + "\n" for line in body)
                    + f"    return ({', '.join(exprs)},)")
    return src.compile(label, "row")


# -- (c) the SQL ClickHouse decodes with ------------------------------------------------------------------------
# ARR(kind, path) and LEN(kind, path) mark arrays the codec may pack into bytes: decode.NativeTable resolves them
# against the current schema's packed fields.

def _columns(cols: Sequence, path: str, null: bool) -> list[Column]:
    """The columns of the record at SQL path ``path`` (``null``: under a nullable record)."""
    out = []
    for c in cols:
        if isinstance(c, Field):
            e = f"{path}.{c.key}"
            if c.length:
                e = f"LEN({c.length}, {e})"
            elif c.packed:
                e = f"ARR({c.packed}, {e})"
            elif c.ts:
                e = _ts_sql(e)
            if c.nullable or null:
                e = f"ifNull({e}, {_sql_literal(_zero(c))})"
            out.append(Column(c.name, c.type, e))
        elif isinstance(c, Derived):
            out.append(Column(c.name, c.type, c.sql))
        elif isinstance(c, Rec):
            out += _columns(c.cols, f"{path}.{c.field}", null or c.nullable)
        else:
            out += [Column(f"{c.field}.{e.name}", f"Array({e.type})", f"arrayMap(x -> {e.sql}, {path}.{c.field})")
                    for e in _columns(c.cols, "x", False)]
    return out


# -- (d) the way back: a row (read with read_sql) to the record's dict -------------------------------------------

def _var(name: str, prefix: str = "c_") -> str:
    """The generated code's variable for a column."""
    return prefix + re.sub(r"\W", "_", name)


def _back(cols: Sequence, reads: list[tuple[str, str]], many: str = "",
          extra: Sequence[tuple[str, str]] = ()) -> tuple[str, list[str]]:
    """(dict display of the record, the vars of its fields); ``reads`` gains (var, SELECT expression) per column.

    Inside ``many`` (an array of records) the display is per element: its vars are the elements of the arrays.
    """
    entries, fields = [], []
    for c in cols:
        if isinstance(c, Field):
            if c.length:
                continue  # the length of another field
            column = f"{many}.{c.name}" if many else c.name
            var = _var(c.name, "x_") if many else _var(column)
            reads.append((_var(column), read_sql(column, f"Array({c.type})" if many else c.type)))
            entries.append(f"{c.key!r}: ({var} or None)" if c.nullable else f"{c.key!r}: {var}")
            fields.append(var)
        elif isinstance(c, Rec):
            own = {f.key: _var(f.name, "x_") if many else _var(f.name) for f in cols if isinstance(f, Field)}
            inner, inner_fields = _back(c.cols, reads, many, [(k, own[k]) for k in c.inherit])
            if c.nullable:  # all zeros: it was null
                inner = f"({inner} if ({' or '.join(inner_fields)}) else None)"
            entries.append(f"{c.field!r}: {inner}")
            fields += inner_fields
        elif isinstance(c, Many):
            start = len(reads)
            inner, inner_fields = _back(c.cols, reads, c.field)
            outer = ", ".join(v for v, _ in reads[start:])
            entries.append(f"{c.field!r}: [{inner} for {', '.join(inner_fields)}, in zip({outer})]")
    entries += [f"{k!r}: {v}" for k, v in extra]
    return "{" + ", ".join(entries) + "}", fields


class Table:
    """One archive table: its columns (META first), DDL, Python row, ClickHouse SQL and way back."""

    def __init__(self, name: str, record: str, cols: Sequence):
        self.name, self.record, self.tree = name, record, tuple(cols)
        #: Every column in insert order: META, then the record's.
        self.columns: tuple[Column, ...] = META + tuple(_columns(self.tree, "value", False))
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            raise ValueError(f"table {name} declares a column twice")
        #: (decoded record, logical topic) -> the row after META, in column order.
        self.row: Callable[[dict, str], tuple] = _compile_row(name, self.tree)

    @property
    def names(self) -> list[str]:
        """Column names in insert order."""
        return [c.name for c in self.columns]

    def ddl(self) -> str:
        """CREATE TABLE IF NOT EXISTS; ReplacingMergeTree on the Kafka coordinates is the second line of defence
        against a record archived twice (the sink's watermarks are the first)."""
        cols = ",\n  ".join(f"`{c.name}` {c.type}" for c in self.columns)
        return (f"CREATE TABLE IF NOT EXISTS {DATABASE}.{self.name} (\n  {cols},\n  `archived_at` {_TS} DEFAULT "
                f"now64(3)\n) ENGINE = ReplacingMergeTree ORDER BY (run, topic, partition, offset)")

    @cached_property
    def _way_back(self) -> tuple[list[str], Callable[[Sequence], dict]]:
        """(SELECT expressions, generated row -> record dict), made on first use."""
        reads: list[tuple[str, str]] = []
        display, _ = _back(self.tree, reads)
        src = _Source()
        src.defs.append(f"def back(row):\n    {', '.join(v for v, _ in reads)}, = row\n    return {display}")
        return [sql for _, sql in reads], src.compile(f"{self.name} (way back)", "back")

    @property
    def back_sql(self) -> list[str]:
        """SELECT expressions of the columns the record is rebuilt from, in the order ``back`` takes them."""
        return self._way_back[0]

    def back(self, row: Sequence) -> dict:
        """The record's dict (as the codec reads it) from a row selected with ``back_sql``. A String column reads
        back as str, a bytes field's too: trajectories, the table replay rebuilds, have none."""
        return self._way_back[1](row)


# -- the tables --------------------------------------------------------------------------------------------------

#: The Kafka coordinates and headers every row starts with. The Python values come from the message
#: (decode.meta_row); the SQL reads the fields of the Avro wrapper decode.NativeTable writes.
META: tuple[Column, ...] = (
    Column("run", _LC, "run"), Column("topic", _LC, "topic"), Column("partition", "Int32", "partition"),
    Column("offset", "Int64", "reinterpretAsInt64(offset)"), Column("kafka_key", "String", "kafka_key"),
    Column("kafka_timestamp", _TS, _ts_sql("reinterpretAsInt64(kafka_timestamp)")),
    Column("header_policy_version", "Int32", "header_policy_version"),
    Column("header_reward_version", _LC, "header_reward_version"), Column("traceparent", "String", "traceparent"),
    Column("produced_at", _TS, _ts_sql("reinterpretAsInt64(produced_at)")))

TASK = (Field("task_id", "String"), Field("task_name", _LC), Field("env_name", _LC), Field("env_version", _LC),
        Field("prompt", "String"), Field("prompt_token_ids", "Array(Int32)", packed="Int32"),
        Field("answer", "Nullable(String)"), Field("task_metadata", "Map(String, String)", "metadata"),
        Field("group_size", "Int32"), Field("split", _LC), Field("max_turns", "Int32"),
        Field("task_created_at", _TS, "created_at", ts=True),
        Rec("sampling", (Field("temperature", "Float64"), Field("top_p", "Float64"), Field("top_k", "Int32"),
                         Field("max_tokens", "Int32"), Field("seed", "Nullable(Int64)"),
                         Field("stop", "Array(String)"))))
TOKENS = (Field("token_ids", "Array(Int32)", packed="Int32"), Field("loss_mask", "Array(UInt8)", packed="UInt8"),
          Field("behaviour_logprobs", "Array(Float32)", packed="Float32"),
          Field("n_tokens", "UInt32", "token_ids", length="Int32"))
TURNS = Many("turns", (
    Field("role", _LC), Field("text", "String"), Field("token_start", "Int32"), Field("token_end", "Int32"),
    Field("policy_version", "Int32"), Field("finish_reason", _LC),
    Rec("tool_call", (Field("tool_name", "String", "name"), Field("tool_arguments", "String", "arguments")),
        nullable=True),
    Rec("tool_result", (Field("tool_output", "String", "output"), Field("tool_exit_code", "Int32", "exit_code"),
                        Field("tool_duration_ms", "Float64", "duration_ms"),
                        Field("tool_truncated", "Bool", "truncated"),
                        Field("tool_failure_class", _LC, "failure_class", nullable=True)), nullable=True),
    Field("started_at", _TS, ts=True), Field("finished_at", _TS, ts=True),
    Field("segment_versions", "Array(Int32)"), Field("segment_tokens", "Array(Int32)")))
FAILURE = Rec("failure", (Field("failure_class", _LC), Field("failure_message", "String", "message"),
                          Field("failure_stage", _LC, "stage")), nullable=True)
#: A record's task repeats its group and trace ids, which are archived once, on the record.
_TASK_OF = Rec("task", TASK, inherit=("group_id", "trace_id"))
TRAJECTORY = ((Field("trajectory_id", "String"), Field("group_id", "String"), Field("sample_index", "Int32"), _TASK_OF,
               Field("response", "String")) + TOKENS
              + (TURNS, Field("min_policy_version", "Int32"), Field("max_policy_version", "Int32"),
                 Field("status", _LC), FAILURE, Field("stage_times", "Map(String, Int64)"),
                 Field("trace_id", "String")))
REWARD = (Field("reward_total", "Float64", "total"), Field("reward_breakdown", "Map(String, Float64)", "breakdown"),
          Field("violations", "Array(String)"), Field("reward_version", _LC), Field("verifier_version", _LC),
          Field("judge_version", _LC), Field("reward_latency_ms", "Float64", "latency_ms"),
          Field("reward_failure_class", _LC, "failure_class", nullable=True),
          Field("scored_at", _TS, ts=True), Field("turn_scores", "Array(Float64)"))
SCORED = (Rec("trajectory", TRAJECTORY), Rec("reward", REWARD))
_DIRECTION = {"actions": "action", "observations": "observation"}

TABLES: dict[str, Table] = {t.name: t for t in (
    Table("tasks", "Task", (Field("group_id", "String"),) + TASK + (Field("trace_id", "String"),)),
    Table("episodes", "Episode", (
        Derived("direction", _LC, lambda topic: _DIRECTION.get(topic, topic),
                "multiIf(" + "".join(f"topic = '{t}', '{d}', " for t, d in _DIRECTION.items()) + "topic)"),
        Field("episode_id", "String"), Field("group_id", "String"), Field("sample_index", "Int32"), _TASK_OF)
          + TOKENS + (TURNS, Field("done", "Bool"), FAILURE, Field("stage_times", "Map(String, Int64)"),
                      Field("trace_id", "String"))),
    Table("trajectories", "Trajectory", TRAJECTORY),
    Table("rewards", "ScoredTrajectory", SCORED),
    Table("feedback", "TeacherFeedback", (
        Rec("scored", SCORED), Field("teacher_version", _LC), Field("teacher_model", _LC),
        Field("teacher_logprobs", "Array(Float32)", packed="Float32"),
        Field("teacher_latency_ms", "Float64", "latency_ms"), Field("teacher_top_k", "Int32"),
        Field("teacher_topk_ids", "Array(Int32)", packed="Int32"),
        Field("teacher_topk_logprobs", "Array(Float32)", packed="Float32"),
        Field("teacher_status", _LC, "status"), Field("teacher_device", _LC),
        Field("teacher_failure_class", _LC, "failure_class"))),
    Table("policy_versions", "PolicyVersion", (
        Field("policy", _LC), Field("version", "Int32"), Field("weights_uri", "String"), Field("step", "Int64"),
        Field("parent_version", "Int32"), Field("samples_trained", "Int64"),
        Field("metrics", "Map(String, Float64)"), Field("trainer_id", "String"),
        Field("created_at", _TS, ts=True), Field("published_at", _TS, ts=True), Field("tokenizer_hash", "String"))),
    Table("dead_letters", "DeadLetter", (
        Field("stage", _LC), Field("reason", _LC), Field("error", "String"),
        Field("original_topic", "String", "topic"), Field("original_partition", "Int32", "partition"),
        Field("original_offset", "Int64", "offset"), Field("failed_at", _TS, ts=True),
        Field("key", "String", nullable=True, zero=b""), Field("value", "String", nullable=True, zero=b""),
        Field("headers", "Map(String, String)"), Field("trace_id", "String"))),
)}
#: Logical topic -> the table its records go to (anything else, undecodable records included: dead_letters).
TOPIC_TABLE = {"prompts": "tasks", "eval-prompts": "tasks", "actions": "episodes", "observations": "episodes",
               "trajectories": "trajectories", "rewards": "rewards", "eval-rewards": "rewards", "feedback": "feedback",
               "policy-versions": "policy_versions", "dead-letters": "dead_letters"}
