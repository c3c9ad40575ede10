"""Kafka records to archive rows: in Python, or by ClickHouse (chDB) from an Avro container.

The row of a record's body comes from its table (tables.py); this module adds the
Kafka coordinates and headers every row starts with (META), keeps undecodable
records whole as dead letters, and wraps records for ClickHouse to decode itself.
"""
from __future__ import annotations

import json
import re
import secrets

from rlstream.archive.query import DATABASE
from rlstream.archive.tables import TABLES
from rlstream.kafka.records import Message
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import HEADER_LEN, load_current, packed_paths

# -- Python ------------------------------------------------------------------------------------------------------

_NO_HEADERS = (-1, b"", b"", 0)


def headers_of(m: Message) -> tuple[int, bytes, bytes, int]:
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


def meta_row(run: str, logical: str, m: Message) -> tuple:
    """The Kafka coordinates and headers every row starts with, in META's order."""
    ts = m.timestamp()[1]
    return (run, logical, m.partition(), m.offset(), m.key() or b"", ts if ts > 0 else 0) + headers_of(m)


def undecodable_row(m: Message, reason: str, error: str) -> tuple:
    """A record the archive cannot decode, kept whole in the dead_letters shape."""
    headers = {k: (v or b"") for k, v in (m.headers() or ())}
    letter = {"stage": "archive", "reason": reason, "error": error[:4000], "topic": m.topic(),
              "partition": m.partition(), "offset": m.offset(), "failed_at": hdr.now_ms(), "key": m.key(),
              "value": m.value(), "headers": headers, "trace_id": hdr.trace_id(headers.get(hdr.TRACEPARENT))}
    return TABLES["dead_letters"].row(letter, "dead-letters")


# -- ClickHouse (chDB) -------------------------------------------------------------------------------------------
# Python decoding caps ingest near 25k records/s on a small machine, so with chDB the sink wraps each record's
# Avro body with its Kafka coordinates into an Avro container and lets ClickHouse decode and flatten it with the
# table's SQL (a test compares both paths row for row).

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
    """Avro bytes: length, then the bytes."""
    return _long(len(b)) + b


class NativeTable:
    """How ClickHouse decodes one table's records: the wrapper schema and the INSERT ... SELECT."""

    def __init__(self, table: str):
        spec = TABLES[table]
        schema = load_current(spec.record)
        packed = {"value." + ".".join(path): kind for path, kind in packed_paths(schema)}
        # The fields META's SQL reads. Offsets and times travel as 8 fixed little-endian bytes: cheaper to write than varints in Python.
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
            """ARR / LEN of a field, as the current schema stores it (packed bytes or an Avro array)."""
            fn, kind, path = match.group(1), match.group(2), match.group(3)
            if path not in packed:
                return path if fn == "ARR" else f"length({path})"
            return f"reinterpret({path}, 'Array({kind})')" if fn == "ARR" else f"intDiv(length({path}), 4)"

        exprs = [re.sub(r"(ARR|LEN)\((\w+), ([\w.]+)\)", packed_sql, e) for e in (c.sql for c in spec.columns)]
        names = ", ".join(f"`{n}`" for n in spec.names)
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
            pv, rv, tp, produced = headers_of(m)
            ts = m.timestamp()[1]
            check = offset.to_bytes(8, "little", signed=True)
            extend((prefix, check, _bytes(m.key() or b""), (ts if ts > 0 else 0).to_bytes(8, "little", signed=True),
                    _long(pv), _bytes(rv), _bytes(tp), produced.to_bytes(8, "little", signed=True),
                    m.value()[HEADER_LEN:], check))  # a bytes copy: memoryviews would be tracked by the GC
        body = b"".join(parts)
        return self.header + _long(len(msgs)) + _long(len(body)) + body + _SYNC

