"""Avro single-object encoding for every rlstream record, with fastavro.

Each value is ``C3 01`` + the writer schema's CRC-64-AVRO fingerprint (8 bytes,
little-endian) + the Avro binary body. Every frozen version of every schema
lives in ``history/``, so a reader resolves any old record against the current
schema without a registry.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint, load_schema, to_parsing_canonical_form

from rlstream.schemas.packed import pack, unpack

AVRO_DIR = Path(__file__).parent / "avro"
HISTORY_DIR = Path(__file__).parent / "history"
MARKER = b"\xc3\x01"
HEADER_LEN = 10

#: The records that travel on topics (their nested types are not top level).
RECORDS = ("Task", "Episode", "Trajectory", "ScoredTrajectory", "TeacherFeedback", "PolicyVersion", "DeadLetter",
           "WeightChunk")


_pack, _unpack = pack, unpack  # the names the unit tests and older callers use


def packed_paths(schema: dict, prefix: tuple = ()) -> list[tuple[tuple[str, ...], str]]:
    """Paths to fields marked ``"rlstream.packed"`` in an expanded schema, with their kind."""
    out = []
    for f in schema.get("fields", []):
        path = prefix + (f["name"],)
        if "rlstream.packed" in f:
            out.append((path, f["rlstream.packed"]))
        elif isinstance(f["type"], dict) and f["type"].get("type") == "record":
            out += packed_paths(f["type"], path)
    return out


def _pack_record(record: dict, paths) -> dict:
    """A copy of ``record`` (copied only along packed paths) with those lists packed."""
    out = dict(record)
    for path, kind in paths:
        node = out
        for key in path[:-1]:
            node[key] = node = dict(node[key])
        value = node.get(path[-1])
        if value is not None and not isinstance(value, (bytes, bytearray)):
            node[path[-1]] = _pack(value, kind)
    return out


def _unpack_record(record: dict, paths, views: bool = False) -> None:
    for path, kind in paths:
        node = record
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = unpack(node[path[-1]], kind, views)


class DecodeError(ValueError):
    """A value that cannot be decoded; ``reason`` is the dead-letter reason code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def load_current(name: str) -> dict:
    """The current schema of a record, with its named types expanded."""
    return load_schema(AVRO_DIR / f"rlstream.{name}.avsc", _write_hint=False)


def schema_fingerprint(schema: dict) -> bytes:
    """The 8-byte little-endian CRC-64-AVRO fingerprint of a schema's canonical form."""
    canonical = to_parsing_canonical_form(parse_schema(schema, _write_hint=False))
    return int(fingerprint(canonical, "CRC-64-AVRO"), 16).to_bytes(8, "big")[::-1]


@dataclass(frozen=True)
class _Writer:
    name: str
    version: int
    schema: dict  # parsed


class Codec:
    """Encodes current-schema records and decodes any known version of any record."""

    def __init__(self, avro_dir: Path = AVRO_DIR, history_dir: Path = HISTORY_DIR):
        self._current: dict[str, tuple[bytes, dict]] = {}
        self._writers: dict[bytes, _Writer] = {}
        self._packed: dict[str, list] = {}
        for name in RECORDS:
            expanded = load_schema(avro_dir / f"rlstream.{name}.avsc", _write_hint=False)
            self._packed[name] = packed_paths(expanded)
            schema = parse_schema(expanded)
            fp = schema_fingerprint(schema)
            self._current[name] = (fp, schema)
            self._writers[fp] = _Writer(name, 0, schema)
        for name, version, path in iter_history(history_dir):
            schema = parse_schema(json.loads(path.read_text()))
            fp = schema_fingerprint(schema)
            # The current schema wins when it equals a frozen version.
            self._writers.setdefault(fp, _Writer(name, version, schema))

    def fingerprint(self, name: str) -> bytes:
        """The fingerprint the current schema of ``name`` writes."""
        return self._current[name][0]

    def encode(self, name: str, record: dict) -> bytes:
        """Single-object encode a dict that follows the current schema of ``name``."""
        fp, schema = self._current[name]
        paths = self._packed[name]
        buf = io.BytesIO()
        buf.write(MARKER)
        buf.write(fp)
        schemaless_writer(buf, schema, _pack_record(record, paths) if paths else record)
        return buf.getvalue()

    def encode_many(self, name: str, records: Sequence[dict]) -> list[bytes]:
        """Encode a batch of dicts of one record type: the schema and packed paths are looked up once, and token
        lists decoded unchanged (``TokenList``) are written as the bytes they came from."""
        fp, schema = self._current[name]
        paths = self._packed[name]
        head = MARKER + fp
        out = []
        for record in records:
            buf = io.BytesIO()
            buf.write(head)
            schemaless_writer(buf, schema, _pack_record(record, paths) if paths else record)
            out.append(buf.getvalue())
        return out

    def record_name(self, data: bytes) -> str:
        """Which record a value holds, read from its fingerprint alone."""
        return self._writer_of(data).name

    def decode(self, data: bytes, expect: str | None = None) -> tuple[str, dict]:
        """Decode a value into (record name, dict in the current schema's shape)."""
        writer = self._writer_of(data)
        if expect is not None and writer.name != expect:
            raise DecodeError("wrong_record", f"expected a {expect} record, got {writer.name}")
        return writer.name, self._body(writer, data)

    def decode_many(self, values: Sequence[bytes | None], expect: str | None = None, *, views: bool = False) \
            -> list[tuple[str, dict] | DecodeError]:
        """Decode a whole poll: per value, (record name, dict) or the DecodeError that value raised, in order, so
        one bad value is dead-lettered alone. Each writer schema is looked up once per batch, not once per value.
        ``views``: token arrays as read-only TokenViews over their bytes rather than lists."""
        out: list[tuple[str, dict] | DecodeError] = []
        writers: dict[bytes, _Writer] = {}
        for data in values:
            try:
                if data is None or len(data) < HEADER_LEN or data[:2] != MARKER:
                    raise DecodeError("malformed", "not an Avro single-object encoded value (bad marker or too short)")
                fp = bytes(data[2:HEADER_LEN])
                writer = writers.get(fp)
                if writer is None:
                    writer = writers[fp] = self._writer_of(data)
                if expect is not None and writer.name != expect:
                    raise DecodeError("wrong_record", f"expected a {expect} record, got {writer.name}")
                out.append((writer.name, self._body(writer, data, views)))
            except DecodeError as exc:
                out.append(exc)
        return out

    def _body(self, writer: _Writer, data: bytes, views: bool = False) -> dict:
        """The Avro body of ``data`` (written with ``writer``) in the current schema's shape, token arrays as
        TokenLists."""
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        try:
            # Resolution is only needed when the writer was an older version.
            value = schemaless_reader(buf, writer.schema, None if writer.version == 0 else self._current[writer.name][1])
        except Exception as exc:  # fastavro raises many types on corrupt bodies
            raise DecodeError("malformed", f"corrupt {writer.name} body: {type(exc).__name__}: {exc}") from None
        if buf.tell() != len(data):
            raise DecodeError("malformed", f"{len(data) - buf.tell()} trailing bytes after a {writer.name} record")
        try:
            _unpack_record(value, self._packed[writer.name], views)
        except (ValueError, TypeError) as exc:  # e.g. a packed int32 field whose length is not a multiple of 4
            raise DecodeError("malformed", f"bad packed array in a {writer.name} record: {exc}") from None
        return value

    def _writer_of(self, data: bytes) -> _Writer:
        if data is None or len(data) < HEADER_LEN or data[:2] != MARKER:
            raise DecodeError("malformed", "not an Avro single-object encoded value (bad marker or too short)")
        writer = self._writers.get(bytes(data[2:HEADER_LEN]))
        if writer is None:
            raise DecodeError("unknown_schema", f"unknown schema fingerprint {bytes(data[2:HEADER_LEN]).hex()}")
        return writer


def iter_history(history_dir: Path = HISTORY_DIR):
    """Yield (record name, version, path) for every frozen schema version."""
    for folder in sorted(p for p in history_dir.iterdir() if p.is_dir()):
        for path in sorted(folder.glob("v*.avsc"), key=lambda p: int(p.stem[1:])):
            yield folder.name, int(path.stem[1:]), path


@lru_cache(maxsize=1)
def default_codec() -> Codec:
    """The process-wide codec (schemas are parsed once)."""
    return Codec()


def encode(name: str, record: Any) -> bytes:
    """Encode a typed record or a dict with the default codec."""
    return default_codec().encode(name, record if isinstance(record, dict) else record.to_dict())


def decode(data: bytes, expect: str | None = None) -> tuple[str, dict]:
    """Decode a value with the default codec."""
    return default_codec().decode(data, expect)


