"""A record that carries another one on, written over the bytes that one arrived as.

Avro's binary encoding of a record is its fields' encodings one after another, with no lengths, offsets or padding.
So a ScoredTrajectory (``trajectory``, then ``reward``) is the Trajectory's body followed by the Reward's, and a
Trajectory whose only change is in its last fields (the reward stage adds its time to ``stage_times``; ``trace_id``
follows) is its arrived bytes up to those fields, then those fields encoded again. The reward stage (and a replay
of a topic, through it) writes its scored trajectories so: the ~9 KB Trajectory of a 1,000-token episode is not
converted to a dict and encoded field by field again, but copied, which was a third of that hop's Python
(``benchmarks/bus_hop.py``).

The invariant, enforced in ``Splice.keep``: arrived bytes are reused only when they were written with the carried
record's current schema and its tail fields, encoded again from their decoded values, give exactly the bytes the
value ends with. The project's codec writes every map in one block and every number in its shortest form, so a
value it wrote always passes, and the spliced value is byte for byte what encoding the whole record writes
(``tests/unit/test_batch_codec.py`` checks both with hypothesis). An older writer's value, or one whose tail was
written otherwise (a map in several blocks), gets None, and the caller encodes the record whole.

What a splicing stage promises in return: it changed nothing of the carried record before the tail. The reward
stage's judges read a trajectory and never edit it (its token arrays are read-only views already): the scored
trajectory carries the trajectory as the env stage wrote it, plus the reward stage's time.
"""
from __future__ import annotations

import io
from typing import Any

from fastavro import parse_schema, schemaless_writer

from rlstream.schemas.codec import HEADER_LEN, MARKER, _pack_record, default_codec, load_current, packed_paths
from rlstream.schemas.records import Record


def _plain(value: Any) -> Any:
    """A field's value as fastavro writes it (a nested record, or a list of them, as dicts)."""
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list) and value and isinstance(value[0], Record):
        return [v.to_dict() for v in value]
    return value


class _Fields:
    """Some consecutive fields of a record, encoded as a record of their own (which Avro writes as those fields
    would be written inside the whole one)."""

    def __init__(self, fields: list[dict], named: dict, label: str):
        expanded = {"type": "record", "name": f"rlstream.splice.{label}", "fields": fields}
        self.names = tuple(f["name"] for f in fields)
        self.paths = packed_paths(expanded)
        # The whole record's named types but those these fields define, so a field that names a type defined in an
        # earlier field resolves, and one defined here is not defined twice.
        defined = _defined(fields)
        # (Parsed with fastavro's hint, which its writer looks for: without it every write parses the schema again.)
        self.schema = parse_schema(expanded, named_schemas={k: v for k, v in named.items() if k not in defined})

    def bytes_of(self, record: Any) -> bytes:
        """These fields of ``record`` (an object with them as attributes), encoded."""
        values = {name: _plain(getattr(record, name)) for name in self.names}
        buf = io.BytesIO()
        schemaless_writer(buf, self.schema, _pack_record(values, self.paths) if self.paths else values)
        return buf.getvalue()


def _defined(node: Any) -> set[str]:
    """The full names of the named types defined (not just named) inside ``node`` of an expanded schema."""
    if isinstance(node, list):
        return set().union(*map(_defined, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    out = {node["name"]} if node.get("type") in ("record", "enum", "fixed") else set()
    for key in ("type", "fields", "items", "values"):
        if key in node:
            out |= _defined(node[key])
    return out


def _named(schema: dict) -> dict:
    named: dict = {}
    parse_schema(schema, named_schemas=named, _write_hint=False)
    return named


class Splice:
    """Writes record ``name`` over the arrived bytes of its field ``carried``, whose fields from ``tail_from`` on
    may have changed since it arrived (see the module docstring)."""

    def __init__(self, name: str, carried: str, tail_from: str):
        codec = default_codec()
        outer = load_current(name)
        named = _named(outer)
        index = [f["name"] for f in outer["fields"]].index(carried)
        carried_schema = outer["fields"][index]["type"]
        carried_name = carried_schema["name"].rsplit(".", 1)[-1]
        inner = load_current(carried_name)
        split = [f["name"] for f in inner["fields"]].index(tail_from)
        self._head = MARKER + codec.fingerprint(name)
        self._carried, self._carried_fp = carried, codec.fingerprint(carried_name)
        self._lead = _Fields(outer["fields"][:index], named, f"{name}Lead") if index else None
        self._tail = _Fields(inner["fields"][split:], named, f"{carried_name}Tail")
        self._rest = _Fields(outer["fields"][index + 1:], named, f"{name}Rest")

    def keep(self, wire: bytes | None, carried: Record) -> memoryview | None:
        """The arrived body of ``carried`` (decoded from ``wire``, unchanged since) without its tail: call it before
        changing the tail. None when ``wire`` cannot be reused (no wire, an older schema, a tail written otherwise)."""
        if wire is None or len(wire) < HEADER_LEN or wire[2:HEADER_LEN] != self._carried_fp:
            return None
        tail = self._tail.bytes_of(carried)
        if len(wire) - HEADER_LEN < len(tail) or not wire.endswith(tail):
            return None
        return memoryview(wire)[HEADER_LEN:len(wire) - len(tail)]

    def encode(self, kept: memoryview, record: Record) -> bytes:
        """The single-object value of ``record``, its carried field written as ``kept`` plus its tail as it is now."""
        # One join: the kept bytes (most of the value) are copied once, not into a buffer and out again.
        return b"".join((self._head, b"" if self._lead is None else self._lead.bytes_of(record), kept,
                         self._tail.bytes_of(getattr(record, self._carried)), self._rest.bytes_of(record)))
