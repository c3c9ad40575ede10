"""Archived trajectories (or scored trajectories) rebuilt as records, for a replay whose topic's retention has
dropped them.

The row mapping is the trajectories table's way back (tables.py); this module only
filters and pages. Pages follow (partition, offset), the order the topic had.
"""
from __future__ import annotations

from rlstream.archive.query import DATABASE, open_archive
from rlstream.archive.tables import META, TABLES, read_sql
from rlstream.archive.views import quote
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import RECORD_TYPES, Record

#: The META columns a replayed record's coordinates and headers are rebuilt from, in the order page() reads them.
_COORDINATES = ("partition", "offset", "kafka_key", "header_policy_version", "header_reward_version", "traceparent",
                "produced_at")
_META_TYPES = {c.name: c.type for c in META}


class ArchivedTrajectories:
    """Trajectories of one run rebuilt from the archive, in (partition, offset) order, page by page (``table``
    rewards: the scored trajectories, which a teacher replay reads)."""

    def __init__(self, archive_url: str, run: str, *, since_ms: int | None = None, from_offset: int = -1,
                 versions: tuple[int | None, int | None] = (None, None), resume: dict[int, int] | None = None,
                 table: str = "trajectories"):
        self.run = run
        self._table = TABLES[table]
        self._select = ", ".join([read_sql(name, _META_TYPES[name]) for name in _COORDINATES]
                                 + self._table.back_sql)
        where = [f"run = {quote(run)}"]
        if since_ms is not None:
            where.append(f"kafka_timestamp >= fromUnixTimestamp64Milli({int(since_ms)}, 'UTC')")
        if from_offset >= 0:
            where.append(f"offset >= {int(from_offset)}")
        lo, hi = versions
        if lo is not None:
            where.append(f"header_policy_version >= {int(lo)}")
        if hi is not None:
            where.append(f"header_policy_version <= {int(hi)}")
        self._filters = where
        self._archive = open_archive(archive_url)
        self.resume(resume or {})

    def resume(self, done: dict[int, int]) -> None:
        """Skip, per partition, the offsets before ``done[partition]`` (what the replay's group committed)."""
        where = list(self._filters)
        if done:
            # A partition missing from the map reads 0 there, so only the resumed partitions are cut.
            parts, offsets = zip(*sorted((int(p), int(o)) for p, o in done.items()))
            where.append(f"offset >= mapFromArrays({list(parts)}::Array(Int32), "
                         f"{list(offsets)}::Array(Int64))[partition]")
        self._where = " AND ".join(where)

    def partitions(self) -> list[int]:
        """Partitions this run has archived rows for (whatever the filters)."""
        _, rows = self._archive.query(f"SELECT DISTINCT partition FROM {DATABASE}.{self._table.name} "
                                      f"WHERE run = {quote(self.run)} ORDER BY partition")
        return [int(r[0]) for r in rows]

    def count(self) -> int:
        """Rows matching the filters (after ``resume``)."""
        _, rows = self._archive.query(f"SELECT count() FROM {DATABASE}.{self._table.name} WHERE {self._where}")
        return int(rows[0][0])

    def page(self, after: tuple[int, int], limit: int) -> list[tuple[int, int, bytes, list, Record]]:
        """Up to ``limit`` rows strictly after (partition, offset) ``after``: (partition, offset, key, headers,
        record). Headers are the archived policy version, reward version (where there was one), traceparent (a new
        one if none) and produced_at."""
        partition, offset = after
        _, rows = self._archive.query(
            f"SELECT {self._select} FROM {DATABASE}.{self._table.name} WHERE {self._where} "
            f"AND (partition, offset) > ({int(partition)}, {int(offset)}) ORDER BY partition, offset "
            f"LIMIT {max(1, int(limit))}")
        record = RECORD_TYPES[self._table.record]
        out = []
        for row in rows:
            partition, offset, key, pv, reward_version, traceparent, produced = row[:len(_COORDINATES)]
            headers = hdr.build(pv, traceparent or hdr.new_traceparent(), reward_version or None, produced_at=produced)
            out.append((partition, offset, (key or "").encode("utf-8"), headers,
                        record.from_dict(self._table.back(row[len(_COORDINATES):]))))
        return out

    def close(self) -> None:
        """Release the archive (the engine, or the endpoint connection)."""
        self._archive.close()

    def __enter__(self) -> "ArchivedTrajectories":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
