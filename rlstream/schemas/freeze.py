"""Freeze the current schemas into history/ (run after an evolving change).

``python -m rlstream.schemas.freeze`` writes ``history/<Record>/v<N+1>.avsc`` for
every record whose current schema differs from its latest frozen version.
"""
from __future__ import annotations

import json
import sys

from fastavro.schema import expand_schema

from rlstream.schemas.codec import HISTORY_DIR, RECORDS, iter_history, load_current, schema_fingerprint


def freeze() -> list[str]:
    """Freeze changed schemas; return the paths written."""
    latest: dict[str, tuple[int, bytes]] = {}
    for name, version, path in iter_history():
        latest[name] = (version, schema_fingerprint(json.loads(path.read_text())))
    written = []
    for name in RECORDS:
        schema = load_current(name)
        version, fp = latest.get(name, (0, b""))
        if fp == schema_fingerprint(schema):
            continue
        path = HISTORY_DIR / name / f"v{version + 1}.avsc"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(expand_schema(schema), indent=1) + "\n")
        written.append(str(path))
    return written


if __name__ == "__main__":
    for p in freeze():
        print("froze", p)
    sys.exit(0)
